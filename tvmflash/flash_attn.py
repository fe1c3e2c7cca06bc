"""flash-attn 2's functions (``flash_attn.flash_attn_func`` and the packed forms) on tvmflash.

Same signatures, layout and returns, so code written for flash-attn runs on tvmflash, forward
and backward, under torch.compile too (they call the ``tvmflash::forward`` custom op, the varlen
ones ``tvmflash::varlen_forward``)::

    from tvmflash import flash_attn_func        # instead of: from flash_attn import flash_attn_func

The variants are flash-attn's: a sliding ``window_size``, ``softcap`` and ``alibi_slopes`` (see
``tvmflash.attention``). An option tvmflash does not support yet raises ``NotImplementedError``
naming it, never silently changes the result: dropout_p > 0.
``deterministic`` is flash-attn's: where the backward sums dq by fp32 atomics (sm90's default, the
backward knob ``dq_atomic``) the gradients' rounding changes from run to run, and
``deterministic=True`` makes them bitwise the same (dq by a pass of its own). With ``return_attn_probs`` the return is
``(out, softmax_lse, None)``: flash-attn returns the attention probabilities (S_dmask) only with
dropout and None without, and tvmflash has no dropout. Unlike flash-attn's, softmax_lse carries a
gradient.
"""

from __future__ import annotations

from tvmflash.ops import attention, varlen_attention


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Attention of q over k, v in flash-attn's layout.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim) with nheads
    a multiple of nheads_k (GQA/MQA). softmax_scale defaults to 1/sqrt(headdim); causal masks are
    aligned bottom-right. window_size=(left, right): query i sees keys i + seqlen_k - seqlen_q - left
    ... i + seqlen_k - seqlen_q + right (-1: unbounded). softcap > 0: scores become
    softcap · tanh(score / softcap). alibi_slopes, float32 (nheads,) or (batch, nheads): a bias of
    -slope · |i + seqlen_k - seqlen_q - j| is added to the score. Returns out (batch, seqlen_q,
    nheads, headdim), or with return_attn_probs (out, softmax_lse, None), softmax_lse float32
    (batch, nheads, seqlen_q).
    """
    _check_options(dropout_p, causal=causal, deterministic=deterministic, return_attn_probs=return_attn_probs)
    out, lse = attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         deterministic=deterministic)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` of qkv: (batch, seqlen, 3, nheads, headdim), q, k and v stacked
    (the gradient flows back into qkv)."""
    _check_packed("qkv", qkv, 3)
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` of q and kv: (batch, seqlen_k, 2, nheads_k, headdim), k and v
    stacked."""
    _check_packed("kv", kv, 2)
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """:func:`flash_attn_func` of sequences packed without padding (flash-attn 2's varlen).

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_q, cu_seqlens_k:
    int32 (batch + 1,) on q's device, each sequence's first row (0 first, total last);
    max_seqlen_q, max_seqlen_k: ints, at least every sequence's length. Each sequence attends to
    its own keys, with masks, windows and ALiBi distances (slopes (nheads,) or (batch, nheads)) of
    its own lengths. Returns out (total_q, nheads, headdim), or with return_attn_probs (out,
    softmax_lse, None), softmax_lse float32 (nheads, total_q). block_table (a paged KV cache)
    raises NotImplementedError: use :func:`tvmflash.flash_attn_with_kvcache` for decoding.
    """
    _check_options(dropout_p, causal=causal, deterministic=deterministic, return_attn_probs=return_attn_probs)
    if block_table is not None:
        raise NotImplementedError("block_table: tvmflash's varlen takes no paged KV cache; "
                                  "flash_attn_with_kvcache does")
    out, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                softmax_scale=softmax_scale, return_lse=True, window_size=window_size,
                                softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """:func:`flash_attn_varlen_func` of qkv: (total, 3, nheads, headdim), q, k and v stacked, one
    cu_seqlens and max_seqlen for all three (the gradient flows back into qkv)."""
    _check_packed("qkv", qkv, 3, varlen=True)
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_varlen_func` of q and kv: (total_k, 2, nheads_k, headdim), k and v stacked."""
    _check_packed("kv", kv, 2, varlen=True)
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def _check_packed(name, t, count, varlen=False):
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if varlen:
        if t.dim() != 4 or t.shape[1] != count:
            raise ValueError(f"{name}: expected shape (total, {count}, nheads, headdim), got {tuple(t.shape)}")
    elif t.dim() != 5 or t.shape[2] != count:
        raise ValueError(f"{name}: expected shape (batch, seqlen, {count}, nheads, headdim), got {tuple(t.shape)}")


def _check_options(dropout_p, **flags):
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {value!r}")
    if dropout_p != 0:
        raise NotImplementedError(f"dropout_p: tvmflash has no dropout yet (got {dropout_p!r}); pass 0.0")
