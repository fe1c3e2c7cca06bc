"""The public functions, ``ring_attention`` and ``ulysses_attention``: their arguments checked in one
place, then the ring's autograd Function or Ulysses' all_to_alls around ``tvmflash.attention``."""

from __future__ import annotations

import functools
import itertools
import zlib

import torch

from tvmflash import ops
from tvmflash.distributed import plan
from tvmflash.distributed.comm import Ring, check_same_on_every_rank, world_of
from tvmflash.distributed.layout import LAYOUTS, check_layout, segments
from tvmflash.distributed.ring import RingAttention, RingCall
from tvmflash.distributed.ulysses import heads_to_sequence, kv_replication, sequence_to_heads
from tvmflash.kernels.checks import check_any_head_dim, check_flag, resolve_softmax_scale, resolve_variant


def _check_shards(function: str, q, k, v, varlen: bool = False) -> None:
    """q (batch, shard_len, heads_q, head_dim), k and v (batch, shard_len, heads_kv, head_dim) (``varlen``:
    no batch dim) on one device in one dtype: TypeErrors and ValueErrors that name what is wrong."""
    dims, layout = (3, "(shard_len, heads, head_dim)") if varlen else (4, "(batch, shard_len, heads, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{function}: {name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{function}: {name}: expected {dims} dims {layout}, got shape {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{function}: {name}: expected q's dtype and device ({q.dtype}, {q.device}), got "
                             f"{t.dtype}, {t.device}")
    if k.shape != v.shape:
        raise ValueError(f"{function}: expected k and v of one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{function}: expected q, k and v of one batch, shard length and head_dim (each rank holds "
                         f"the same positions of q, k and v), got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"{function}: expected heads_q ({q.shape[-2]}) a multiple of heads_kv ({k.shape[-2]})")
    check_any_head_dim(q.shape[-1])


def _check_ranks(function, group, q, k, layout: str, variant: dict, softmax_scale: float, extra=()) -> None:
    """Every rank of the group passes the same shapes and options (a ValueError on every rank otherwise:
    mismatched transfers would hang or read garbage)."""
    check_same_on_every_rank(
        group, q.device, function, **{"shape of q": tuple(q.shape), "shape of k": tuple(k.shape),
                                      "layout": LAYOUTS.index(layout), "causal": int(variant["causal"]),
                                      "window_size": (variant.get("window_left", -1), variant.get("window_right", -1)),
                                      "softcap, softmax_scale (as float32 bits)": tuple(
                                          torch.tensor([variant.get("softcap", 0.0), softmax_scale],
                                                       dtype=torch.float32).view(torch.int32).tolist()),
                                      **dict(extra)})


def eager_under_compile(function):
    """``function``, which torch.compile does not trace: a graph break, then an eager call (collectives and
    host-side planning). ``torch.compiler.disable`` as a decorator would import torch._dynamo with this
    module (a second); this applies it only in a call that Dynamo traces (``is_compiling``), where
    torch._dynamo is loaded already, and costs an eager call nothing."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(function)(*args, **kwargs)
        return function(*args, **kwargs)

    return call


@eager_under_compile
def ring_attention(q, k, v, group=None, causal: bool = False, softmax_scale=None, window_size=(-1, -1),
                   softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False, layout: str = "contiguous",
                   return_lse: bool = False, cu_seqlens=None, check_ranks: bool = True):
    """Attention of a sequence sharded over the ranks of ``group``, by ring attention.

    q: (batch, shard_len, heads_q, head_dim), k, v: (batch, shard_len, heads_kv, head_dim) (flash-attn's
    layout), this rank's shard of one sequence of world · shard_len tokens, in ``layout``: "contiguous"
    (rank r holds positions r · shard_len ... (r + 1) · shard_len - 1) or "zigzag" (the sequence in 2 ·
    world chunks, rank r holds chunks r and 2 · world - 1 - r; shard_len even; :func:`zigzag_shard`).
    Every rank passes the same shapes and options (checked by one small all_gather unless
    ``check_ranks=False``). heads_q a multiple of heads_kv (GQA/MQA), head_dim 1 to 256 (padded as
    :func:`tvmflash.attention`'s). Returns out (q's shape and dtype), this rank's rows of the attention
    over the whole sequence, or with ``return_lse`` (out, lse), lse float32 (batch, heads_q, shard_len).
    Differentiable in q, k and v (through out and lse): each rank gets the gradients of its shards.

    causal, softmax_scale, window_size, softcap and deterministic are :func:`tvmflash.attention`'s, over
    the whole sequence (positions, not local rows: seqlen_q = seqlen_k, so the causal mask and windows
    are the usual ones). K/V shards travel round the ring by ``batch_isend_irecv``; each step's
    transfer is posted before its kernels. ``alibi_slopes`` is not supported by the ring: a
    NotImplementedError (:func:`ulysses_attention` takes ALiBi). Under torch.compile the call runs eagerly
    (a graph break).

    Documents packed across the ring (flash-attn's varlen): ``cu_seqlens``, int32 (documents + 1,) on q's
    device, the offsets of the documents in the whole sequence (0 first, world · shard_len last; the same
    on every rank); q (shard_len, heads_q, head_dim), k, v (shard_len, heads_kv, head_dim), this rank's
    rows of the packed sequence in ``layout``. Each document attends to its own keys only (causal within
    it); no window. Returns out (shard_len, heads_q, head_dim), lse float32 (heads_q, shard_len). The
    offsets are read on the host once a call.
    """
    varlen = cu_seqlens is not None
    _check_shards("ring_attention", q, k, v, varlen)
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ring_attention does not take ALiBi (a step's kernel measures "
                                  "distances from its own bottom-right diagonal, not the sequence's); "
                                  "ulysses_attention does")
    layout = check_layout(layout)
    return_lse, deterministic = check_flag("return_lse", return_lse), check_flag("deterministic", deterministic)
    check_ranks = check_flag("check_ranks", check_ranks)
    variant = resolve_variant(causal, window_size, softcap)
    left, right = variant.get("window_left", -1), variant.get("window_right", -1)
    rank, world = world_of(group)
    if varlen:
        if left >= 0 or right >= 0:
            raise NotImplementedError("window_size: ring_attention with cu_seqlens (documents packed across the "
                                      "ring) takes no window: one call's documents would need windows of their own")
        q, k, v = q[None], k[None], v[None]  # the packed rows as one batch; dropped again at the end
    batch, shard_len, heads_q, head_dim = q.shape
    if layout == "zigzag" and shard_len % 2:
        raise ValueError(f"ring_attention: layout 'zigzag' needs an even shard_len (two chunks a rank), got "
                         f"{shard_len}")
    boundaries = _check_documents(cu_seqlens, world * shard_len, q.device) if varlen else None
    softmax_scale = resolve_softmax_scale(softmax_scale, head_dim)  # q's own head_dim's, before any padding
    if check_ranks:
        extra = {"deterministic": int(deterministic)}
        if varlen:
            extra["cu_seqlens (its length and checksum)"] = (len(boundaries), zlib.crc32(repr(boundaries).encode()))
        _check_ranks("ring_attention", group, q, k, layout, variant, softmax_scale, extra)
    mine = segments(rank, world, shard_len, layout)
    runs = [segments((rank - s) % world, world, shard_len, layout) for s in range(world)]
    steps = tuple(plan.step_pieces(mine, runs[s], variant["causal"], left, right) for s in range(world))
    documents = None
    if varlen:
        documents = tuple(tuple(_documents(p, mine, runs[s], boundaries, q.device) for p in steps[s])
                          for s in range(world))
    call = RingCall(Ring(group) if world > 1 else None, steps, softmax_scale, variant.get("softcap", 0.0),
                    deterministic, documents)
    q, k, v, run = ops.padded_head_dim(q, k, v, head_dim)
    out, lse = RingAttention.apply(q, k, v, call)
    if run != head_dim:
        out = out[..., :head_dim]
    if varlen:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def _check_documents(cu_seqlens, total: int, device) -> list[int]:
    """cu_seqlens as a list (one host sync): int32 (documents + 1,) on q's device, from 0 to the whole
    sequence's length ``total``, non-decreasing; a TypeError or ValueError otherwise."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise TypeError(f"cu_seqlens: expected an int32 tensor (documents + 1,), got "
                        f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} "
                        f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens: expected q's device ({device}), got {cu_seqlens.device}")
    boundaries = cu_seqlens.tolist()
    if len(boundaries) < 2 or boundaries[0] != 0 or boundaries[-1] != total:
        raise ValueError(f"cu_seqlens: expected the whole sequence's offsets, 0 first and {total} (world x "
                         f"shard_len) last, got {boundaries[:3]}...{boundaries[-2:]}")
    if any(b < a for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError("cu_seqlens: expected non-decreasing offsets")
    return boundaries


def _documents(p, q_runs, k_runs, boundaries, device) -> tuple:
    """A call's varlen arguments: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of the
    documents it meets (``plan.document_lengths``)."""
    rows, keys = plan.document_lengths(p, q_runs, k_runs, boundaries)
    offsets = [torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=device) for n in (rows, keys)]
    return (*offsets, max(1, *rows), max(1, *keys))


@eager_under_compile
def ulysses_attention(q, k, v, group=None, causal: bool = False, softmax_scale=None, window_size=(-1, -1),
                      softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                      layout: str = "contiguous", return_lse: bool = False, check_ranks: bool = True):
    """Attention of a sequence sharded over the ranks of ``group``, by all_to_all over heads
    (DeepSpeed-Ulysses).

    q, k, v and ``layout`` as :func:`ring_attention`'s: this rank's shard (batch, shard_len, heads,
    head_dim). An all_to_all gives each rank heads_q / world query heads over the whole sequence, where
    :func:`tvmflash.attention` runs (every variant of it: causal, window_size, softcap, alibi_slopes
    (heads_q,) or (batch, heads_q), deterministic), and an all_to_all gives the output back in sequence
    shards. heads_q must be a multiple of the world size; a heads_kv that is not is served by repeating
    each K/V head (the least number of times that splits them, GQA's groups kept). Returns out (q's
    shape), or with ``return_lse`` (out, lse float32 (batch, heads_q, shard_len)); differentiable in q, k
    and v (the backward's all_to_alls are the reverse ones). Under torch.compile the call runs eagerly.
    """
    _check_shards("ulysses_attention", q, k, v)
    layout = check_layout(layout)
    return_lse, check_ranks = check_flag("return_lse", return_lse), check_flag("check_ranks", check_ranks)
    variant = resolve_variant(causal, window_size, softcap, alibi_slopes is not None)
    rank, world = world_of(group)
    batch, shard_len, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    if heads_q % world:
        raise ValueError(f"ulysses_attention: expected heads_q ({heads_q}) a multiple of the world size ({world}); "
                         f"ring_attention has no such bound")
    if layout == "zigzag" and shard_len % 2:
        raise ValueError(f"ulysses_attention: layout 'zigzag' needs an even shard_len (two chunks a rank), got "
                         f"{shard_len}")
    softmax_scale = resolve_softmax_scale(softmax_scale, head_dim)
    if check_ranks:
        _check_ranks("ulysses_attention", group, q, k, layout, variant, softmax_scale,
                     {"alibi_slopes given": int(alibi_slopes is not None)})
    repeat = kv_replication(heads_q, heads_kv, world)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.shape[-1] != heads_q:
            raise ValueError(f"alibi_slopes: expected float32 (heads_q,) or (batch, heads_q) with heads_q {heads_q}, "
                             f"got {getattr(alibi_slopes, 'shape', alibi_slopes)}")
        share = heads_q // world
        alibi_slopes = alibi_slopes[..., rank * share:(rank + 1) * share].contiguous()
    q, k, v = (sequence_to_heads(t, group, world, shard_len, layout) for t in (q, k, v))
    out, lse = ops.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True,
                             window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                             deterministic=deterministic)
    out = heads_to_sequence(out, group, world, shard_len, layout)
    if not return_lse:
        return out
    return out, heads_to_sequence(lse, group, world, shard_len, layout, seq_dim=2, head_dim=1)
