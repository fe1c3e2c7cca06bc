"""The FP8 (e4m3) forward against tvmflash's own bf16 forward on an sm90 GPU, in one process: TFLOP/s and
the ratio (issue 44's goal: FP8 >= 1.5x bf16 at d128 and d256 from 4k tokens). Every kernel is built first,
in parallel processes that share the module cache; then each shape times bf16, FP8 through its call (V
transposed and padded in torch each call) and FP8's module alone (V transposed once, before), in turns.
Each shape holds 16k tokens (batch = 16384 / seqlen) and 2048 / head_dim heads, as FA3's benchmark. The
FP8 error (max |out - float64 reference|, on the same dequantised inputs) is printed beside bf16's. FP8 runs
with the schedule's knobs ("default") and the VARIANTS of its head_dim (knobs over them; each built by
ptxas without spills on the CPU).

    python benchmarks/fp8_bench.py [--head-dims 128 256] [--seqlens 4096 8192 16384] [--causal both] [--jobs 8]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import tempfile
import time

os.environ.setdefault("TVMFLASH_CACHE_DIR", tempfile.mkdtemp())

from tvmflash.schedules.sm90.knobs import FP8_VARIANTS as VARIANTS  # noqa: E402 - after the cache dir


def _build(job):
    """One kernel's module, built into the shared cache (a worker process)."""
    kind, head_dim, causal, heads = job
    start = time.perf_counter()
    try:
        if kind != "bf16":
            from tvmflash.kernels.fp8 import Fp8Kernel

            Fp8Kernel(head_dim, causal, "cuda", knobs=_knobs(kind, head_dim)).build.module(heads, heads)
        else:
            import tvmflash

            tvmflash.compile(head_dim=head_dim, dtype="bfloat16", causal=causal, target="cuda").build.module(heads, heads)
        return job, None, time.perf_counter() - start
    except Exception as err:  # noqa: BLE001 - reported, and the shape skipped
        return job, f"{type(err).__name__}: {err}"[:400], time.perf_counter() - start


def _knobs(kind: str, head_dim: int) -> dict | None:
    """The knobs of FP8 variant ``kind`` ("fp8" for the default, "fp8:NAME" for VARIANTS' NAME)."""
    return None if kind == "fp8" else VARIANTS[head_dim][kind.split(":", 1)[1]]


def _time(fn, repeat: int) -> float:
    """Median milliseconds of fn() over ``repeat`` runs of a few calls each, after a warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 3)
    times.sort()
    return times[len(times) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    causals = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]

    kinds = {d: ["fp8", *(f"fp8:{name}" for name in VARIANTS.get(d, {}))] for d in args.head_dims}
    jobs = [(kind, d, c, 2048 // d) for d in args.head_dims for c in causals for kind in ("bf16", *kinds[d])]
    start = time.perf_counter()
    with mp.get_context("spawn").Pool(min(args.jobs, len(jobs))) as pool:
        failed = {}
        for job, error, seconds in pool.imap_unordered(_build, jobs):
            print(f"built {job[0]} d{job[1]}{' causal' if job[2] else ''} in {seconds:.0f} s"
                  + (f": FAILED {error}" if error else ""), flush=True)
            if error:
                failed[job] = error
    print(f"builds: {time.perf_counter() - start:.0f} s", flush=True)

    import torch

    import tvmflash
    from tvmflash.kernels.fp8 import Fp8Kernel, transposed_v

    print(torch.cuda.get_device_name(), flush=True)
    print(f"{'shape':34} {'fp8 knobs':10} {'bf16':>8} {'fp8 call':>9} {'fp8 kern':>9} {'ratio':>6} {'kern ratio':>10}  "
          f"{'bf16 err':>9} {'fp8 err':>9}   (TFLOP/s; err: max |out - float64|)")
    for head_dim in args.head_dims:
        heads = 2048 // head_dim
        for causal in causals:
            if ("bf16", head_dim, causal, heads) in failed:
                print(f"d{head_dim}{' causal' if causal else ''}: skipped (bf16's build failed)")
                continue
            bf16 = tvmflash.compile(head_dim=head_dim, dtype="bfloat16", causal=causal, target="cuda")
            for seqlen, kind in ((seqlen, kind) for seqlen in args.seqlens for kind in kinds[head_dim]):
                if (kind, head_dim, causal, heads) in failed:
                    continue
                fp8 = Fp8Kernel(head_dim, causal, "cuda", knobs=_knobs(kind, head_dim))
                batch = max(1, args.tokens // seqlen)
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", generator=gen)
                           for _ in range(3))
                descales = [torch.rand(batch, heads, device="cuda", generator=gen) + 0.5 for _ in range(3)]
                q8, k8, v8 = ((x / d[:, None, :, None]).to(torch.float8_e4m3fn)
                              for x, d in zip((q, k, v), descales))
                qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
                scale = head_dim ** -0.5
                out_b = bf16(qb, kb, vb, softmax_scale=scale)
                out_8 = fp8(q8, k8, v8, *descales, softmax_scale=scale)
                keys = max(math.ceil(seqlen / fp8.knobs["block_n"]), fp8.min_kv_tiles) * fp8.knobs["block_n"]
                vt = transposed_v(v8, keys)
                module = fp8.build.module_for(heads, heads, q=q8, k=k8, v=vt, out=out_8)
                lse = torch.empty(batch, heads, seqlen, device="cuda")
                t_b = _time(lambda: bf16(qb, kb, vb, softmax_scale=scale, out=out_b), args.repeat)
                t_8 = _time(lambda: fp8(q8, k8, v8, *descales, softmax_scale=scale), args.repeat)
                t_k = _time(lambda: module.function(q8, k8, vt, out_8, lse, scale, *descales), args.repeat)
                flops = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
                tf = [flops / (t * 1e-3) / 1e12 for t in (t_b, t_8, t_k)]
                errors = ["-", "-"]
                if seqlen <= 4096:  # the float64 reference of one batch entry's first 1024 queries
                    qs = slice(0, min(seqlen, 1024))
                    b0 = [x[:1].double() for x in (q8, k8, v8)]
                    b0 = [x * d[:1, None, :, None].double() for x, d in zip(b0, descales)]
                    s = torch.einsum("bqhd,bkhd->bhqk", b0[0][:, qs], b0[1]) * scale
                    if causal:
                        s = s.masked_fill(~torch.ones(seqlen, seqlen, dtype=torch.bool, device="cuda").tril()[qs], -math.inf)
                    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), b0[2])
                    out_8 = fp8(q8, k8, v8, *descales, softmax_scale=scale)
                    out_b = bf16(*(x[:1].double().mul(d[:1, None, :, None].double()).to(torch.bfloat16)
                                   for x, d in zip((q8, k8, v8), descales)), softmax_scale=scale)
                    errors = [f"{(o[:1, qs].double() - ref).abs().max().item():.2e}" for o in (out_b, out_8)]
                name = f"d{head_dim} {'causal' if causal else 'full':6} b{batch} s{seqlen} h{heads}"
                print(f"{name:34} {kind.split(':')[-1]:10} {tf[0]:8.1f} {tf[1]:9.1f} {tf[2]:9.1f} {tf[1] / tf[0]:6.2f} {tf[2] / tf[0]:10.2f}  "
                      f"{errors[0]:>9} {errors[1]:>9}", flush=True)


if __name__ == "__main__":
    main()
