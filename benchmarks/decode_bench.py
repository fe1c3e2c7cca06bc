"""Decode over a KV cache on this GPU: tvmflash.flash_attn_with_kvcache against PyTorch SDPA's flash and
cuDNN backends, timed in the same run (tvmflash.bench.time_backends: interleaved rounds, short bursts).

    python benchmarks/decode_bench.py                       # issue 24's grid: GQA 32/8, d128, bf16,
                                                            # batch 1/8/32, KV 4k/16k/64k, contiguous + paged 16
    python benchmarks/decode_bench.py --batch 32 --seqlen 16384 --splits 1 2 4 8   # split counts side by side
    python benchmarks/decode_bench.py --knobs '{}' '{"num_stages": 3}' '{"schedule": "simt"}'
                                                            # knob sets side by side ({}: the defaults;
                                                            # "schedule": "simt" or "sm80" picks one)
    python benchmarks/decode_bench.py --batch 32 --seqlen 16384 --page-size 0 256 --fp8
                                                            # an FP8 (e4m3) cache beside the bf16 one: tokens/s,
                                                            # GB/s of each, and the FP8 cache's speed-up
    python benchmarks/decode_bench.py --eager               # plain calls instead of CUDA-graph replays
    python benchmarks/decode_bench.py --plot decode.png     # and a figure: GB/s against the KV length,
                                                            # a panel per batch, beside a copy's GB/s

One query token per sequence, every sequence with the full KV length. Bandwidth is the K and V cache
bytes a step must read (batch * seqlen * heads_kv * head_dim * 2 bytes, twice) over the time, in TB/s.
Each backend runs as a CUDA graph replay by default (a decode step is captured so in serving): that
times the GPU work and not the Python around it; ``--eager`` times plain calls queued back to back.
Where the K/V of one problem would fit in L2 (small batch and length), each call reads the next of
several copies, so that the figures are HBM's. SDPA has no paged cache: paged rows compare against
its contiguous times. Each tvmflash configuration is checked first against float32 (flash-attn's
rule: error at most 2x PyTorch's bf16 error + 1e-5) on sequence 0.

--fp8 times an FP8 cache too (issue 44: e4m3 with per-head descales, ``flash_attn_with_kvcache``'s
k_descale and v_descale): the same problems quantised to e4m3, checked on the dequantised cache, with
their own bytes (half of bf16's) in GB/s, tokens/s (sequences a second: one query token each) and the
speed-up over the bf16 cache's row of the same layout. SDPA (bf16) stays the reference.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from tvmflash import bench, kernels, plot

FP8 = torch.float8_e4m3fn

L2_BYTES = 64 << 20  # at least the L2 of an H100/H200 (50/60 MiB): working sets are kept 4x larger


def make_problem(batch, seqlen, heads_q, heads_kv, head_dim, dtype, page_size, device, seed, fp8=False):
    """q, caches, lengths and block table (or None) for one decode step with every sequence full; fp8:
    the caches in e4m3, with descales (batch, heads_kv) (FA3's k_descale, v_descale)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, 1, heads_q, head_dim, device=device, dtype=dtype, generator=gen)
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device=device)
    if page_size:
        pages = batch * seqlen // page_size
        shape = (pages, page_size, heads_kv, head_dim)
        table = torch.randperm(pages, device=device, generator=gen).to(torch.int32).reshape(batch, -1)
    else:
        shape, table = (batch, seqlen, heads_kv, head_dim), None
    k = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    v = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    problem = {"q": q, "k_cache": k, "v_cache": v, "lengths": lengths, "table": table}
    if fp8:  # amax-scaled per (sequence, head), as an engine quantises: 448 is e4m3's largest value
        descales = {}
        for name in ("k", "v"):
            descales[name] = torch.full((batch, heads_kv), 4.0 / 448, device=device)
            problem[f"{name}_cache"] = (problem[f"{name}_cache"].float() * (448 / 4.0)).clamp(-448, 448).to(FP8)
        problem["descales"] = descales
    return problem


