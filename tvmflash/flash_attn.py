"""flash-attn 2's functions (``flash_attn.flash_attn_func``, the packed forms and
``flash_attn_with_kvcache``) on tvmflash.

Same signatures, layout and returns, so code written for flash-attn runs on tvmflash, forward
and backward, under torch.compile too (they call the ``tvmflash::forward`` custom op, the varlen
ones ``tvmflash::varlen_forward``)::

    from tvmflash import flash_attn_func        # instead of: from flash_attn import flash_attn_func

The variants are flash-attn's: a sliding ``window_size``, ``softcap``, ``alibi_slopes`` and
``dropout_p`` (see ``tvmflash.attention``). An option tvmflash does not support raises
``NotImplementedError`` naming it, never silently changes the result.
``deterministic`` is flash-attn's: where the backward sums dq by fp32 atomics (sm90's default, the
backward knob ``dq_atomic``) the gradients' rounding changes from run to run, and
``deterministic=True`` makes them bitwise the same (dq by a pass of its own). With ``return_attn_probs`` the return is
``(out, softmax_lse, S_dmask)``, S_dmask as flash-attn's (for tests: None at dropout_p 0, else the
softmax with the dropped entries negated, ``attention_probabilities``). Unlike flash-attn's, softmax_lse
carries a gradient. ``flash_attn_with_kvcache`` (decode over a KV cache) calls a ``kernels.DecodeKernel``: it
appends new keys and values to the cache in place, rotates them, picks the split count, and returns
the output (and the LSE).
"""

from __future__ import annotations

import torch

from tvmflash.flash_attn_checks import (
    check_cache_values,
    check_flash_attn_options,
    check_kvcache_layout,
    check_new_keys,
    check_packed,
    check_rotary,
)
from tvmflash.kernels.checks import (
    check_cu_seqlens,
    check_flag,
    check_max_seqlen,
    check_num_splits,
    resolve_softmax_scale,
    resolve_variant,
)
from tvmflash.dropout import dropout_kept, resolve_dropout
from tvmflash.ops import attention, decode_kernel_for, varlen_attention


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None, q_descale=None,
                    k_descale=None, v_descale=None):
    """Attention of q over k, v in flash-attn's layout.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim) with nheads
    a multiple of nheads_k (GQA/MQA), headdim any from 1 to 256 (one the kernels do not serve is
    zero-padded, as :func:`tvmflash.attention` says). softmax_scale defaults to 1/sqrt(headdim); causal masks are
    aligned bottom-right. window_size=(left, right): query i sees keys i + seqlen_k - seqlen_q - left
    ... i + seqlen_k - seqlen_q + right (-1: unbounded). softcap > 0: scores become
    softcap · tanh(score / softcap). alibi_slopes, float32 (nheads,) or (batch, nheads): a bias of
    -slope · |i + seqlen_k - seqlen_q - j| is added to the score. dropout_p: the probability of
    dropping each entry of the softmax (the kept ones scaled by 1 / (1 - p)), drawn from torch's
    generator for q's device. Returns out (batch, seqlen_q, nheads, headdim), or with return_attn_probs
    (out, softmax_lse, S_dmask), softmax_lse float32 (batch, nheads, seqlen_q), S_dmask None at
    dropout_p 0, else float32 (batch, nheads, seqlen_q, seqlen_k) (``attention_probabilities``).
    sinks (gpt-oss's learnable attention sinks), float32 (nheads,): a logit per query head in each row's
    softmax denominator, unscaled, with no value (:func:`tvmflash.attention`); softmax_lse includes it;
    sinks.grad where it requires grad.

    FP8 (FlashAttention-3's e4m3 forward, on sm90 alone): q, k, v torch.float8_e4m3fn and q_descale,
    k_descale, v_descale float32 (batch, nheads_k) (None: ones). The scores are q·k · q_descale ·
    k_descale · softmax_scale, P is quantised to e4m3 for P V, and the output, bf16, is multiplied by
    v_descale; softmax_lse is that of the descaled scores. headdim 64, 128 or 256; causal or not, GQA.
    Forward only: tensors that require grad, dropout, a window, softcap, ALiBi, sinks, another GPU or the
    CPU raise NotImplementedError (``_fp8_forward``).
    """
    if _is_fp8(q, k, v, q_descale, k_descale, v_descale):
        return _fp8_forward(q, k, v, q_descale, k_descale, v_descale, dropout_p=dropout_p, softmax_scale=softmax_scale,
                            causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                            return_attn_probs=return_attn_probs, sinks=sinks)
    dropout_p, return_attn_probs = check_flash_attn_options(dropout_p, causal=causal, deterministic=deterministic,
                                                            return_attn_probs=return_attn_probs)[::3]
    dropout_p, seed = resolve_dropout(dropout_p, None, *_draw_for(q, q.shape[0] if _dims(q, 4) else 0))
    out, lse = attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True,
                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         deterministic=deterministic, dropout_p=dropout_p, dropout_seed=seed, sinks=sinks)
    if not return_attn_probs:
        return out
    probabilities = None if not dropout_p else attention_probabilities(
        q, k, lse, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, seed)
    return out, lse, probabilities


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              sinks=None):
    """:func:`flash_attn_func` of qkv: (batch, seqlen, 3, nheads, headdim), q, k and v stacked
    (the gradient flows back into qkv)."""
    check_packed("qkv", qkv, 3)
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                             sinks=None):
    """:func:`flash_attn_func` of q and kv: (batch, seqlen_k, 2, nheads_k, headdim), k and v
    stacked."""
    check_packed("kv", kv, 2)
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks)


