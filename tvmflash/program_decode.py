"""Flash-Decoding as two TensorIR programs: attention of a few query tokens over a KV cache, with the
keys split over several thread blocks (tasks), and the merge of the splits' partial results.

This file states *what* is computed; ``schedules/`` (``schedule_decode`` of ``cpu.py`` and ``simt.py``)
map it onto hardware by its block names (``load_q``, ``load_k``, ``qk``, ``row_max``, ``pv``, ...).

Layout (flash-attn's ``flash_attn_with_kvcache``):
    q:            (batch, seqlen_q, heads_q, head_dim)          dtype
    k/v cache:    (cache_batch, cache_len, heads_kv, head_dim)  dtype   contiguous
                  (num_pages, page_size, heads_kv, head_dim)    dtype   paged
    lengths:      (batch,)                                       int32   keys each sequence has
                                                                         (with leftpad: its end row)
    index:        (batch,)               int32   contiguous: the cache row of each sequence
                  (batch, pages_per_seq) int32   paged: the block table
    o_part:       (num_splits, batch, seqlen_q, heads_q, head_dim)   float32  normalised per split
    lse_part:     (num_splits, batch, seqlen_q, heads_q)             float32  natural log, per split
    out:          (batch, seqlen_q, heads_q, head_dim)           dtype
    lse:          (batch, heads_q, seqlen_q)                     float32  natural log
    alibi_slopes: (batch, heads_q)       float32, any batch stride (with ALiBi only)
    cache_leftpad: (batch,)              int32   the cache row of each sequence's first key
                                                 (with ``leftpad`` only; contiguous caches)
    k_descale, v_descale: (batch, heads_kv)  float32, compact (an FP8 cache only, last: FA3's)

An FP8 cache (``DecodeSpec.cache_dtype`` e4m3, as serving engines store it) holds the keys and values in
e4m3 with a descale per (sequence, K/V head): key p is k_cache[p] · k_descale[b, hk], value p is
v_cache[p] · v_descale[b, hk]; q and the output stay in ``dtype``. The kernel reads the cache's bytes and
converts each tile to the operands' type (exactly: every e4m3 value is a bf16 and an fp16 value); the
descales, constant over a task, scale the scores (with softmax_scale) and the output (with 1 / l).

batch, seqlen_q, num_splits and the cache's sizes are symbolic, and each sequence's length is read
from ``lengths`` in the kernel: one built module serves every length, batch and split count (a decode
step of a new length never recompiles, and a CUDA graph replays as the lengths change). head_dim, the
head counts, dtype, the cache's layout (contiguous, or paged with its page size), the variants (a
sliding window, a softcap, ALiBi: as the forward's, ``tvmflash.program.AttentionSpec``) and the tile
sizes are static. causal is an argument: with one query token it changes nothing, so one module serves
both.

With ``leftpad`` (flash-attn's ``cache_leftpad``) sequence b's keys are the cache rows
cache_leftpad[b] .. lengths[b] - 1: its keys count from that row, and its masks, windows and ALiBi
distances are those of its lengths[b] - cache_leftpad[b] keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from tvmflash import program, tvmscript
from tvmflash.program_e4m3 import e4m3_bits_to_float32
from tvmflash.program import FP8, LOG2E, NO_MAX, RESCALE_THRESHOLD, AttentionSpec


@dataclass(frozen=True)
class DecodeSpec:
    """The static part of a decode problem: one built module per spec (and per tile sizes)."""

    head_dim: int
    dtype: str
    heads_q: int
    heads_kv: int
    page_size: int = 0  # 0: a contiguous cache; else the paged cache's rows per page (a power of two >= 16)
    causal: ClassVar[bool] = False  # an argument of the call, not of the module (one module serves both)
    # the forward's variants (``AttentionSpec``), seqlen_k being each sequence's keys
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi: bool = False
    # flash-attn's cache_leftpad: each sequence's keys start at a cache row of their own (an argument)
    leftpad: bool = False
    # learnable sinks (``AttentionSpec.sinks``): a logit per query head, an argument of the merge alone,
    # which adds the sink once (the split programs are those without sinks)
    sinks: bool = False
    # the cache's element type: "" for q's dtype, or FP8 (e4m3, with k_descale and v_descale arguments)
    cache_dtype: str = ""

    def __post_init__(self):
        _ = self.attention  # the forward's checks
        if self.cache_dtype not in ("", FP8):
            raise ValueError(f"cache_dtype: expected '' (q's dtype) or {FP8!r}, got {self.cache_dtype!r}")
        if self.fp8_cache and self.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"cache_dtype {FP8}: q's dtype must be float16 or bfloat16, got {self.dtype}")
        if self.page_size and (self.page_size < 16 or self.page_size & (self.page_size - 1)):
            raise ValueError(f"page_size: expected a power of two >= 16, got {self.page_size}")
        for name in ("leftpad", "sinks"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if self.leftpad and self.page_size:  # as flash-attn's
            raise ValueError("leftpad: a paged cache takes no cache_leftpad (flash-attn serves paged KV and leftpad "
                             "not at the same time)")

    @property
    def attention(self) -> AttentionSpec:
        """The forward's spec of the same head_dim, dtype, heads and variant (not causal)."""
        return AttentionSpec(self.head_dim, self.dtype, False, self.heads_q, self.heads_kv, self.window_left,
                             self.window_right, self.softcap, self.alibi)

    @property
    def group(self) -> int:
        """Query heads that share one K/V head (GQA)."""
        return self.heads_q // self.heads_kv

    @property
    def fp8_cache(self) -> bool:
        """Is the cache e4m3, with descales?"""
        return self.cache_dtype == FP8

    @property
    def kv_dtype(self) -> str:
        """The cache's element type."""
        return self.cache_dtype or self.dtype


