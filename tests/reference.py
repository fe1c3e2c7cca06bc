"""Reference attention and flash-attn's error rule, shared by the tests and the benchmark's check."""

from __future__ import annotations

import math

import torch


def reference(q, k, v, *, causal=False, softmax_scale=None, dtype=torch.float64):
    """Plain attention in ``dtype`` (default float64), flash-attn layout in and out.

    Returns (out, lse): out (batch, seqlen_q, heads_q, head_dim), lse (batch, heads_q, seqlen_q).
    A query that sees no key gets out 0 and lse -inf.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if causal:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        s = s.masked_fill(j > i + seqlen_k - seqlen_q, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see no key: 0, not NaN
    return (p @ vh).transpose(1, 2), lse


def torch_same_dtype(q, k, v, *, causal=False, softmax_scale=None):
    """PyTorch's own attention in the inputs' dtype: the yardstick for our rounding error."""
    return reference(q, k, v, causal=causal, softmax_scale=softmax_scale, dtype=q.dtype)[0].to(q.dtype)


def max_error(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check_attention(out, lse, q, k, v, *, causal=False, softmax_scale=None, eps=1e-5):
    """flash-attn's rule: our error against float64 is at most 2x torch's same-dtype error + eps."""
    ref_out, ref_lse = reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
    ours = max_error(out, ref_out)
    theirs = max_error(torch_same_dtype(q, k, v, causal=causal, softmax_scale=softmax_scale), ref_out)
    assert torch.isfinite(out).all(), "out has NaN/inf"
    assert ours <= 2 * theirs + eps, f"out error {ours:.3e} > 2 x torch's {theirs:.3e} + {eps}"
    # LSE is computed in float32 from the same inputs: only float32 rounding separates it from float64.
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "lse is -inf exactly where a query sees no key"
    assert (lse[~seen] == -math.inf).all()
    lse_err = max_error(lse[seen], ref_lse[seen])
    assert lse_err <= 1e-4 * (1 + ref_lse[seen].abs().max().item() if seen.any() else 1), f"lse error {lse_err:.3e}"
    return ours, theirs
