"""The backward pass alone, for sets of backward knobs, against SDPA's flash and cuDNN backward in the
same run (bf16, bench's grid: b·n = 16k tokens, h·d = 2048).

    python benchmarks/backward_knobs.py --head-dims 128 --seqlens 2048 8192 \\
        --knobs '{}' '{"block_n": 128, "dkdv_warps": 8}'

Every kernel is built first, in ``--jobs`` processes at once (a backward module takes about half a
minute to build); then each configuration is timed with ``tvmflash.bench``'s clock-fair rounds: one
call of the BackwardKernel against ``torch.autograd.grad`` of SDPA's output in each backend (and,
with ``--passes``, each of its programs alone). '{}' is the schedule's defaults; a knob set's
"schedule" picks the schedule (TVMFLASH_BACKWARD: "sm80", "sm90", "simt"), e.g. '{"schedule": "sm80"}'.
TFLOP/s count the backward as flash-attn does: 2.5× the forward's FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

import tvmflash
from tvmflash import bench


def sdpa_backward(backend, q, k, v, dout, causal):
    """A call of SDPA's backward alone, in ``backend``, on a graph recorded once."""
    with backend():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal).transpose(1, 2)

    def call():
        with backend():
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return call


def program_calls(kernel, q, k, v, out, dout, lse):
    """A call of each program of a BackwardKernel (``program_backward.programs``) on its own, in the
    order and with the arguments that ``BackwardKernel.__call__`` gives them."""
    programs = kernel.module(q.shape[2], k.shape[2]).function
    delta, lse2, dlse = (torch.zeros_like(lse) for _ in range(3))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5
    accumulator = kernel.dq_accumulator(q)
    programs["delta"](out, dout, lse, dlse, delta, lse2)
    calls = {"delta": lambda: programs["delta"](out, dout, lse, dlse, delta, lse2),
             "dkdv": lambda: programs["dkdv"](q, k, v, dout, lse2, delta, dk, dv, scale, *accumulator)}
    if accumulator:
        calls["convert_dq"] = lambda: programs["convert_dq"](*accumulator, dq, scale)
    else:
        calls["dq"] = lambda: programs["dq"](q, k, v, dout, lse2, delta, dq, scale)
    return calls


def check_gradients(name, gradients, q, k, v, dout, causal):
    """Print each gradient's largest error against float32 attention, on two heads, beside what
    flash-attn's rule allows (2x bf16 attention's + 1e-5: ``bench.gradient_errors_vs_float32``)."""
    for grad_name, (err, allowed) in zip(("dq", "dk", "dv"), bench.gradient_errors_vs_float32(gradients, q, k, v, dout,
                                                                                            causal)):
        print(f"  check {name} {grad_name}: error {err:.2e}, allowed {allowed:.2e}" + ("" if err <= allowed else "  FAILED"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--causal", choices=["both", "no", "yes"], default="both")
    parser.add_argument("--knobs", nargs="+", default=["{}"], help="JSON dicts of backward knobs")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--passes", action="store_true", help="also time the last knob set's delta, dkdv and dq alone")
    parser.add_argument("--check", action="store_true", help="first check each knob set's gradients against float32")
    args = parser.parse_args(argv)
    knob_sets = [json.loads(k) for k in args.knobs]
    schedules = [{"TVMFLASH_BACKWARD": knobs.pop("schedule")} if "schedule" in knobs else {} for knobs in knob_sets]
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    grid = bench.GPU_GRID
    bench.build_in_parallel([("compile_backward", {"head_dim": d, "dtype": "bfloat16", "causal": c, "knobs": k or None,
                                                    "heads_q": grid["hidden"] // d, "heads_kv": grid["hidden"] // d},
                              env)
                             for d in args.head_dims for c in causals
                             for k, env in zip(knob_sets, schedules)], args.jobs)
    device = torch.device("cuda")
    for head_dim in args.head_dims:
        for causal in causals:
            for seqlen in args.seqlens:
                batch, heads = max(1, grid["tokens"] // seqlen), grid["hidden"] // head_dim
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=torch.bfloat16)
                           .requires_grad_() for _ in range(3))
                dout = torch.randn_like(q)
                out, lse = tvmflash.attention(q.detach(), k.detach(), v.detach(), causal=causal, return_lse=True)
                calls = {}
                for n, (knobs, env) in enumerate(zip(knob_sets, schedules)):
                    with bench.environment(env):
                        kernel = tvmflash.compile_backward(head_dim=head_dim, dtype="bfloat16", causal=causal,
                                                           knobs=knobs or None)
                    calls[f"knobs{n}"] = lambda kernel=kernel: kernel(q, k, v, out, dout, lse)
                    if args.check:
                        check_gradients(f"d{head_dim} {'causal' if causal else 'full'} {seqlen} knobs{n}",
                                        kernel(q, k, v, out, dout, lse), q, k, v, dout, causal)
                if args.passes:
                    calls.update(program_calls(kernel, q, k, v, out, dout, lse))
                for name, backend in bench.sdpa_backends(device):
                    calls[name] = sdpa_backward(backend, q, k, v, dout, causal)
                ms = bench.time_backends(calls, device, args.repeat)
                flops = 2.5 * bench.attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
                row = "  ".join(f"{name} {t:.3f} ({flops / t / 1e9:.0f})" for name, t in ms.items())
                print(f"d{head_dim} {'causal' if causal else 'full'} {seqlen:>5}  {row}", flush=True)
    for n, (knobs, env) in enumerate(zip(knob_sets, schedules)):
        print(f"knobs{n}: {knobs or 'defaults'} {env or ''}")


if __name__ == "__main__":
    main()