def _is_fp8(*tensors) -> bool:
    """Does a call ask for the FP8 forward (an e4m3 tensor or a descale among its arguments)?"""
    return any(t is not None for t in tensors[3:]) or any(
        isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn for t in tensors[:3])


def _fp8_forward(q, k, v, q_descale, k_descale, v_descale, *, dropout_p, softmax_scale, causal, window_size, softcap,
                 alibi_slopes, return_attn_probs, sinks, packed=None):
    """flash_attn_func in FP8 (``kernels.fp8.Fp8Kernel``; packed: varlen's (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q), ``Fp8VarlenKernel``): what it does not cover raises NotImplementedError."""
    from tvmflash import target as targets
    from tvmflash.kernels.fp8 import fp8_kernel

    causal, return_attn_probs = check_flag("causal", causal), check_flag("return_attn_probs", return_attn_probs)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name}: FP8 (descales given, or an e4m3 tensor) needs q, k and v all "
                            f"torch.float8_e4m3fn, got {getattr(t, 'dtype', type(t).__name__)}")
    others = [name for name, on in (("dropout_p", dropout_p not in (0, 0.0, None)),
                                    ("window_size", tuple(window_size) != (-1, -1)),
                                    ("softcap", softcap not in (0, 0.0, None)), ("alibi_slopes", alibi_slopes is not None),
                                    ("sinks", sinks is not None)) if on]
    if others:
        raise NotImplementedError(f"the FP8 forward takes causal and GQA only, not {', '.join(others)}")
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        raise NotImplementedError(f"the FP8 forward runs on sm90 (H100, H200) alone, not on {q.device}"
                                  + (f" (sm{''.join(map(str, torch.cuda.get_device_capability(q.device)))})"
                                     if q.device.type == "cuda" else ""))
    kernel = fp8_kernel(q.shape[-1], causal, targets.cuda_device_target(q.device.index), varlen=packed is not None)
    with torch.cuda.device(q.device):
        out, lse = kernel(q, k, v, *(packed or ()), q_descale, k_descale, v_descale, softmax_scale=softmax_scale,
                          return_lse=True)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, sinks=None,
                           q_descale=None, k_descale=None, v_descale=None):
    """:func:`flash_attn_func` of sequences packed without padding (flash-attn 2's varlen).

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_q, cu_seqlens_k:
    int32 (batch + 1,) on q's device, each sequence's first row (0 first, total last);
    max_seqlen_q, max_seqlen_k: ints, at least every sequence's length. Each sequence attends to
    its own keys, with masks, windows and ALiBi distances (slopes (nheads,) or (batch, nheads)) of
    its own lengths. Returns out (total_q, nheads, headdim), or with return_attn_probs (out,
    softmax_lse, None), softmax_lse float32 (nheads, total_q).

    With ``block_table`` (int32 (batch, pages_per_seq), a paged KV cache as flash-attn's) k and v are
    the cache's pages, (num_pages, page_size, nheads_k, headdim), page_size a power of two >= 16, and
    sequence b's keys are the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its pages: see
    :func:`varlen_over_paged_cache`. Forward only, as flash-attn's, and without dropout.

    dropout_p as :func:`flash_attn_func`'s (each sequence's entries by its own positions); with it and
    return_attn_probs, S_dmask is float32 (batch, nheads, max_seqlen_q, max_seqlen_k), sequence b's
    entries first in its rows and columns, the rest 0. sinks: float32 (nheads,), as :func:`flash_attn_func`'s.

    FP8 as :func:`flash_attn_func`'s, the descales (batch, nheads_k) with batch the number of sequences
    (``kernels.fp8.Fp8VarlenKernel``); without ``block_table``.
    """
    if _is_fp8(q, k, v, q_descale, k_descale, v_descale):
        if block_table is not None:
            raise NotImplementedError("flash_attn_varlen_func in FP8 with block_table (a paged FP8 cache): not yet")
        return _fp8_forward(q, k, v, q_descale, k_descale, v_descale, dropout_p=dropout_p, softmax_scale=softmax_scale,
                            causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                            return_attn_probs=return_attn_probs, sinks=sinks,
                            packed=(cu_seqlens_q, cu_seqlens_k, check_max_seqlen("max_seqlen_q", max_seqlen_q)))
    dropout_p, return_attn_probs = check_flash_attn_options(dropout_p, causal=causal, deterministic=deterministic,
                                                            return_attn_probs=return_attn_probs)[::3]
    if block_table is not None:
        if dropout_p:
            raise NotImplementedError("dropout_p: the paged varlen forward (block_table) has no dropout; it serves "
                                      "inference")
        out, lse = varlen_over_paged_cache(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                                           softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                           softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
        return (out, lse, None) if return_attn_probs else out
    sequences = cu_seqlens_q.shape[0] - 1 if _dims(cu_seqlens_q, 1) else 0
    dropout_p, seed = resolve_dropout(dropout_p, None, *_draw_for(q, sequences if _dims(q, 3) else 0))
    out, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                softmax_scale=softmax_scale, return_lse=True, window_size=window_size,
                                softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                                dropout_p=dropout_p, dropout_seed=seed, sinks=sinks)
    if not return_attn_probs:
        return out
    if not dropout_p:
        return out, lse, None
    probabilities = q.new_zeros((cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q, max_seqlen_k),
                                dtype=torch.float32)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # one device sync each
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(zip(starts_q, starts_q[1:]), zip(starts_k, starts_k[1:]))):
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]
        probabilities[b, :, :q1 - q0, :k1 - k0] = attention_probabilities(
            q[None, q0:q1], k[None, k0:k1], lse[None, :, q0:q1], softmax_scale, causal, window_size, softcap, slopes,
            dropout_p, seed, sequence=b)[0]
    return out, lse, probabilities


