"""Exact attention on your own torch tensors, checked against PyTorch's SDPA.

    python examples/quickstart.py            # on the GPU if there is one, else the CPU
"""

import torch

import tvmflash

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16

# flash-attn's layout: (batch, seqlen, heads, head_dim); 8 query heads share 2 K/V heads (GQA).
q = torch.randn(2, 1000, 8, 128, device=device, dtype=dtype)
k = torch.randn(2, 1000, 2, 128, device=device, dtype=dtype)
v = torch.randn(2, 1000, 2, 128, device=device, dtype=dtype)

out, lse = tvmflash.attention(q, k, v, causal=True, return_lse=True)  # builds once, then cached

# The same with a kernel object you keep: no lookup per call, and info() about where it came from.
kernel = tvmflash.compile(head_dim=128, dtype=dtype, causal=True)
out2 = kernel(q, k, v)
print(kernel.info())

expected = torch.nn.functional.scaled_dot_product_attention(
    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
).transpose(1, 2)
print(f"out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)} {lse.dtype}")
print(f"max |tvmflash - torch SDPA| = {(out.float() - expected.float()).abs().max().item():.2e}")
assert torch.equal(out, out2)