def decode_split(spec: DecodeSpec, query_tokens: int, block_n: int, final: bool = False,
                 tensor_cores: bool = False, e4m3_bits: bool = False, byte_tiles: str = ""):
    """Return ``main(q, k_cache, v_cache, lengths, index, o_part, lse_part, softmax_scale, causal)``
    (then ``alibi_slopes`` with ALiBi, ``cache_leftpad`` with leftpad, and ``k_descale``, ``v_descale``
    last with an FP8 cache); with ``final``,
    ``main(q, k_cache, v_cache, lengths, index, out, lse, softmax_scale, causal)``: one split, whose
    results are the output (q's dtype) and the LSE (batch, heads_q, seqlen_q) themselves, so that no
    merge runs.

    One task per (sequence b, K/V head hk, block qb of ``query_tokens`` query tokens, split s). Its
    rows are the query heads of hk's GQA group times the block's tokens (row r: token
    qb * query_tokens + r // group, head hk * group + r % group), so the group's K/V tiles are read
    once for all its query heads. The sequence's keys (``lengths[b]`` of them; causal: only up to the
    block's last visible key) form tiles of ``block_n``, divided evenly over the ``num_splits``
    splits; split s streams its tiles past its rows with the forward's online softmax in base 2
    (``tvmflash.program``: the running max of the unscaled scores starts at NO_MAX and moves past
    RESCALE_THRESHOLD only) and writes its normalised output and LSE. A split with no key writes 0
    and an LSE of -inf, as does a row that sees no key.

    tensor_cores: the query rows stay in q's dtype and P V takes P cast to it (``Pc``, block
    ``cast_p``), as in the forward, so that both products can run on tensor cores; else the query rows
    and P are float32 (exact products for a SIMT schedule).

    causal (an int32, 0 or 1): query token t of seqlen_q sees key p iff p <= lengths[b] - seqlen_q + t
    (bottom-right, flash-attn's); a window bounds p to lengths[b] - seqlen_q + t - window_left ...
    lengths[b] - seqlen_q + t + window_right (only the tiles it reaches are divided over the splits),
    and a softcap or ALiBi transforms the scores as the forward does (``program.transformed_score``;
    ALiBi's distance is lengths[b] - seqlen_q + t - p). With leftpad, key p is cache row
    cache_leftpad[b] + p and lengths[b] - cache_leftpad[b] stands for lengths[b] in these rules.
    Lengths are clamped to the cache's size, a leftpad to 0 .. the length, and cache indices (the batch
    row, a page) to its extent, so no input reads outside the cache. The cache must hold at least
    one key (the caller answers an empty one: 0 and an LSE of -inf).

    An FP8 cache: load_k and load_v read the cache's e4m3 bytes and convert them to the tiles' type
    (``Kt``, ``Vt``: q's dtype for tensor cores, else float32; the zero padding in that type), or with
    ``byte_tiles`` copy them into tiles of their own (``Kt8``, ``Vt8``), which blocks ``dequant_k`` and
    ``dequant_v`` convert. byte_tiles "prefetched" (a schedule that prefetches the next tiles' bytes into
    registers): every key's bytes (indices clamped), dequant_k after load_k and before load_v, the
    conversions zeroing the rows past the keys; "staged" (a schedule that copies the bytes into shared
    tiles with cp.async, in a software pipeline): the loads zero the rows past the keys (byte 0 is e4m3's
    zero; a predicated cp.async writes it) and both come first; the plain conversions come right before
    the products that read them (dequant_k before qk, dequant_v before pv; not with e4m3_bits). The task's
    softmax_scale is softmax_scale · k_descale[b, hk], and its 1 / l is v_descale[b, hk] / l (block
    ``init_value_scale`` reads v_descale once, into ``v_scale``). e4m3_bits: convert by the bits
    (``e4m3_bits_to_float32``) rather than by a cast, for a target without an FP8 conversion of its own, where
    TVM's legalized one is wrong at zero and the subnormals (the CPU, sm_80 and sm_86: ``target.converts_fp8``).
    """
    D, QT, BN, PS = spec.head_dim, query_tokens, block_n, spec.page_size
    HQ, HKV, G = spec.heads_q, spec.heads_kv, spec.group
    R = QT * G  # rows of a task
    dtype, f32 = spec.dtype, "float32"
    q_dtype = dtype if tensor_cores else f32  # the query rows' type in the task (exact either way)
    kv_dtype, fp8 = spec.kv_dtype, spec.fp8_cache
    operand = q_dtype if fp8 else dtype  # the K/V tiles' type (with an FP8 cache the operands' own)

    if byte_tiles not in ("", "prefetched", "staged"):
        raise ValueError(f"byte_tiles: expected '', 'prefetched' or 'staged', got {byte_tiles!r}")
    staged = fp8 and byte_tiles == "staged"
    prefetched = fp8 and byte_tiles == "prefetched"
    if staged and e4m3_bits:  # (a staged copy is a plain copy of e4m3 values, which TVM computes in float32 there)
        raise ValueError("byte_tiles 'staged': for a target that converts e4m3 itself (not with e4m3_bits)")
    # An FP8 cache's byte tiles (Kt8, Vt8): e4m3, or with e4m3_bits its bits as uint8, so that no value
    # passes through TVM's legalized conversions (TVM computes a copy of e4m3 values in float32)
    byte_dtype = "uint8" if e4m3_bits else kv_dtype

    def cache_bytes(value):  # an element of an FP8 cache as its byte tile holds it
        return T.reinterpret("uint8", value) if e4m3_bits else value

    def dequantised(x):  # an element of a byte tile in the K/V tiles' type
        return T.cast(e4m3_bits_to_float32(x), operand) if e4m3_bits else T.cast(x, operand)

    def zero_byte():  # e4m3's zero, byte 0 (the staged byte tiles' padding)
        return T.Cast(kv_dtype, T.float32(0))

    def byte_tile(name):  # a tile of the cache's bytes in the block being parsed (byte_tiles), else None
        if not (staged or prefetched):
            return None
        tile = T.sblock_alloc_buffer((BN, D), byte_dtype)
        IRBuilder.name(name, tile)
        return tile

    def loaded(bytes_tile, tile):  # the tile load_k (load_v) writes: the cache's bytes with byte_tiles
        return bytes_tile if staged or prefetched else tile

    def converted(value):  # a cache element as the K/V tiles' type (an FP8 cache converted as it is read)
        return dequantised(cache_bytes(value)) if fp8 else value

    def loaded_element(value, valid):  # what load_k (load_v) writes of a cache element (valid: a key's)
        if staged:  # its bytes, zeroed past the keys, converted after both loads
            return T.if_then_else(valid, value, zero_byte())
        if prefetched:  # every key's bytes (indices clamped): dequant_k (dequant_v) zeroes
            return cache_bytes(value)
        return T.if_then_else(valid, converted(value), T.cast(0, operand))

    def from_bytes(x, valid):  # what dequant_k (dequant_v) writes of a byte tile's element
        if prefetched:  # zero-padded in the tiles' own type: no zero of e4m3 needed
            return T.if_then_else(valid, dequantised(x), T.cast(0, operand))
        return dequantised(x)  # staged: zeroed as bytes

    def scalar(name):  # a float32 of the block being parsed (an FP8 cache), else None
        if not fp8:
            return None
        value = T.sblock_alloc_buffer((1,), f32)
        IRBuilder.name(name, value)
        return value

    left, right = spec.window_left, spec.window_right

    # Helpers on a task's indices, inlined by TVMScript (they take the buffers and shape variables).
    def key_end(lengths, vb, capacity):  # the cache row past the sequence's last key, clamped to the cache's capacity
        return T.min(T.max(lengths[vb], 0), capacity)

    def keys(lengths, leftpad, vb, capacity):  # the sequence's keys (with leftpad: from its first key's row on)
        if leftpad is None:
            return key_end(lengths, vb, capacity)
        return T.max(key_end(lengths, vb, capacity) - T.max(leftpad[vb], 0), 0)

    def first_key(leftpad, lengths, vb, capacity):  # the cache row of the sequence's first key (leftpad only)
        return T.min(T.max(leftpad[vb], 0), key_end(lengths, vb, capacity))

    def tiles(n_keys, vqb, seqlen_q, causal):  # K/V tiles the block visits (causal: up to its last key)
        # min(n_keys, seen by the last token, or n_keys more when not causal): arithmetic, not a select,
        # so that the lowering's common-subexpression elimination computes it once
        seen = T.min(n_keys, T.max(0, n_keys - seqlen_q + (vqb + 1) * QT) + (1 - causal) * n_keys)
        if right >= 0:  # ... and up to the last token's right window edge
            seen = T.min(seen, T.max(0, n_keys - seqlen_q + (vqb + 1) * QT + right))
        return T.ceildiv(seen, BN)

    def skipped_tiles(n_keys, vqb, seqlen_q):  # tiles before the first a left window lets the block see
        return T.max(0, n_keys - seqlen_q + vqb * QT - left) // BN

    def split_tiles(n_keys, vqb, seqlen_q, causal):  # the tiles the task's splits divide among them
        n_tiles = tiles(n_keys, vqb, seqlen_q, causal)
        return n_tiles if left < 0 else T.max(0, n_tiles - skipped_tiles(n_keys, vqb, seqlen_q))

    def first_tile(n_tiles, vs, num_splits):  # split s visits tiles [first_tile(s), first_tile(s + 1)) of them
        return vs * n_tiles // num_splits

    def split_start(n_keys, n_tiles, vqb, vs, num_splits, seqlen_q):  # split s's first tile in the sequence
        start = first_tile(n_tiles, vs, num_splits)
        return start if left < 0 else skipped_tiles(n_keys, vqb, seqlen_q) + start

    def sees_up_to(t, p, n_keys, seqlen_q, causal):  # is key p within the keys and token t's right bound?
        seen = T.And(p < n_keys, T.Or(causal == 0, p <= n_keys - seqlen_q + t))
        return seen if right < 0 else T.And(seen, p <= n_keys - seqlen_q + t + right)

    def visible(t, p, n_keys, seqlen_q, causal):  # does query token t see key position p?
        if left < 0:
            return sees_up_to(t, p, n_keys, seqlen_q, causal)
        return T.And(sees_up_to(t, p, n_keys, seqlen_q, causal), p >= n_keys - seqlen_q + t - left)

    def tile_visible(vqb, tile, n_keys, seqlen_q, causal):  # does every row of the task see every key of the tile?
        inside = sees_up_to(vqb * QT, tile * BN + BN - 1, n_keys, seqlen_q, causal)  # the first token, the last key
        if left < 0:
            return inside
        return T.And(inside, tile * BN >= n_keys - seqlen_q + vqb * QT + QT - 1 - left)  # the last token, the first key

    def task_scale(softmax_scale, descales, vb, vhk):  # softmax_scale, with an FP8 cache times k_descale
        return softmax_scale if descales is None else softmax_scale * descales[0][vb, vhk]

    def value_scale(v_scale):  # what 1 / l is multiplied by: 1, with an FP8 cache v_descale (read once a task)
        return T.float32(1) if v_scale is None else v_scale[0]

    def cache_row(index, vb, cache_rows):  # a contiguous cache's row of sequence vb
        return T.min(T.max(index[vb], 0), cache_rows - 1)

    def load_kv(cache, index, vb, p, vhk, vd, cache_rows, capacity, row, first):
        """Key/value p of sequence vb (contiguous: in cache row ``row``, from position ``first`` on with
        leftpad; None: 0). Read under p < n_keys, but a schedule may compute the address regardless (a
        zero-filling cp.async does): every index is clamped into its tensor."""
        p = T.max(T.min(p if first is None else first + p, capacity - 1), 0)
        if PS > 0:
            return cache[T.min(T.max(index[vb, p // PS], 0), cache_rows - 1), p % PS, vhk, vd]
        return cache[row, p, vhk, vd]

    @tvmscript.prim_func(s_tir=True)
    def main(q_handle: T.handle, k_handle: T.handle, v_handle: T.handle, lengths_handle: T.handle,
             index_handle: T.handle, o_part_handle: T.handle, lse_part_handle: T.handle,
             softmax_scale: T.float32, causal: T.int32):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        batch, seqlen_q, num_splits = T.int32(), T.int32(), T.int32()
        cache_rows, cache_len, pages_per_seq = T.int32(), T.int32(), T.int32()
        Q = T.match_buffer(q_handle, (batch, seqlen_q, HQ, D), dtype)
        if PS > 0:
            K = T.match_buffer(k_handle, (cache_rows, PS, HKV, D), kv_dtype)
            V = T.match_buffer(v_handle, (cache_rows, PS, HKV, D), kv_dtype)
            Index = T.match_buffer(index_handle, (batch, pages_per_seq), "int32")
        else:
            K = T.match_buffer(k_handle, (cache_rows, cache_len, HKV, D), kv_dtype)
            V = T.match_buffer(v_handle, (cache_rows, cache_len, HKV, D), kv_dtype)
            Index = T.match_buffer(index_handle, (batch,), "int32")
        Lengths = T.match_buffer(lengths_handle, (batch,), "int32")
        if final:  # the output and the LSE, of the one split
            O = T.match_buffer(o_part_handle, (batch, seqlen_q, HQ, D), dtype)
            LSE = T.match_buffer(lse_part_handle, (batch, HQ, seqlen_q), f32)
        else:
            OPart = T.match_buffer(o_part_handle, (num_splits, batch, seqlen_q, HQ, D), f32)
            LSEPart = T.match_buffer(lse_part_handle, (num_splits, batch, seqlen_q, HQ), f32)
        AlibiSlopes = T.meta_var(program.alibi_slopes_argument(spec.attention, batch, HQ))  # with ALiBi only
        CacheLeftpad = T.meta_var(leftpad_argument(spec, batch))  # with leftpad only
        Descales = T.meta_var(descale_arguments(spec, batch))  # with an FP8 cache only: (k_descale, v_descale)

        splits = T.meta_var(1 if final else num_splits)
        for b, hk, qb, s in T.grid(batch, HKV, T.ceildiv(seqlen_q, QT), splits):
            with T.sblock("tile"):
                vb, vhk, vqb, vs = T.axis.remap("SSSS", [b, hk, qb, s])
                Qt = T.sblock_alloc_buffer((R, D), q_dtype)  # the task's query rows, zero-padded
                S = T.sblock_alloc_buffer((R, BN), f32)  # Q Kᵀ of one tile, unscaled
                Sm = T.sblock_alloc_buffer((R, BN), f32)  # S masked (invisible keys -inf)
                P = T.sblock_alloc_buffer((R, BN), f32)  # exp2((S - running max) * scale2)
                Pc = T.sblock_alloc_buffer((R, BN), dtype)  # P in q's dtype (tensor_cores only)
                m = T.sblock_alloc_buffer((R,), f32)  # running max of the unscaled scores
                m_tile = T.sblock_alloc_buffer((R,), f32)
                m_new = T.sblock_alloc_buffer((R,), f32)
                alpha = T.sblock_alloc_buffer((R,), f32)
                # Running sums of P, one per key slot of a tile, rescaled with the row's max: summed over
                # the slots once, after the last tile (one reduction across a row a split, not one a tile).
                l_keys = T.sblock_alloc_buffer((R, BN), f32)
                l_keys_new = T.sblock_alloc_buffer((R, BN), f32)  # (a block can't read what it writes)
                l = T.sblock_alloc_buffer((R,), f32)  # running sum of P
                acc = T.sblock_alloc_buffer((R, D), f32)  # unnormalised output
                l_inv = T.sblock_alloc_buffer((R,), f32)
                scale2 = T.sblock_alloc_buffer((1,), f32)
                # sequence's keys, split's first tile, cache row (and with leftpad its first key's position)
                bounds = T.sblock_alloc_buffer((4 if spec.leftpad else 3,), "int32")

                v_scale = T.meta_var(scalar("v_scale"))  # an FP8 cache: the task's v_descale (else None)
                if fp8:
                    with T.sblock("init_value_scale"):
                        v_scale[0] = Descales[1][vb, vhk]
                with T.sblock("init_scale"):
                    scale2[0] = program.score_scale(spec.attention, task_scale(softmax_scale, Descales, vb, vhk)) * \
                        T.float32(LOG2E)
                for r, d in T.grid(R, D):
                    with T.sblock("load_q"):
                        vr, vd = T.axis.remap("SS", [r, d])
                        Qt[vr, vd] = T.if_then_else(
                            vqb * QT + vr // G < seqlen_q,
                            T.cast(Q[vb, vqb * QT + vr // G, vhk * G + vr % G, vd], q_dtype),
                            T.cast(0, q_dtype))
                for r in range(R):
                    with T.sblock("init_m"):
                        vr = T.axis.spatial(R, r)
                        m[vr] = T.float32(NO_MAX)
                for r, j in T.grid(R, BN):
                    with T.sblock("init_l"):
                        vr, vj = T.axis.remap("SS", [r, j])
                        l_keys[vr, vj] = T.float32(0)
                for r, d in T.grid(R, D):
                    with T.sblock("init_acc"):
                        vr, vd = T.axis.remap("SS", [r, d])
                        acc[vr, vd] = T.float32(0)

                # The task's keys and K/V tiles (split vs: tiles first .. first + n_steps - 1; with a left
                # window, the splits divide the tiles from the window's first on). The keys and the first
                # tile are read once, into registers; the trip count stays an expression of the lengths
                # (a software pipeline over the tiles needs it bound to a variable before it runs,
                # lowering.loops_and_blocks.BindLoadedPipelineExtents, and that of the inputs only).
                capacity = T.meta_var(pages_per_seq * PS if PS > 0 else cache_len)
                n_tiles = T.meta_var(split_tiles(keys(Lengths, CacheLeftpad, vb, capacity), vqb, seqlen_q, causal))
                with T.sblock("split_range"):
                    bounds[0] = keys(Lengths, CacheLeftpad, vb, capacity)
                    bounds[1] = split_start(keys(Lengths, CacheLeftpad, vb, capacity), n_tiles, vqb, vs, splits,
                                            seqlen_q)
                    bounds[2] = cache_row(Index, vb, cache_rows) if PS == 0 else 0
                    if spec.leftpad:
                        bounds[3] = first_key(CacheLeftpad, Lengths, vb, capacity)
                n_keys = T.meta_var(bounds[0])
                first = T.meta_var(bounds[1])
                row = T.meta_var(bounds[2])
                leftpad = T.meta_var(bounds[3] if spec.leftpad else None)
                n_steps = T.meta_var(first_tile(n_tiles, vs + 1, splits) - first_tile(n_tiles, vs, splits))
                for kb in range(n_steps):
                    with T.sblock("kv_step"):
                        vkb = T.axis.opaque(n_steps, kb)
                        tile = T.meta_var(first + vkb)  # the tile's index in the sequence
                        Kt = T.sblock_alloc_buffer((BN, D), operand)  # one K tile, zero-padded
                        Vt = T.sblock_alloc_buffer((BN, D), operand)
                        Kt8 = T.meta_var(byte_tile("Kt8"))  # the cache's bytes (an FP8 cache; else None)
                        Vt8 = T.meta_var(byte_tile("Vt8"))
                        for j, d in T.grid(BN, D):
                            with T.sblock("load_k"):
                                vj, vd = T.axis.remap("SS", [j, d])
                                Kl = T.meta_var(loaded(Kt8, Kt))
                                value = T.meta_var(load_kv(K, Index, vb, tile * BN + vj, vhk, vd, cache_rows, capacity,
                                                           row, leftpad))
                                Kl[vj, vd] = loaded_element(value, tile * BN + vj < n_keys)
                        # prefetched byte tiles: each tile is converted right after its load (and zero-padded in its own
                        # type: no zero of e4m3 needed), K's before V's load, so a thread need hold one tile's bytes.
                        if prefetched:
                            for j, d in T.grid(BN, D):
                                with T.sblock("dequant_k"):
                                    vj, vd = T.axis.remap("SS", [j, d])
                                    Kt[vj, vd] = from_bytes(Kt8[vj, vd], tile * BN + vj < n_keys)
                        for j, d in T.grid(BN, D):
                            with T.sblock("load_v"):
                                vj, vd = T.axis.remap("SS", [j, d])
                                Vl = T.meta_var(loaded(Vt8, Vt))
                                value = T.meta_var(load_kv(V, Index, vb, tile * BN + vj, vhk, vd, cache_rows, capacity,
                                                           row, leftpad))
                                Vl[vj, vd] = loaded_element(value, tile * BN + vj < n_keys)
                        if prefetched:
                            for j, d in T.grid(BN, D):
                                with T.sblock("dequant_v"):
                                    vj, vd = T.axis.remap("SS", [j, d])
                                    Vt[vj, vd] = from_bytes(Vt8[vj, vd], tile * BN + vj < n_keys)
                        if staged:  # both tiles' bytes are in (zero past the keys): plain conversions
                            for j, d in T.grid(BN, D):
                                with T.sblock("dequant_k"):
                                    vj, vd = T.axis.remap("SS", [j, d])
                                    Kt[vj, vd] = from_bytes(Kt8[vj, vd], tile * BN + vj < n_keys)
                        for r, j, d in T.grid(R, BN, D):
                            with T.sblock("qk"):
                                vr, vj, vd = T.axis.remap("SSR", [r, j, d])
                                with T.init():
                                    S[vr, vj] = T.float32(0)
                                S[vr, vj] = S[vr, vj] + T.cast(Qt[vr, vd], f32) * T.cast(Kt[vj, vd], f32)
                        for r, j in T.grid(R, BN):
                            with T.sblock("score"):  # invisible keys -inf; only edge tiles test; softcap, ALiBi
                                vr, vj = T.axis.remap("SS", [r, j])
                                score = T.meta_var(program.transformed_score(
                                    spec.attention, S[vr, vj], task_scale(softmax_scale, Descales, vb, vhk),
                                    program.alibi_slope(AlibiSlopes, vb, vhk * G + vr % G),
                                    vqb * QT + vr // G + n_keys - seqlen_q - (tile * BN + vj)))
                                if tile_visible(vqb, tile, n_keys, seqlen_q, causal):
                                    Sm[vr, vj] = score
                                else:
                                    Sm[vr, vj] = T.if_then_else(
                                        visible(vqb * QT + vr // G, tile * BN + vj, n_keys, seqlen_q, causal), score,
                                        T.float32(-math.inf))
                        for r, j in T.grid(R, BN):
                            with T.sblock("row_max"):
                                vr, vj = T.axis.remap("SR", [r, j])
                                with T.init():  # max's identity, so that threads can share the reduction
                                    m_tile[vr] = T.min_value(f32)
                                m_tile[vr] = T.max(m_tile[vr], Sm[vr, vj])
                        for r in range(R):
                            with T.sblock("alpha"):  # as the forward's (program_forward.py)
                                vr = T.axis.spatial(R, r)
                                new_max = T.meta_var(T.if_then_else(
                                    (m_tile[vr] - m[vr]) * scale2[0] > T.float32(RESCALE_THRESHOLD),
                                    m_tile[vr], m[vr]))
                                m_new[vr] = new_max
                                alpha[vr] = T.exp2((m[vr] - new_max) * scale2[0])
                        for r, j in T.grid(R, BN):
                            with T.sblock("exp"):
                                vr, vj = T.axis.remap("SS", [r, j])
                                P[vr, vj] = T.exp2(Sm[vr, vj] * scale2[0] - m_new[vr] * scale2[0])
                        for r, j in T.grid(R, BN):
                            with T.sblock("sum_p"):
                                vr, vj = T.axis.remap("SS", [r, j])
                                l_keys_new[vr, vj] = l_keys[vr, vj] * alpha[vr] + P[vr, vj]
                        if tensor_cores:
                            for r, j in T.grid(R, BN):
                                with T.sblock("cast_p"):
                                    vr, vj = T.axis.remap("SS", [r, j])
                                    Pc[vr, vj] = T.cast(P[vr, vj], dtype)
                        if staged:  # (V's right before P V: a schedule converting into registers holds one tile)
                            for j, d in T.grid(BN, D):
                                with T.sblock("dequant_v"):
                                    vj, vd = T.axis.remap("SS", [j, d])
                                    Vt[vj, vd] = from_bytes(Vt8[vj, vd], tile * BN + vj < n_keys)
                        for r, d, j in T.grid(R, D, BN):
                            with T.sblock("pv"):
                                vr, vd, vj = T.axis.remap("SSR", [r, d, j])
                                with T.init():
                                    acc[vr, vd] = acc[vr, vd] * alpha[vr]
                                if tensor_cores:
                                    acc[vr, vd] = acc[vr, vd] + T.cast(Pc[vr, vj], f32) * T.cast(Vt[vj, vd], f32)
                                else:
                                    acc[vr, vd] = acc[vr, vd] + P[vr, vj] * T.cast(Vt[vj, vd], f32)
                        for r in range(R):
                            with T.sblock("update_m"):  # m and l move on in blocks of their own
                                vr = T.axis.spatial(R, r)
                                m[vr] = m_new[vr]
                        for r, j in T.grid(R, BN):
                            with T.sblock("update_l"):
                                vr, vj = T.axis.remap("SS", [r, j])
                                l_keys[vr, vj] = l_keys_new[vr, vj]

                for r, j in T.grid(R, BN):
                    with T.sblock("row_sum"):
                        vr, vj = T.axis.remap("SR", [r, j])
                        with T.init():
                            l[vr] = T.float32(0)
                        l[vr] = l[vr] + l_keys[vr, vj]
                for r in range(R):
                    with T.sblock("inv_l"):
                        vr = T.axis.spatial(R, r)
                        l_inv[vr] = T.if_then_else(l[vr] > T.float32(0), value_scale(v_scale) / l[vr],
                                                   T.float32(0))
                for r, d in T.grid(R, D):
                    with T.sblock("store_o"):
                        vr, vd = T.axis.remap("SS", [r, d])
                        T.where(vqb * QT + r // G < seqlen_q)
                        if final:
                            O[vb, vqb * QT + vr // G, vhk * G + vr % G, vd] = T.cast(acc[vr, vd] * l_inv[vr], dtype)
                        else:
                            OPart[vs, vb, vqb * QT + vr // G, vhk * G + vr % G, vd] = acc[vr, vd] * l_inv[vr]
                for r in range(R):
                    with T.sblock("store_lse"):
                        vr = T.axis.spatial(R, r)
                        T.where(vqb * QT + r // G < seqlen_q)
                        row_lse = T.meta_var(T.if_then_else(
                            l[vr] > T.float32(0),
                            m[vr] * program.score_scale(spec.attention, task_scale(softmax_scale, Descales, vb, vhk))
                            + T.log(l[vr]), T.float32(-math.inf)))
                        if final:
                            LSE[vb, vhk * G + vr % G, vqb * QT + vr // G] = row_lse
                        else:
                            LSEPart[vs, vb, vqb * QT + vr // G, vhk * G + vr % G] = row_lse

    return main


def descale_arguments(spec: DecodeSpec, batch):
    """With an FP8 cache, two more parameters of the PrimFunc being parsed, last: ``k_descale`` and
    ``v_descale``, float32 (batch, heads_kv), compact (FlashAttention-3's); None without."""
    if not spec.fp8_cache:
        return None
    descales = []
    for name in ("k_descale", "v_descale"):
        handle = T.arg(f"{name}_handle", T.handle())
        buffer = T.match_buffer(handle, (batch, spec.heads_kv), "float32")
        IRBuilder.name(name, buffer)
        descales.append(buffer)
    return tuple(descales)


def leftpad_argument(spec: DecodeSpec, batch):
    """With ``leftpad``, one more parameter of the PrimFunc being parsed, after the others (as
    ``program.alibi_slopes_argument``): cache_leftpad, (batch,) int32; None without."""
    if not spec.leftpad:
        return None
    handle = T.arg("cache_leftpad_handle", T.handle())
    leftpad = T.match_buffer(handle, (batch,), "int32")
    IRBuilder.name("CacheLeftpad", leftpad)
    return leftpad


def merged_max(spec: DecodeSpec, lse_max, sinks, h):
    """The max the merge subtracts: the splits' LSE max, or with sinks the larger of it and the sink's."""
    return lse_max if not spec.sinks else T.max(lse_max, sinks[h])


def with_sink(spec: DecodeSpec, total, sinks, h, m):
    """The merge's sum Σ_s exp(lse_s - m) as it is, or with sinks plus the sink's exp(sink - m)."""
    return total if not spec.sinks else total + T.exp(sinks[h] - m)


def decode_merge(spec: DecodeSpec):
    """Return ``main(o_part, lse_part, out, lse)`` (then ``sinks`` with sinks): the splits' results
    combined, per (sequence, token, head): lse = log Σ_s exp(lse_s), out = Σ_s exp(lse_s - lse) o_s;
    a row no split saw a key for gets 0 and an LSE of -inf (never NaN). With sinks the sink of head h
    is one more term of lse's sum, with no output: lse = log(exp(sink_h) + Σ_s exp(lse_s)), added
    here once for all the splits (a row that sees no key gets 0 and lse = sink_h)."""
    D, HQ, dtype, f32 = spec.head_dim, spec.heads_q, spec.dtype, "float32"

    @tvmscript.prim_func(s_tir=True)
    def main(o_part_handle: T.handle, lse_part_handle: T.handle, out_handle: T.handle, lse_handle: T.handle):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        batch, seqlen_q, num_splits = T.int32(), T.int32(), T.int32()
        OPart = T.match_buffer(o_part_handle, (num_splits, batch, seqlen_q, HQ, D), f32)
        LSEPart = T.match_buffer(lse_part_handle, (num_splits, batch, seqlen_q, HQ), f32)
        O = T.match_buffer(out_handle, (batch, seqlen_q, HQ, D), dtype)
        LSE = T.match_buffer(lse_handle, (batch, HQ, seqlen_q), f32)
        Sinks_ = T.meta_var(program.sinks_argument(spec, HQ))  # with sinks only

        for b, t, h in T.grid(batch, seqlen_q, HQ):
            with T.sblock("row"):
                vb, vt, vh = T.axis.remap("SSS", [b, t, h])
                lse_max = T.sblock_alloc_buffer((1,), f32)  # max of the splits' LSE
                m = T.sblock_alloc_buffer((1,), f32)  # the same, 0 if all are -inf
                total = T.sblock_alloc_buffer((1,), f32)  # Σ_s exp(lse_s - m)
                acc = T.sblock_alloc_buffer((D,), f32)
                for s in range(num_splits):
                    with T.sblock("lse_max"):
                        vs = T.axis.reduce(num_splits, s)
                        with T.init():  # max's identity, so that threads can share the reduction
                            lse_max[0] = T.min_value(f32)
                        lse_max[0] = T.max(lse_max[0], LSEPart[vs, vb, vt, vh])
                with T.sblock("finite_max"):  # all -inf: exp(-inf - -inf) would be NaN
                    m[0] = T.if_then_else(merged_max(spec, lse_max[0], Sinks_, vh) <= T.min_value(f32), T.float32(0),
                                          merged_max(spec, lse_max[0], Sinks_, vh))
                for s in range(num_splits):
                    with T.sblock("lse_sum"):
                        vs = T.axis.reduce(num_splits, s)
                        with T.init():
                            total[0] = T.float32(0)
                        total[0] = total[0] + T.exp(LSEPart[vs, vb, vt, vh] - m[0])
                for d, s in T.grid(D, num_splits):
                    with T.sblock("merge_o"):
                        vd, vs = T.axis.remap("SR", [d, s])
                        with T.init():
                            acc[vd] = T.float32(0)
                        acc[vd] = acc[vd] + T.exp(LSEPart[vs, vb, vt, vh] - m[0]) * OPart[vs, vb, vt, vh, vd]
                for d in range(D):
                    with T.sblock("store_o"):
                        vd = T.axis.spatial(D, d)
                        O[vb, vt, vh, vd] = T.cast(T.if_then_else(
                            with_sink(spec, total[0], Sinks_, vh, m[0]) > T.float32(0),
                            acc[vd] / with_sink(spec, total[0], Sinks_, vh, m[0]), T.float32(0)), dtype)
                with T.sblock("store_lse"):
                    LSE[vb, vh, vt] = T.if_then_else(
                        with_sink(spec, total[0], Sinks_, vh, m[0]) > T.float32(0),
                        m[0] + T.log(with_sink(spec, total[0], Sinks_, vh, m[0])), T.float32(-math.inf))

    return main