def _dims(t, dims: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == dims


def _draw_for(q, batch: int) -> tuple:
    """(device, streams) of ``dropout.resolve_dropout`` for q of ``batch`` sequences: q's device and
    batch · heads (0 where q is no tensor, which the call refuses after)."""
    if not isinstance(q, torch.Tensor):
        return None, 0
    return q.device, batch * q.shape[-2]


def attention_probabilities(q, k, lse, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p: float,
                            dropout_seed, sequence: int | None = None):
    """flash-attn's S_dmask, for tests: the softmax exp(score - lse) of q (batch, seqlen_q, nheads,
    headdim) over k (batch, seqlen_k, nheads_k, headdim), float32 (batch, nheads, seqlen_q, seqlen_k),
    0 where masked and negated where dropout dropped the entry (``dropout.dropout_kept``; ``sequence``: the
    varlen sequence that batch 0 is). Computed here from the kernel's lse, O(seqlen_q · seqlen_k)."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    variant = resolve_variant(causal, window_size, softcap, alibi_slopes is not None)
    scale = resolve_softmax_scale(softmax_scale, head_dim)
    k = k.float().repeat_interleave(heads // k.shape[2], dim=2)
    score = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * scale
    if variant.get("softcap"):
        score = variant["softcap"] * torch.tanh(score / variant["softcap"])
    rows = torch.arange(seqlen_q, device=q.device)[:, None] + seqlen_k - seqlen_q  # a query's diagonal key
    cols = torch.arange(seqlen_k, device=q.device)
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().reshape(-1, heads)[:, :, None, None]
        score = score - slopes * (rows - cols).abs()
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    left, right = variant.get("window_left", -1), 0 if variant["causal"] else variant.get("window_right", -1)
    if right >= 0:
        visible &= cols <= rows + right
    if left >= 0:
        visible &= cols >= rows - left
    probabilities = torch.where(visible, torch.exp(score - lse[..., None]), 0.0)
    b = torch.arange(batch, device=q.device)[:, None, None, None] if sequence is None else sequence
    kept = dropout_kept(dropout_seed, dropout_p, heads, b, torch.arange(heads, device=q.device)[:, None, None],
                        torch.arange(seqlen_q, device=q.device)[:, None], cols)
    return torch.where(kept, probabilities, -probabilities)


def varlen_over_paged_cache(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, block_table, *,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                            sinks=None):
    """(out (total_q, nheads, headdim), softmax_lse float32 (nheads, total_q)) of packed queries over a
    paged KV cache: :func:`flash_attn_varlen_func` with ``block_table`` (a prefill chunk over the pages
    a serving engine keeps).

    Each sequence's queries are placed at the end of a row of a (batch, max_seqlen_q) tile, so that
    flash-attn's bottom-right alignment (causal, the window, ALiBi's distances) holds for each sequence,
    and the tile attends over the pages in place through :func:`flash_attn_with_kvcache`'s decode
    kernel (the split-KV kernel, which reads the block table; nothing is gathered), whose output and
    LSE are gathered back to the packed rows. The tile's rows before a sequence's are computed and
    dropped. No backward (flash-attn's has none): under autograd a NotImplementedError. A sequence
    longer than max_seqlen_q is a ValueError on the CPU and a failed device-side assertion on a GPU
    (checking it on the host would wait for the device)."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q, k_cache, v_cache, sinks)):
        raise NotImplementedError("block_table: the paged varlen forward has no backward (nor has flash-attn's); "
                                  "call it under torch.no_grad() or without requires_grad")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q: expected (total_q, heads, head_dim), got shape {tuple(getattr(q, 'shape', ()))}")
    max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, None, max_seqlen_q)  # the keys: in the cache's pages
    batch, (total_q, heads_q, head_dim) = cu_seqlens_q.shape[0] - 1, q.shape
    lengths_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    lengths_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    rows = torch.arange(total_q, device=q.device)
    seq = torch.bucketize(rows, cu_seqlens_q[1:], right=True)  # each packed row's sequence
    position = rows - cu_seqlens_q[seq] + max_seqlen_q - lengths_q[seq]  # its row in the tile: the last ones
    if q.device.type == "cuda" and total_q:
        torch._assert_async(position.min() >= 0, "max_seqlen_q: expected at least the longest sequence's length")
    tile = q.new_zeros(batch, max_seqlen_q, heads_q, head_dim)
    tile[seq, position] = q
    out, lse = flash_attn_with_kvcache(tile, k_cache, v_cache, cache_seqlens=lengths_k,  # int32, as cu_seqlens
                                       block_table=block_table, softmax_scale=softmax_scale, causal=causal,
                                       window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                       return_softmax_lse=True, sinks=sinks)
    return out[seq, position], lse.transpose(1, 2)[seq, position].t().contiguous()


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, sinks=None):
    """:func:`flash_attn_varlen_func` of qkv: (total, 3, nheads, headdim), q, k and v stacked, one
    cu_seqlens and max_seqlen for all three (the gradient flows back into qkv)."""
    check_packed("qkv", qkv, 3, varlen=True)
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  sinks=sinks)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None):
    """:func:`flash_attn_varlen_func` of q and kv: (total_k, 2, nheads_k, headdim), k and v stacked."""
    check_packed("kv", kv, 2, varlen=True)
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, sinks=sinks)


