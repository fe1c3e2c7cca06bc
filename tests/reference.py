"""Reference attention and flash-attn's error rule, shared by the tests and the benchmark's check."""

from __future__ import annotations

import math

import torch


def reference(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              dropout_p=0.0, dropout_mask=None, dtype=torch.float64):
    """Plain attention in ``dtype`` (default float64), flash-attn layout in and out, with flash-attn's
    documented variants: query i sees key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k -
    seqlen_q + right (``window_size=(left, right)``, -1: unbounded; causal: right 0); the scaled
    score s becomes softcap · tanh(s / softcap) (softcap > 0), then gets -slope · |i + seqlen_k -
    seqlen_q - j| (``alibi_slopes``, (heads_q,) or (batch, heads_q)). With ``dropout_mask`` (bool
    (batch, heads_q, seqlen_q, seqlen_k), the entries kept) the softmax's other entries are dropped and
    the kept ones scaled by 1 / (1 - dropout_p), after its sum (lse is the whole softmax's).

    Returns (out, lse): out (batch, seqlen_q, heads_q, head_dim), lse (batch, heads_q, seqlen_q).
    A query that sees no key gets out 0 and lse -inf.
    """
    s, hidden, vh = scores(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                           softcap=softcap, alibi_slopes=alibi_slopes, dtype=dtype)
    seen = ~hidden.all(-1, keepdim=True)  # rows that see a key
    # Rows that see no key: finite scores (so that autograd gets no NaN), p 0 and lse -inf.
    s = s.masked_fill(hidden & seen, -math.inf).masked_fill(~seen, 0.0)
    lse = torch.logsumexp(s, dim=-1).masked_fill(~seen[..., 0], -math.inf)
    p = (torch.softmax(s, dim=-1) * seen).nan_to_num(0.0)  # (NaN only where fp16 scores overflowed)
    if dropout_mask is not None:
        p = p * dropout_mask.to(p.device) / (1 - dropout_p)
    return (p @ vh).transpose(1, 2), lse


def scores(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
           score_mod=None, mask_mod=None, dtype=torch.float64):
    """What every reference starts from, in ``dtype``: (s, hidden, vh). s: the scaled scores (batch, heads_q,
    seqlen_q, seqlen_k), softcapped, then with ALiBi's -slope · |i + seqlen_k - seqlen_q - j| (``alibi_slopes``
    (heads_q,) or (batch, heads_q)) or ``score_mod(s, b, h, i, j)``; hidden: bool, broadcastable to s, the
    keys that causal, the window or ``mask_mod(b, h, i, j)`` hide; vh: v as (batch, heads_q, seqlen_k,
    head_dim), a GQA group's heads repeated."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    batch, heads, seqlen_q, seqlen_k = s.shape
    b = torch.arange(batch, device=q.device)[:, None, None, None]
    h = torch.arange(heads, device=q.device)[None, :, None, None]
    i = torch.arange(seqlen_q, device=q.device)[:, None]
    j = torch.arange(seqlen_k, device=q.device)[None, :]
    diagonal = i + seqlen_k - seqlen_q  # the key in query i's column
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=dtype).reshape(-1, heads, 1, 1)  # (batch or 1, heads)
        s = s - slopes * (diagonal - j).abs().to(dtype)
    if score_mod is not None:
        s = score_mod(s, b, h, i, j).to(dtype)
    left, right = window_size
    hidden = torch.zeros_like(j > i)
    if causal:
        hidden = hidden | (j > diagonal)
    if right >= 0:
        hidden = hidden | (j > diagonal + right)
    if left >= 0:
        hidden = hidden | (j < diagonal - left)
    if mask_mod is not None:
        hidden = hidden | ~mask_mod(b, h, i, j)
    return s, hidden, vh


def torch_same_dtype(q, k, v, *, causal=False, softmax_scale=None, **variant):
    """PyTorch's own attention in the inputs' dtype: the yardstick for our rounding error. ``variant``:
    ``reference``'s window_size, softcap and alibi_slopes."""
    return reference(q, k, v, causal=causal, softmax_scale=softmax_scale, dtype=q.dtype, **variant)[0].to(q.dtype)


