"""Forward + backward time of tvmflash against PyTorch's SDPA backends, over bench's grid.

    python examples/bench_backward.py                        # bf16, d64 and d128, causal or not
    python examples/bench_backward.py --head-dims 128 --seqlens 2048 8192 --no-causal
    python examples/bench_backward.py --dropout-p 0.1        # with dropout, SDPA's too

Each call is out = attention(q, k, v); out.backward(dout) on fresh gradients, timed with
``tvmflash.bench``'s clock-fair rounds. TFLOP/s counts flash-attn's way: the backward is 2.5x the
forward's FLOPs (5 GEMMs to 2), so forward + backward is 3.5x, halved when causal.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import tvmflash
from tvmflash import bench
from tvmflash.ops import head_dim_to_run


def fwd_bwd(attention, q, k, v, dout):
    """A call that runs attention forward and backward, as a model's step does."""
    def call():
        for t in (q, k, v):
            t.grad = None
        attention(q, k, v).backward(dout)
    return call


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    grid = bench.GPU_GRID if device.type == "cuda" else bench.CPU_GRID
    parser.add_argument("--dtype", default="bfloat16" if device.type == "cuda" else "float32")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=grid["seqlens"])
    parser.add_argument("--no-causal", action="store_true", help="only non-causal")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="processes that build the kernels first")
    parser.add_argument("--dropout-p", type=float, default=0.0, help="dropout on every backend (SDPA's where it has it)")
    args = parser.parse_args(argv)
    p = args.dropout_p
    dtype = getattr(torch, args.dtype)
    causals = (False,) if args.no_causal else (False, True)
    if device.type == "cuda":  # every module first, on every core
        # at the head_dim the kernels run (a head_dim they do not serve is padded to one they do)
        bench.build_in_parallel([(name, {"head_dim": head_dim_to_run(device, dtype, d, True), "dtype": args.dtype,
                                         "causal": c, "heads_q": grid["hidden"] // d, "heads_kv": grid["hidden"] // d,
                                         **({"dropout": True} if p else {})})
                                 for name in ("compile", "compile_backward") for d in args.head_dims for c in causals],
                                args.jobs)
    print(f"{'d':>4} {'causal':>6} {'seqlen':>6} {'batch':>5} {'heads':>5}  backend: ms (TFLOP/s)")
    for head_dim in args.head_dims:
        for causal in causals:
            for seqlen in args.seqlens:
                batch, heads = max(1, grid["tokens"] // seqlen), grid["hidden"] // head_dim
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=dtype).requires_grad_()
                           for _ in range(3))
                dout = torch.randn_like(q)
                calls = {"tvmflash": fwd_bwd(lambda q, k, v: tvmflash.attention(q, k, v, causal=causal, dropout_p=p), q,
                                             k, v, dout)}
                for name, backend in bench.sdpa_backends(device):
                    def sdpa(q, k, v, backend=backend):
                        with backend():
                            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                  v.transpose(1, 2), is_causal=causal,
                                                                  dropout_p=p).transpose(1, 2)
                    calls[name] = fwd_bwd(sdpa, q, k, v, dout)
                ms = bench.time_backends(calls, device, args.repeat)
                flops = 3.5 * bench.attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
                row = "  ".join(f"{name} {t:.3f} ({flops / t / 1e9:.3g})" for name, t in ms.items())
                print(f"{head_dim:>4} {str(causal):>6} {seqlen:>6} {batch:>5} {heads:>5}  {row}", flush=True)


if __name__ == "__main__":
    main()
