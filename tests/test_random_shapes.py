"""Property test: fresh random shapes and flags, always against float64."""

import torch
from conftest import poisoned_out, random_qkv
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import check_attention

import tvmflash


@settings(max_examples=15, deadline=None)  # each example is mostly a build (1-2 s): 15 keep the CPU suite in its 10 minutes
@given(
    batch=st.integers(1, 3),
    seqlen_q=st.integers(1, 300),
    seqlen_k=st.integers(1, 300),
    heads_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([32, 64, 128]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    causal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_problems_on_cpu(batch, seqlen_q, seqlen_k, heads_kv, group, head_dim, dtype, causal, seed):
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads_kv * group, heads_kv, head_dim, dtype, "cpu", seed=seed)
    kernel = tvmflash.compile(head_dim=head_dim, dtype=dtype, causal=causal, target="cpu")
    out, lse = kernel(q, k, v, out=poisoned_out(q), return_lse=True)
    check_attention(out, lse, q, k, v, causal=causal)