def contiguous_kv(problem, b):
    """Sequence b's keys and values, (1, seqlen, heads_kv, head_dim), from either layout (an FP8 cache
    dequantised, in float32)."""
    k, v, table = problem["k_cache"], problem["v_cache"], problem["table"]
    if table is None:
        k, v = k[b:b + 1], v[b:b + 1]
    else:
        pages = table[b].long()
        k, v = k[pages].flatten(0, 1)[None], v[pages].flatten(0, 1)[None]
    if "descales" in problem:
        d = problem["descales"]
        k, v = (t.float() * d[n][b][None, None, :, None] for t, n in ((k, "k"), (v, "v")))
    return k, v


def check(out, problem):
    """(our error, tolerance) on sequence 0 against float32 attention (GQA by repeating K/V heads)."""
    q = problem["q"][:1]
    k, v = contiguous_kv(problem, 0)
    group = q.shape[2] // k.shape[2]

    def attend(dtype):
        qh, kh, vh = (t.to(dtype).transpose(1, 2) for t in (q, k, v))  # (an FP8 cache: in q's dtype)
        kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
        s = (qh @ kh.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        return (torch.softmax(s.float(), -1).to(dtype) @ vh).transpose(1, 2)

    ref = attend(torch.float32)
    ours = (out[:1].float() - ref).abs().max().item()
    theirs = (attend(q.dtype).float() - ref).abs().max().item()
    return ours, 2 * theirs + 1e-5


def tvmflash_call(problem, kernel, num_splits):
    index = problem["table"] if problem["table"] is not None else kernel.batch_rows(problem["q"].shape[0],
                                                                                    problem["q"].device)
    out = torch.empty_like(problem["q"])
    descales = {f"{n}_descale": d for n, d in problem["descales"].items()} if "descales" in problem else {}

    def call():
        kernel(problem["q"], problem["k_cache"], problem["v_cache"], problem["lengths"], index,
               num_splits=num_splits, out=out, **descales)
        return out
    return call


def sdpa_calls(problem, device):
    """{backend: call} for SDPA's flash and cuDNN backends on a contiguous problem (enable_gqa; a
    backend that refuses it gets K/V with repeated heads, which it reads whole: marked with '*')."""
    q = problem["q"].transpose(1, 2)
    k, v = problem["k_cache"].transpose(1, 2), problem["v_cache"].transpose(1, 2)
    calls = {}
    for name, backend in bench.sdpa_backends(device):
        def gqa(backend=backend):
            with backend():
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        try:
            gqa()
            calls[name] = gqa
            continue
        except RuntimeError:
            pass
        group = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

        def repeated(backend=backend, kr=kr, vr=vr):
            with backend():
                return torch.nn.functional.scaled_dot_product_attention(q, kr, vr)
        try:
            repeated()
            calls[name + "*"] = repeated
        except RuntimeError:
            calls[name] = None
    return calls


def rotating(calls, graph):
    """One callable that runs the next of ``calls`` each time; each captured in a CUDA graph first
    (after a warm-up call) when ``graph``."""
    if graph:
        graphs = []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for call in calls:
                call()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    call()
                graphs.append(g)
        torch.cuda.current_stream().wait_stream(stream)
        calls = [g.replay for g in graphs]
    state = {"i": 0}

    def run():
        calls[state["i"] % len(calls)]()
        state["i"] += 1
    return run


def knob_set(knobs: dict) -> dict:
    """compile_decode's arguments for a --knobs set: its "schedule" key ("sm80" or "simt") picks the
    schedule, the rest are that schedule's knobs ({}: the defaults)."""
    knobs = dict(knobs)
    schedule = knobs.pop("schedule", None)
    return {"knobs": knobs or None, "schedule": schedule}


def prebuild(args, heads_q, heads_kv):
    """Build every (page size, knob set) module in ``args.jobs`` processes at once, into the disk
    cache that the timed kernels then load (a fresh temporary one unless TVMFLASH_CACHE_DIR is set)."""
    import os
    import subprocess
    import sys
    import tempfile

    os.environ.setdefault("TVMFLASH_CACHE_DIR", tempfile.mkdtemp(prefix="tvmflash-decode-bench-"))
    code = ("import json, sys, torch; from tvmflash import kernels; "
            "kernels.compile_decode(head_dim=int(sys.argv[1]), dtype=getattr(torch, sys.argv[2]), "
            "page_size=int(sys.argv[3]), heads_q=int(sys.argv[5]), heads_kv=int(sys.argv[6]), "
            "**json.loads(sys.argv[4]))")
    pending = [[sys.executable, "-c", code, str(args.head_dim), args.dtype, str(page_size),
                json.dumps({**knob_set(knobs), **({"cache_dtype": "float8_e4m3fn"} if fp8 else {})}),
                str(heads_q), str(heads_kv)]
               for page_size in args.page_size for knobs in args.knobs for fp8 in caches(args)]
    running = []
    while pending or running:
        while pending and len(running) < args.jobs:
            running.append(subprocess.Popen(pending.pop()))
        running[0].wait()
        running = [p for p in running if p.poll() is None]


def caches(args) -> tuple[bool, ...]:
    """The caches to time: bf16 (or fp16), and with --fp8 an FP8 one too (False, True)."""
    return (False, True) if args.fp8 else (False,)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HEADS_Q", "HEADS_KV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--page-size", type=int, nargs="+", default=[0, 16],
                        help="0: a contiguous cache; else a paged one with pages of that many rows (default: 0 16)")
    parser.add_argument("--splits", type=int, nargs="+", default=[0],
                        help="tvmflash split counts to time side by side (0: its own choice; default 0)")
    parser.add_argument("--knobs", type=json.loads, nargs="+", default=[{}],
                        help="decode knob sets to time side by side, JSON each ({}: the defaults; "
                             "\"schedule\": \"simt\" or \"sm80\" picks the schedule whose decode knobs the rest are)")
    parser.add_argument("--fp8", action="store_true",
                        help="time an FP8 (e4m3, per-head descales) cache beside the bf16 one, with tokens/s and "
                             "its speed-up")
    parser.add_argument("--eager", action="store_true", help="time plain calls, not CUDA-graph replays")
    parser.add_argument("--jobs", type=int, default=1,
                        help="build the knob sets' modules in this many processes first (into TVMFLASH_CACHE_DIR)")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to try the script on small shapes")
    parser.add_argument("--plot", metavar="FILE", help="draw the run to FILE (.png, .svg or .pdf; needs matplotlib)")
    args = parser.parse_args()
    if args.plot:
        plot.check(args.plot)  # before minutes of measuring

    device = torch.device(args.device)
    args.eager |= device.type != "cuda"
    dtype = getattr(torch, args.dtype)
    heads_q, heads_kv = args.heads
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"decode bench on {device_name}: GQA {heads_q}/{heads_kv}, d{args.head_dim}, "
          f"{args.dtype}, one query token, {'eager calls' if args.eager else 'CUDA-graph replays'}")
    if args.jobs > 1:
        prebuild(args, heads_q, heads_kv)
    built = {(page_size, k, fp8): kernels.compile_decode(head_dim=args.head_dim, dtype=dtype, page_size=page_size,
                                                         cache_dtype=FP8 if fp8 else None, **knob_set(knobs))
             for page_size in args.page_size for k, knobs in enumerate(args.knobs) for fp8 in caches(args)}
    header = None
    panels = {}  # for --plot: {f"batch {b}": {line: [(seqlen, GB/s)]}}
    for batch in args.batch:
        for seqlen in args.seqlen:
            kv_bytes = 2 * batch * seqlen * heads_kv * args.head_dim * dtype.itemsize
            # Enough copies that the K/V come from HBM, not L2 (at most 64: the smallest grid problem needs 16).
            copies = min(64, math.ceil(4 * L2_BYTES / kv_bytes)) if device.type == "cuda" else 1
            # Every backend and layout of this shape in one time_backends call: the same rounds and clocks.
            problems = {(page_size, fp8): [make_problem(batch, seqlen, heads_q, heads_kv, args.head_dim, dtype,
                                                        page_size, device, seed, fp8) for seed in range(copies)]
                        for page_size in sorted(set(args.page_size) | {0}) for fp8 in caches(args)}
            calls, rows = {}, []
            for (page_size, k, fp8), kernel in built.items():
                for splits in args.splits:
                    name = f"{page_size}/{k}/{splits}/{fp8}"
                    runs = [tvmflash_call(p, kernel, splits) for p in problems[(page_size, fp8)]]
                    rows.append((name, page_size, k, fp8, splits, *check(runs[0](), problems[(page_size, fp8)][0])))
                    calls[name] = rotating(runs, graph=not args.eager)
            per_copy = [sdpa_calls(p, device) for p in problems[(0, False)]]
            sdpa = [name for name in per_copy[0] if per_copy[0][name] is not None]
            for name in sdpa:
                calls[name] = rotating([c[name] for c in per_copy], graph=not args.eager)
            times = bench.time_backends(calls, device, args.repeat)
            if header is None:
                header = (f"{'config':<46}{'tvmflash us':>12}{'TB/s':>6}{'Mtok/s':>8}"
                          + "".join(f"{n + ' us':>16}{'TB/s':>6}" for n in sdpa)
                          + "".join(f"{'vs ' + n:>15}" for n in sdpa) + (f"{'vs bf16':>9}" if args.fp8 else "")
                          + f"{'max err':>10} ok")
                print(header)
                print("-" * len(header))
            for name, page_size, k, fp8, splits, error, tolerance in rows:
                auto = built[(page_size, k, fp8)].auto_num_splits(batch, heads_kv, 1, seqlen, device,
                                                                  heads_q // heads_kv)
                layout = f"paged{page_size}" if page_size else "contiguous"
                knobs = f" k{k}" if len(args.knobs) > 1 else ""
                length = f"{seqlen // 1024}k" if seqlen % 1024 == 0 else str(seqlen)
                cache = " fp8" if fp8 else (" bf16" if args.fp8 else "")
                config = f"b{batch} kv{length} {layout}{cache}{knobs} splits {splits or f'auto={auto}'}"
                ms, own_bytes = times[name], kv_bytes // 2 if fp8 else kv_bytes  # (e4m3: a byte an element)
                row = f"{config:<46}{ms * 1e3:>12.1f}{own_bytes / ms / 1e9:>6.2f}{batch / ms / 1e3:>8.3f}"
                row += "".join(f"{times[n] * 1e3:>16.1f}{kv_bytes / times[n] / 1e9:>6.2f}" for n in sdpa)
                row += "".join(f"{times[n] / ms:>14.2f}x" for n in sdpa)
                if args.fp8:
                    bf16 = times[name.rsplit("/", 1)[0] + "/False"]
                    row += f"{bf16 / ms:>8.2f}x"
                print(row + f"{error:>10.2e} {'yes' if error <= tolerance else 'NO'}")
                split_label = f" splits {splits}" if len(args.splits) > 1 else ""
                lines = panels.setdefault(f"batch {batch}", {})
                lines.setdefault(f"tvmflash {layout}{cache}{knobs}{split_label}", []).append((seqlen, own_bytes / ms / 1e6))
            for n in sdpa:
                panels[f"batch {batch}"].setdefault(n, []).append((seqlen, kv_bytes / times[n] / 1e6))
            del problems, calls, per_copy
            torch.cuda.empty_cache()
    for (page_size, k, fp8), kernel in built.items():
        info = kernel.info()
        print(f"tvmflash {'paged ' + str(page_size) if page_size else 'contiguous'}{' fp8' if fp8 else ''}"
              f"{f' k{k}' if len(args.knobs) > 1 else ''}: {info['schedule']} schedule, {info['knobs_source']} "
              f"knobs {info['knobs']}")
    if args.plot:
        ceilings = bench.measure_ceilings(device, args.dtype, args.repeat)
        plot.plot_bandwidth(panels, ceilings.copy_gbps, f"decode: flash_attn_with_kvcache against PyTorch SDPA, GQA "
                            f"{heads_q}/{heads_kv}, d{args.head_dim}, {args.dtype}, one query token\n{device_name}; a copy in "
                            f"the same run: {ceilings.copy_gbps:.0f} GB/s (read + write)", args.plot)
        print(f"drawn to {args.plot}")
    print("vs X: X's time over tvmflash's (>1: tvmflash faster). X* : X took no GQA and ran on K/V with repeated "
          "heads. SDPA has no paged cache: paged rows compare with its contiguous times. TB/s: K+V cache bytes "
          "a step reads over its time (an FP8 cache's own: half of bf16's). Mtok/s: sequences (one token each) a "
          "second. vs bf16: the bf16 cache's time over the FP8 cache's, same layout (issue 44's goal: >= 1.8x)")


if __name__ == "__main__":
    main()
