"""The backward's gradient errors beside those of SDPA's backends, on the same inputs.

    python benchmarks/gradient_errors.py                          # the shapes whose check failed on the H200
    python benchmarks/gradient_errors.py --shapes 64,1,4,4096,2   # head_dim,causal,batch,seqlen,heads

For each shape: the largest error of dq, dk and dv against float32 attention (``bench.attention_in``) for
tvmflash (its forward's out and lse, then its backward), SDPA's flash backend (FA2), its cuDNN backend, SDPA's
math backend (which computes bf16 in float32) and the same attention in bf16, and flash-attn's rule (2x the
bf16 attention's error + 1e-5), which ``tvmflash.bench`` and the tuner apply. bf16; a backend this device
lacks is left out.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tvmflash
from tvmflash import bench

# (head_dim, causal, batch, seqlen, heads): the shapes of the H200 runs whose rule check failed
# (BENCHMARKS.md, "Numerics"), on two heads as the check compares
SHAPES = ((64, True, 4, 4096, 2), (128, False, 8, 2048, 2), (128, True, 8, 2048, 2))


def sdpa_gradients(q, k, v, dout, causal, dtype, backend):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=causal).transpose(1, 2)
    return torch.autograd.grad(out, leaves, dout.to(dtype))


def attention_gradients(q, k, v, dout, causal, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(bench.attention_in(dtype, *leaves, causal), leaves, dout.to(dtype))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=None, help="head_dim,causal,batch,seqlen,heads (causal 0 or 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    torch.manual_seed(args.seed)
    for head_dim, causal, batch, seqlen, heads in shapes:
        causal = bool(causal)
        target = None if device == "cuda" else "cpu"
        forward = tvmflash.compile(head_dim=head_dim, dtype="bfloat16", causal=causal, target=target)
        backward = tvmflash.compile_backward(head_dim=head_dim, dtype="bfloat16", causal=causal, target=target)
        q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=torch.bfloat16)
                         for _ in range(4))
        out, lse = forward(q, k, v, return_lse=True)
        ref = attention_gradients(q, k, v, dout, causal, torch.float32)
        rows = {"tvmflash": backward(q, k, v, out, dout, lse), "bf16 torch": attention_gradients(q, k, v, dout, causal,
                                                                                                  torch.bfloat16)}
        backends = {"SDPA math": SDPBackend.MATH, "SDPA flash": SDPBackend.FLASH_ATTENTION,
                    "cuDNN": SDPBackend.CUDNN_ATTENTION}
        for name, backend in backends.items():
            try:
                rows[name] = sdpa_gradients(q, k, v, dout, causal, torch.bfloat16, backend)
            except RuntimeError:  # no such kernel on this device or for this shape
                pass
        errors = {name: [(g.float() - r).abs().max().item() for g, r in zip(grads, ref)] for name, grads in rows.items()}
        allowed = [2 * e + 1e-5 for e in errors["bf16 torch"]]
        print(f"d{head_dim} {'causal' if causal else 'full'} b{batch} s{seqlen} h{heads}: error (x the rule's allowance)")
        for name, errs in errors.items():
            print(f"  {name:10s} " + "  ".join(f"{g} {e:.2e} ({e / a:.2f}x)" for g, e, a in zip(("dq", "dk", "dv"), errs, allowed)))


if __name__ == "__main__":
    main()
