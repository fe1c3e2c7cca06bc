"""Forward + backward through autograd on the CPU, tvmflash against torch SDPA in the same run.

    python benchmarks/cpu_train_step.py [--seqlen 1024] [--batch 2] [--hidden 512] [--calls 10]

bf16, flash-attn's layout (batch, seqlen, heads, head_dim), heads = hidden / head_dim, d64 and d128,
full and causal; prints each backend's median time a step (``tvmflash.bench.time_ms``) and SDPA's
time over tvmflash's (above 1.00x, tvmflash is faster). The gradients are checked by the test suite
(``tests/test_backward.py``)."""

import argparse

import torch
import torch.nn.functional as F

import tvmflash
from tvmflash.bench import time_ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512, help="heads * head_dim")
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    for head_dim in (64, 128):
        heads = args.hidden // head_dim
        shape = (args.batch, args.seqlen, heads, head_dim)
        q, k, v = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        dout = torch.randn(shape, dtype=torch.bfloat16)
        for causal in (False, True):
            def ours():
                tvmflash.flash_attn_func(q, k, v, causal=causal).backward(dout)

            def sdpa():
                out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal)
                out.backward(dout.transpose(1, 2))

            mine, theirs = (time_ms(step, torch.device("cpu"), repeat=args.calls) for step in (ours, sdpa))
            print(f"d{head_dim} {'causal' if causal else 'full':6} b{args.batch} s{args.seqlen} h{heads}: "
                  f"tvmflash {mine:7.1f} ms  sdpa {theirs:7.1f} ms  {theirs / mine:.2f}x", flush=True)


if __name__ == "__main__":
    main()
