"""One call each of tvmflash's default kernels and cuDNN's (SDPA), for Nsight Compute to profile side by side.
Only that region is profiled (``torch.cuda.profiler``): the inputs, the builds and a warm-up call run before
it. On an sm_90a GPU:

    ncu --profile-from-start off --clock-control none --section LaunchStats --section Occupancy \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python benchmarks/profile_vs_cudnn.py [--backward] [--head-dim 128] [--seqlen 4096] [--causal]

The forward by default: one forward each, non-causal (``--causal``: causal). With ``--backward``: one forward +
backward each (autograd, as training runs it), so that the backward's kernels (tvmflash's delta, dkdv and
convert_dq; cuDNN's backward) appear beside the forward's. Shapes: bf16, batch 16384 / seqlen, heads
2048 / head_dim, (batch, seqlen, heads, head_dim) as flash-attn's layout."""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tvmflash


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true", help="forward + backward, each through autograd")
    args = parser.parse_args(argv)
    d, s = args.head_dim, args.seqlen
    batch, heads = max(1, 16384 // s), 2048 // d
    q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
               for _ in range(3))
    dout = torch.randn_like(q)

    def ours():
        out = tvmflash.flash_attn_func(q, k, v, causal=args.causal)
        if args.backward:
            out.backward(dout)

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=args.causal)
        if args.backward:
            out.backward(dout.transpose(1, 2))

    for call in (ours, cudnn):  # builds, cuDNN's plan, the allocator's blocks
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in (ours, cudnn):
        call()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled: bf16 d{d} seqlen {s} batch {batch} heads {heads} causal {args.causal} "
          f"{'forward + backward' if args.backward else 'forward'}, tvmflash then cuDNN")


if __name__ == "__main__":
    main()