def max_error(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def check_attention(out, lse, q, k, v, *, causal=False, softmax_scale=None, eps=1e-5, **variant):
    """flash-attn's rule: our error against float64 is at most 2x torch's same-dtype error + eps.
    ``variant``: ``reference``'s window_size, softcap, alibi_slopes and dropout."""
    ref_out, ref_lse = reference(q, k, v, causal=causal, softmax_scale=softmax_scale, **variant)
    ours = max_error(out, ref_out)
    theirs = max_error(torch_same_dtype(q, k, v, causal=causal, softmax_scale=softmax_scale, **variant), ref_out)
    assert torch.isfinite(out).all(), "out has NaN/inf"
    assert ours <= 2 * theirs + eps, f"out error {ours:.3e} > 2 x torch's {theirs:.3e} + {eps}"
    # LSE is computed in float32 from the same inputs: only float32 rounding separates it from float64.
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "lse is -inf exactly where a query sees no key"
    assert (lse[~seen] == -math.inf).all()
    lse_err = max_error(lse[seen], ref_lse[seen])
    assert lse_err <= 1e-4 * (1 + ref_lse[seen].abs().max().item() if seen.any() else 1), f"lse error {lse_err:.3e}"
    return ours, theirs


def reference_gradients(q, k, v, dout, dlse=None, *, causal=False, softmax_scale=None, dtype=torch.float64,
                        **variant):
    """(dq, dk, dv) of ``reference`` (with ``variant``) in ``dtype`` for the loss sum(out·dout) +
    sum(lse·dlse)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = reference(*leaves, causal=causal, softmax_scale=softmax_scale, dtype=dtype, **variant)
    loss = (out * dout.to(dtype)).sum()
    if dlse is not None:
        loss = loss + (lse.masked_fill(lse == -math.inf, 0) * dlse.to(dtype)).sum()
    return torch.autograd.grad(loss, leaves)


def gradient_references(q, k, v, dout, dlse=None, *, causal=False, softmax_scale=None, **variant):
    """(float64 gradients, torch's gradients in the inputs' dtype), each (dq, dk, dv): what
    ``check_gradient_errors`` compares ours with."""
    ref = reference_gradients(q, k, v, dout, dlse, causal=causal, softmax_scale=softmax_scale, **variant)
    same = reference_gradients(q, k, v, dout, dlse, causal=causal, softmax_scale=softmax_scale, dtype=q.dtype,
                               **variant)
    return ref, same


def check_gradient_errors(grads, ref, same, dtype, eps=1e-5) -> dict:
    """flash-attn's rule for each of dq, dk, dv: our error against float64 (``ref``) is at most 2x
    the error of PyTorch's own attention in ``dtype`` (``same``), plus eps times (1 + the gradient's
    largest element): with one key, say, dq is exactly 0 in any dtype, and ours is off by float32
    rounding. Returns name -> (our error, torch's)."""
    errors = {}
    for name, ours, r, theirs in zip(("dq", "dk", "dv"), grads, ref, same):
        assert ours.shape == r.shape and ours.dtype == dtype, f"{name}: {ours.shape} {ours.dtype}"
        assert torch.isfinite(ours).all(), f"{name} has NaN/inf"
        err, their_err = max_error(ours, r), max_error(theirs, r)
        floor = eps * (1 + (r.abs().max().item() if r.numel() else 0.0))
        assert err <= 2 * their_err + floor, f"{name} error {err:.3e} > 2 x torch's {their_err:.3e} + {floor:.1e}"
        errors[name] = (err, their_err)
    return errors


def check_gradients(grads, q, k, v, dout, dlse=None, *, causal=False, softmax_scale=None, eps=1e-5, **variant):
    """``check_gradient_errors`` of ``grads`` against the references of this attention (``variant``:
    ``reference``'s window_size, softcap and alibi_slopes)."""
    ref, same = gradient_references(q, k, v, dout, dlse, causal=causal, softmax_scale=softmax_scale, **variant)
    return check_gradient_errors(grads, ref, same, q.dtype, eps)
