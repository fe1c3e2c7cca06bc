"""The checks of flash-attn's API that only its functions make (``tvmflash.flash_attn``): packed tensors, its
flags, and ``flash_attn_with_kvcache``'s cache, new keys and rotary tables. The kernels' own checks are
``tvmflash.kernels.checks``."""

from __future__ import annotations

import torch

from tvmflash.kernels.checks import check_dropout_p, check_flag


def check_packed(name, t, count, varlen=False):
    """A packed qkv (``count`` 3) or kv (2) of flash-attn's packed functions."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if varlen:
        if t.dim() != 4 or t.shape[1] != count:
            raise ValueError(f"{name}: expected shape (total, {count}, nheads, headdim), got {tuple(t.shape)}")
    elif t.dim() != 5 or t.shape[2] != count:
        raise ValueError(f"{name}: expected shape (batch, seqlen, {count}, nheads, headdim), got {tuple(t.shape)}")


def check_flash_attn_options(dropout_p, **flags) -> tuple:
    """flash-attn's flags (``check_flag``'s forms) and dropout_p (``check_dropout_p``), checked: (dropout_p,
    *flags) as a float and bools."""
    return (check_dropout_p(dropout_p), *(check_flag(name, value) for name, value in flags.items()))


def check_kvcache_layout(q, k_cache, v_cache, cache_batch_idx, block_table, cache_leftpad=None) -> None:
    """q and the caches are 4-dim tensors; a paged cache (``block_table``, int32 (batch,
    pages_per_seq)) takes no cache_batch_idx, nor cache_leftpad (as flash-attn's)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims, got shape {tuple(t.shape)}")
    paged = block_table is not None
    if paged and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx: a paged cache (block_table) takes no cache_batch_idx; its block table "
                         "names each sequence's pages")
    if paged and cache_leftpad is not None:
        raise ValueError("cache_leftpad: a paged cache (block_table) takes no cache_leftpad, as flash-attn's: \"We "
                         "don't support Paged KV and leftpad at the same time\"")
    if paged and (not isinstance(block_table, torch.Tensor) or block_table.dim() != 2):
        raise ValueError(f"block_table: expected an int32 tensor (batch, pages_per_seq), got "
                         f"{getattr(block_table, 'shape', block_table)!r}")


def check_new_keys(k, v, k_cache, batch: int, device) -> None:
    """The new k and v to append to the cache: both or neither, (batch, seqlen_new, heads_kv,
    head_dim) of the cache's dtype on q's device."""
    if (k is None) != (v is None):
        raise ValueError(f"{'v' if k is not None else 'k'}: expected k and v both or neither, got only "
                         f"{'k' if k is not None else 'v'}")
    if k is None:
        return
    want = (batch, k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else -1, *k_cache.shape[2:])
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape) != want:
            raise ValueError(f"{name}: expected shape (batch, seqlen_new, heads_kv, head_dim) = {want}, got "
                             f"{getattr(t, 'shape', t)!r}")
        if t.dtype != k_cache.dtype or t.device != device:
            raise ValueError(f"{name}: expected the cache's dtype {k_cache.dtype} and device {device}, got "
                             f"{t.dtype} on {t.device}")


def check_rotary(rotary_cos, rotary_sin, q, k, capacity) -> None:
    """flash-attn's checks of rotary_cos and rotary_sin (before anything is written to the cache)."""
    if rotary_cos is None or rotary_sin is None:
        raise ValueError(f"{'rotary_sin' if rotary_sin is None else 'rotary_cos'}: expected rotary_cos and rotary_sin "
                         "both or neither")
    if k is None:
        raise ValueError("rotary_cos: rotary embedding needs the new k and v to append to the cache (flash-attn's rule)")
    head_dim = q.shape[-1]
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2 or t.shape != rotary_cos.shape:
            raise ValueError(f"{name}: expected shape (seqlen_ro, rotary_dim / 2), rotary_cos's and rotary_sin's alike, "
                             f"got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name}: expected q's dtype {q.dtype} and device {q.device}, got {t.dtype} on {t.device}")
    seqlen_ro, rotary_dim = rotary_cos.shape[0], 2 * rotary_cos.shape[1]
    if not 0 < rotary_dim <= head_dim or rotary_dim % 16:
        raise ValueError(f"rotary_cos: expected rotary_dim (2 x its last dim) a multiple of 16 up to head_dim {head_dim}, "
                         f"got {rotary_dim}")
    if seqlen_ro < capacity:
        raise ValueError(f"rotary_cos: expected at least the cache's {capacity} positions (seqlen_ro), got {seqlen_ro}")


def check_cache_values(cache_seqlens, new, capacity, index, paged, cache_rows, cache_leftpad=None) -> None:
    """Lengths and indices within the cache, and each leftpad from 0 to its sequence's cache_seqlens
    (CPU tensors: this reads their values)."""
    if cache_seqlens.numel() and (cache_seqlens.min() < 0 or cache_seqlens.max() + new > capacity):
        raise ValueError(f"cache_seqlens: expected lengths from 0 to the cache's {capacity} keys"
                         + (f" less the {new} new ones" if new else "") + f", got {cache_seqlens.tolist()}")
    if cache_leftpad is not None and bool(((cache_leftpad < 0) | (cache_leftpad > cache_seqlens)).any()):
        raise ValueError(f"cache_leftpad: expected each sequence's first key from 0 to its cache_seqlens "
                         f"{cache_seqlens.tolist()}, got {cache_leftpad.tolist()}")
    if paged and index.numel():
        # Only the pages that hold a sequence's keys are read, as in flash-attn: the entries past them may be
        # anything (Transformers' continuous batching leaves -1 there), and the kernel clamps them anyway.
        page_size = capacity // index.shape[1]
        pages_used = (cache_seqlens.to(torch.int64) + new + page_size - 1) // page_size
        index = index[torch.arange(index.shape[1]) < pages_used[:, None]]
    if index.numel() and (index.min() < 0 or index.max() >= cache_rows):
        name, what = ("block_table", "page") if paged else ("cache_batch_idx", "cache row")
        raise ValueError(f"{name}: expected {what} indices from 0 to {cache_rows - 1}, got values from "
                         f"{index.min().item()} to {index.max().item()}")