# ----------------------------------------------------------------------------- decode over a KV cache
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            sinks=None, q_descale=None, k_descale=None, v_descale=None):
    """Attention of q over a KV cache, with flash-attn 2's arguments and semantics.

    q: (batch, seqlen_q, heads_q, head_dim): one token a sequence for decode, a few for chunked
    prefill or speculative decoding (causal within the chunk with ``causal=True``: query token t of
    seqlen_q sees the keys up to cache length - seqlen_q + t, bottom-right).
    k_cache, v_cache: (cache_batch, cache_len, heads_kv, head_dim), or with ``block_table``
    (num_pages, page_size, heads_kv, head_dim), page_size a power of two >= 16; heads_q a multiple
    of heads_kv (GQA/MQA). Contiguous, q's dtype (fp16, bf16 or fp32) and device. head_dim: one that the
    decode kernels for the device and dtype serve as it is (the CPU every multiple of 8; a GPU 32, 64,
    96, 128 and 256), as the caches are written in place: no padding, and
    a ValueError naming them otherwise.
    k, v (optional, both or neither): (batch, seqlen_new, heads_kv, head_dim), written into the cache
    in place at positions cache_seqlens[b] ... cache_seqlens[b] + seqlen_new - 1 before attending;
    the attention then sees cache_seqlens + seqlen_new keys. ``cache_seqlens`` itself is not
    updated (as in flash-attn).
    cache_seqlens: int, or int32 (batch,): the keys each sequence has in the cache; None: the whole
    cache (cache_len, or pages_per_seq * page_size). Read on the device: a new length never
    recompiles, and a CUDA graph replays with the values the tensor holds at replay.
    cache_batch_idx: int32 (batch,): the cache row of each sequence (contiguous cache only); None
    means row b for sequence b.
    cache_leftpad: int32 (batch,), contiguous, on q's device: the position in the cache where each
    sequence's keys start (flash-attn's; None: 0). Sequence b's keys are then positions
    cache_leftpad[b] ... cache_seqlens[b] - 1 (cache_seqlens counts from position 0, the padding
    included), then the new keys, and its masks, window and ALiBi distances are those of its
    cache_seqlens[b] - cache_leftpad[b] (+ seqlen_new) keys: n below. From 0 to cache_seqlens[b];
    a contiguous cache only (with block_table, a ValueError, as flash-attn's). Each kernel with it is
    a module of its own (the padding read from the tensor on the device, as the lengths are).
    block_table: int32 (batch, pages_per_seq): the pages of each sequence, in order; the entries past
    the pages that hold a sequence's keys are not read (as in flash-attn: Transformers leaves -1 there).
    softmax_scale: defaults to 1 / sqrt(head_dim). num_splits: 0 picks the split count of the keys
    (Flash-Decoding) from the shapes and the device; 1 does not split; n uses n.
    window_size=(left, right): query token t sees the keys from n - seqlen_q + t - left to
    n - seqlen_q + t + right (n: the sequence's keys, key 0 its first; -1: unbounded), and only the
    tiles a window reaches are read. softcap > 0: scores become softcap · tanh(score / softcap).
    alibi_slopes, float32 (heads_q,) or (batch, heads_q): -slope · |n - seqlen_q + t - p| is added to
    key p's score (after the cap). Each window and softcap value builds a module of its own.
    return_softmax_lse: also return the LSE, float32 (batch, heads_q, seqlen_q).
    sinks: float32 (heads_q,), gpt-oss's learnable sinks (:func:`flash_attn_func`'s): each head's logit
    joins the merge of the split keys once (the LSE includes it; a query that sees no key gets 0 and
    lse = the sink). No gradient (decode is forward only).
    rotary_cos, rotary_sin (both or neither, with k and v): (seqlen_ro, rotary_dim / 2), q's dtype
    and device, contiguous; rotary_dim a multiple of 16 up to head_dim, seqlen_ro at least the
    cache's capacity. Rotary embedding as flash-attn's: the new k is rotated at positions
    cache_seqlens[b], cache_seqlens[b] + 1, ... before it is appended; q is rotated at the same
    positions if causal or local (a window), else every token of q at position cache_seqlens[b]
    (positions in the cache, as flash-attn's: a cache_leftpad does not move them).
    rotary_interleaved=True rotates the pairs of dims (0, 1), (2, 3), ... (GPT-J); False the pairs
    (i, i + rotary_dim / 2) (GPT-NeoX). The dims past rotary_dim are left as they are. The rotation
    is torch ops on q and k before the kernel (``apply_rotary``: float32 arithmetic, rounded to
    q's dtype, as flash-attn's kernel does; no host sync, so a CUDA graph captures it).

    An FP8 cache (FlashAttention-3's, as serving engines store it): k_cache and v_cache
    torch.float8_e4m3fn, q (and the output) fp16 or bf16, and k_descale, v_descale float32 (batch,
    heads_kv) (None: ones): key p of sequence b is k_cache[p] · k_descale[b, hk], value p is
    v_cache[p] · v_descale[b, hk]. The kernel reads the cache's bytes and converts them in registers
    (``kernels.decode.DecodeKernel``). Contiguous or paged, GQA, cache_seqlens, causal, a window, a
    softcap, ALiBi, leftpad and sinks as above; on sm80+ GPUs (and the CPU). Appending k, v to an FP8 cache
    (FA3 quantises outside its kernel), the rotary embedding and q_descale (q stays fp16/bf16) raise
    NotImplementedError.

    Returns out (q's shape and dtype), or (out, lse). A query that sees no key gets 0 and an LSE of
    -inf. On the CPU, lengths, leftpads and indices outside the cache are a ValueError; on a GPU they
    are not checked (that would wait for the device): the kernel clamps them to the cache (a leftpad
    to 0 ... its sequence's length), so it never reads outside it.
    """
    fp8_cache = _is_fp8(k_cache, v_cache, None, k_descale, v_descale)  # an e4m3 cache, or descales
    if fp8_cache:
        _check_fp8_cache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, q_descale)
    elif _is_fp8(q) or q_descale is not None:
        raise NotImplementedError("flash_attn_with_kvcache: q in FP8 (q_descale): not served; q stays fp16 or bf16 "
                                  "over an FP8 cache")
    return_softmax_lse = check_flag("return_softmax_lse", return_softmax_lse)
    rotary_interleaved = check_flag("rotary_interleaved", rotary_interleaved)
    variant = resolve_variant(causal, window_size, softcap, alibi_slopes is not None)  # checks causal too
    causal = variant.pop("causal")  # an argument of the call; the rest the kernel's
    check_kvcache_layout(q, k_cache, v_cache, cache_batch_idx, block_table, cache_leftpad)
    batch, device = q.shape[0], q.device
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]

    if cache_seqlens is None:
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens: expected an int or an int32 tensor, got {type(cache_seqlens).__name__}")
    kernel = decode_kernel_for(q, k_cache.shape[1] if paged else 0,
                               (variant.get("window_left", -1), variant.get("window_right", -1)),
                               variant.get("softcap", 0.0), variant.get("alibi", False), cache_leftpad is not None,
                               sinks is not None, fp8_cache=fp8_cache)
    index = block_table if paged else cache_batch_idx if cache_batch_idx is not None else kernel.batch_rows(batch, device)
    # Check every argument before anything is written to the cache.
    kernel.check_inputs(q, k_cache, v_cache, cache_seqlens, index, None)
    kernel.variant_arguments(q, alibi_slopes, cache_leftpad)
    kernel.merge_arguments(q, sinks)
    kernel.descale_arguments(q, k_cache, k_descale, v_descale)
    resolve_softmax_scale(softmax_scale, q.shape[-1])
    check_num_splits(num_splits)
    check_new_keys(k, v, k_cache, batch, device)
    new = 0 if k is None else k.shape[1]
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        check_rotary(rotary_cos, rotary_sin, q, k, capacity)
    if device.type == "cpu":  # checking on a GPU would wait for it: there the kernel clamps instead
        check_cache_values(cache_seqlens, new, capacity, index, paged, k_cache.shape[0], cache_leftpad)
    if rotary:
        # flash-attn's rule: q's tokens at successive positions if causal or local, else all at
        # cache_seqlens (a window bound as long as the cache is none, as flash-attn clears it)
        local = any(0 <= variant.get(side, -1) < capacity for side in ("window_left", "window_right"))
        k = apply_rotary(k, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved)
        q = apply_rotary(q, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved, successive=causal or local)
    if new:
        _append(k_cache, v_cache, k, v, cache_seqlens, index, paged)
        lengths = cache_seqlens + new
    else:
        lengths = cache_seqlens
    out, lse = kernel(q, k_cache, v_cache, lengths, index, num_splits=num_splits, softmax_scale=softmax_scale,
                      causal=causal, alibi_slopes=alibi_slopes, cache_leftpad=cache_leftpad, sinks=sinks,
                      k_descale=k_descale, v_descale=v_descale)
    return (out, lse) if return_softmax_lse else out


def _check_fp8_cache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, q_descale) -> None:
    """What flash_attn_with_kvcache over an FP8 cache refuses: caches not both e4m3, q not fp16/bf16,
    appending k and v (FA3 quantises them outside its kernel: write the e4m3 rows into the cache first),
    the rotary embedding (it rotates the new k) and q_descale."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name}: an FP8 cache (descales given, or an e4m3 cache) needs k_cache and v_cache both "
                            f"torch.float8_e4m3fn, got {getattr(t, 'dtype', type(t).__name__)}")
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.float16, torch.bfloat16):
        raise NotImplementedError(f"q: over an FP8 cache q must be float16 or bfloat16 (an FP8 q, q_descale: not "
                                  f"served), got {getattr(q, 'dtype', type(q).__name__)}")
    if k is not None or v is not None:
        raise NotImplementedError("k, v: appending to an FP8 cache is not served (FA3 quantises outside its kernel): "
                                  "quantise the new rows to e4m3 and write them into k_cache, v_cache first")
    if rotary_cos is not None or rotary_sin is not None:
        raise NotImplementedError("rotary_cos, rotary_sin: the rotary embedding over an FP8 cache (it rotates the new "
                                  "k, which an FP8 cache does not take) is not served")
    if q_descale is not None:
        raise NotImplementedError("q_descale: over an FP8 cache q stays float16 or bfloat16 (no FP8 q)")


def apply_rotary(x, cos, sin, offsets, interleaved: bool, successive: bool = True):
    """x (batch, seqlen, heads, head_dim) rotated as flash-attn's ``apply_rotary_emb``: token i of
    sequence b at position offsets[b] + i (``successive``), or every token at offsets[b]. cos, sin:
    (seqlen_ro, rotary_dim / 2); the first rotary_dim dims rotate, in pairs (0, 1), (2, 3), ... if
    ``interleaved``, else (i, i + rotary_dim / 2); the rest are copied. Computed in float32 and
    rounded to x's dtype; a new tensor. Torch ops only, with the positions gathered on the device
    (no host sync; positions past the table are clamped to its last, as the cache's lengths are
    clamped by the kernel)."""
    half = cos.shape[1]
    positions = offsets.long()[:, None]
    if successive:
        positions = positions + torch.arange(x.shape[1], device=x.device)
    positions = positions.clamp(0, cos.shape[0] - 1).expand(x.shape[0], x.shape[1])
    c = cos[positions].float()[:, :, None, :]  # (batch, seqlen, 1, rotary_dim / 2)
    s = sin[positions].float()[:, :, None, :]
    rotated = x[..., : 2 * half].float()
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rotated[..., :half], rotated[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _append(k_cache, v_cache, k, v, cache_seqlens, index, paged) -> None:
    """Write k, v (batch, seqlen_new, heads_kv, head_dim) into the caches at cache_seqlens[b] + i, in
    place (torch indexing: no host sync, so a CUDA graph captures it)."""
    positions = cache_seqlens.long()[:, None] + torch.arange(k.shape[1], device=k.device)  # (batch, seqlen_new)
    if paged:
        page_size = k_cache.shape[1]
        rows = (index.long().gather(1, positions // page_size), positions % page_size)
    else:
        rows = (index.long()[:, None], positions)
    k_cache[rows] = k
    v_cache[rows] = v
