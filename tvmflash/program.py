"""The FlashAttention-2 forward pass as one TensorIR program.

This file states *what* is computed and nothing about *how* it maps to hardware: schedules in
``schedules/`` transform the program by its block names (``load_q``, ``qk``, ``row_max``, ...).

Layout (flash-attn's):
    q:   (batch, seqlen_q, heads_q,  head_dim)   dtype
    k,v: (batch, seqlen_k, heads_kv, head_dim)   dtype
    out: (batch, seqlen_q, heads_q,  head_dim)   dtype
    lse: (batch, heads_q,  seqlen_q)              float32, natural log

batch, seqlen_q and seqlen_k are symbolic, so one built module serves every length. q, k, v and
out have symbolic batch, sequence and head strides (in elements) and a contiguous head_dim; lse is
compact. head_dim, the head counts, dtype, causal and the tile sizes are static.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm.script import tirx as T

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 256)

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# The running max starts finite, so exp2(score - max) is 0, never NaN, for masked scores (-inf).
# Scores are far inside this bound for any input whose dot products fit in float32.
NO_MAX = -1.0e30
# exp2 takes (score - max) * softmax_scale * log2 e, and a row that sees no key keeps NO_MAX as its
# max: the scale must keep NO_MAX * scale finite in float32 (then exp2(-inf) is 0, never NaN).
MAX_SOFTMAX_SCALE = 1.0e8
# The running max moves only when a tile's max passes it by more than this, in log2 units (FA4's
# rule): P = exp2((S - max) * scale2) then stays at most 2^8 = 256, which fp16 and bf16 hold with
# their usual relative precision, and the result is as exact as with the true max (the sum l uses
# the same stale max). alpha is then exactly 1 on most tiles, so a schedule can skip the output's
# rescale there (sm90: ``annotations.SKIP_UNIT_RESCALE_PRAGMA``).
RESCALE_THRESHOLD = 8.0


@dataclass(frozen=True)
class AttentionSpec:
    """The static part of an attention problem: one built module per spec."""

    head_dim: int
    dtype: str
    causal: bool = False
    heads_q: int = 1
    heads_kv: int = 1

    def __post_init__(self):
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype: expected one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim: expected one of {SUPPORTED_HEAD_DIMS}, got {self.head_dim}")
        if self.heads_q < 1 or self.heads_kv < 1 or self.heads_q % self.heads_kv:
            raise ValueError(
                f"heads_q: expected a positive multiple of heads_kv={self.heads_kv}, got {self.heads_q}"
            )


def attention_forward(spec: AttentionSpec, block_m: int, block_n: int, min_kv_tiles: int = 1,
                      stride_alignment: int = 1):
    """Return the forward PrimFunc ``main(q, k, v, out, lse, softmax_scale)``.

    Each (batch, head, Q block of ``block_m`` rows) is one tile; it streams K/V tiles of
    ``block_n`` rows past its Q block with an online softmax in base 2 (the running max is taken on
    the unscaled scores, and the scale times log2 e is applied inside exp2: softmax_scale must be
    positive, see ``MAX_SOFTMAX_SCALE``). Rows and keys past the end of the sequence are padded with zeros on load and masked
    with -inf in the score, so no length needs to be a multiple of a tile. With ``causal``, the
    mask is aligned bottom-right (key j is seen by query i iff j <= i + seqlen_k - seqlen_q) and
    tiles wholly above the diagonal are not visited. Only the tiles that straddle the diagonal or
    the end of the keys are masked (``tile_visible``); the others use the scores as they are.
    Each Q block visits at least ``min_kv_tiles`` K/V tiles (``kv_tiles``). The strides of q, k, v
    and out are arguments, which the caller must make multiples of ``stride_alignment`` bytes.
    """
    D, BM, BN = spec.head_dim, block_m, block_n
    HQ, HKV = spec.heads_q, spec.heads_kv
    group = HQ // HKV
    dtype, causal = spec.dtype, spec.causal
    f32 = "float32"
    stride_multiple = max(1, stride_alignment * 8 // tvm.DataType(dtype).bits)  # in elements

    def rounded(stride):
        """A stride the caller makes a multiple of stride_multiple, as code generation can see it."""
        return stride if stride_multiple == 1 else stride // stride_multiple * stride_multiple

    def kv_tiles(qb, seqlen_q, seqlen_k):
        """K/V tiles that Q block qb must visit (causal: those not wholly above the diagonal), and
        at least one: a block that sees no key (seqlen_k 0, or causal with seqlen_q > seqlen_k)
        visits one all-masked tile, which leaves its rows 0 with an LSE of -inf as they must be.
        At least ``min_kv_tiles``, too: a software pipeline of s stages over the tiles runs its
        epilogue (s - 1 tiles) unguarded only where the count is provably s - 1 or more (a guard on
        each of its statements cost ptxas 100 registers and spills on sm90); the tiles past the
        keys (or past the diagonal) are all masked and change nothing."""
        if not causal:
            return T.max(min_kv_tiles, T.ceildiv(seqlen_k, BN))
        last_key = T.min(seqlen_k, T.max(0, (qb + 1) * BM + seqlen_k - seqlen_q))
        return T.max(min_kv_tiles, T.ceildiv(last_key, BN))

    def visible(row, col, seqlen_q, seqlen_k):
        """Is key ``col`` visible to query ``row``? (Both are absolute positions.)"""
        if not causal:
            return col < seqlen_k
        return T.And(col < seqlen_k, col <= row + seqlen_k - seqlen_q)

    def tile_visible(qb, kb, seqlen_q, seqlen_k):
        """Does every query of Q block qb (padding rows too) see every key of K/V tile kb? Visibility
        only grows with the row and shrinks with the column, so the block's first row and the
        tile's last key decide. Such interior tiles skip the mask."""
        return visible(qb * BM, kb * BN + BN - 1, seqlen_q, seqlen_k)

    @T.prim_func(s_tir=True)
    def main(
        q_handle: T.handle,
        k_handle: T.handle,
        v_handle: T.handle,
        out_handle: T.handle,
        lse_handle: T.handle,
        softmax_scale: T.float32,
    ):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        batch = T.int32()
        seqlen_q = T.int32()
        seqlen_k = T.int32()
        # q, k, v and out are taken with any batch, sequence and head strides (in elements) and a
        # contiguous head_dim: (b, s, h, d) tensors and (b, h, s, d) ones seen through a transpose
        # alike, without a copy. The strides are loop-invariant kernel arguments. The program reads
        # and writes through views of the arguments whose strides are rounded down to a multiple of
        # ``stride_alignment`` bytes: the caller passes only such strides, so the views are the
        # arguments, and CUDA code generation, which emits a 16-byte vector load or store only where
        # it can prove the index a multiple of the vector (a plain stride argument made gathers of
        # scalar loads), sees it. The rounding costs two shifts a stride, out of every loop.
        q_stride_b, q_stride_s, q_stride_h = T.int32(), T.int32(), T.int32()
        k_stride_b, k_stride_s, k_stride_h = T.int32(), T.int32(), T.int32()
        v_stride_b, v_stride_s, v_stride_h = T.int32(), T.int32(), T.int32()
        o_stride_b, o_stride_s, o_stride_h = T.int32(), T.int32(), T.int32()
        Q_in = T.match_buffer(q_handle, (batch, seqlen_q, HQ, D), dtype, strides=(q_stride_b, q_stride_s, q_stride_h, 1))
        K_in = T.match_buffer(k_handle, (batch, seqlen_k, HKV, D), dtype, strides=(k_stride_b, k_stride_s, k_stride_h, 1))
        V_in = T.match_buffer(v_handle, (batch, seqlen_k, HKV, D), dtype, strides=(v_stride_b, v_stride_s, v_stride_h, 1))
        O_in = T.match_buffer(out_handle, (batch, seqlen_q, HQ, D), dtype, strides=(o_stride_b, o_stride_s, o_stride_h, 1))
        LSE = T.match_buffer(lse_handle, (batch, HQ, seqlen_q), f32)
        Q = T.decl_buffer((batch, seqlen_q, HQ, D), dtype, data=Q_in.data,
                          strides=(rounded(q_stride_b), rounded(q_stride_s), rounded(q_stride_h), 1))
        K = T.decl_buffer((batch, seqlen_k, HKV, D), dtype, data=K_in.data,
                          strides=(rounded(k_stride_b), rounded(k_stride_s), rounded(k_stride_h), 1))
        V = T.decl_buffer((batch, seqlen_k, HKV, D), dtype, data=V_in.data,
                          strides=(rounded(v_stride_b), rounded(v_stride_s), rounded(v_stride_h), 1))
        O = T.decl_buffer((batch, seqlen_q, HQ, D), dtype, data=O_in.data,
                          strides=(rounded(o_stride_b), rounded(o_stride_s), rounded(o_stride_h), 1))

        for b, h, qb in T.grid(batch, HQ, T.ceildiv(seqlen_q, BM)):
            with T.sblock("tile"):
                vb, vh, vqb = T.axis.remap("SSS", [b, h, qb])
                Qt = T.sblock_alloc_buffer((BM, D), dtype)  # the Q block, zero-padded
                S = T.sblock_alloc_buffer((BM, BN), f32)  # Q Kᵀ of one tile, unscaled
                Sm = T.sblock_alloc_buffer((BM, BN), f32)  # S masked (invisible keys -inf)
                P = T.sblock_alloc_buffer((BM, BN), f32)  # exp2((S - running max) * scale2)
                Pc = T.sblock_alloc_buffer((BM, BN), dtype)  # P in the input dtype, for P V
                # running max of the unscaled scores: with scale2 > 0 the max commutes with the
                # scaling, which then fuses into exp2's argument (one FMA per score)
                m = T.sblock_alloc_buffer((BM,), f32)
                m_tile = T.sblock_alloc_buffer((BM,), f32)  # max of one tile's masked scores
                m_new = T.sblock_alloc_buffer((BM,), f32)  # m, or m_tile past RESCALE_THRESHOLD
                alpha = T.sblock_alloc_buffer((BM,), f32)  # exp2(m - m_new): rescale factor
                l = T.sblock_alloc_buffer((BM,), f32)  # running sum of P
                l_tile = T.sblock_alloc_buffer((BM,), f32)  # sum of one tile's P
                l_new = T.sblock_alloc_buffer((BM,), f32)  # l * alpha + l_tile
                acc = T.sblock_alloc_buffer((BM, D), f32)  # unnormalised output
                l_inv = T.sblock_alloc_buffer((BM,), f32)  # 1 / l, or 0 for a row that sees no key
                scale2 = T.sblock_alloc_buffer((1,), f32)

                with T.sblock("init_scale"):
                    scale2[0] = softmax_scale * T.float32(LOG2E)
                for i, d in T.grid(BM, D):
                    with T.sblock("load_q"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        Qt[vi, vd] = T.if_then_else(
                            vqb * BM + vi < seqlen_q,
                            Q[vb, vqb * BM + vi, vh, vd],
                            T.cast(0, dtype),
                        )
                for i in range(BM):
                    with T.sblock("init_ml"):
                        vi = T.axis.spatial(BM, i)
                        m[vi] = T.float32(NO_MAX)
                        l[vi] = T.float32(0)
                for i, d in T.grid(BM, D):
                    with T.sblock("init_acc"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        acc[vi, vd] = T.float32(0)

                for kb in range(kv_tiles(vqb, seqlen_q, seqlen_k)):
                    with T.sblock("kv_step"):
                        vkb = T.axis.opaque(kv_tiles(vqb, seqlen_q, seqlen_k), kb)
                        # Per-tile buffers live in the scope of one K/V step (a software pipeline
                        # over kb can then keep several versions of them).
                        Kt = T.sblock_alloc_buffer((BN, D), dtype)  # one K tile, zero-padded
                        Vt = T.sblock_alloc_buffer((BN, D), dtype)  # one V tile, zero-padded
                        for j, d in T.grid(BN, D):
                            with T.sblock("load_k"):
                                vj, vd = T.axis.remap("SS", [j, d])
                                Kt[vj, vd] = T.if_then_else(
                                    vkb * BN + vj < seqlen_k,
                                    K[vb, vkb * BN + vj, vh // group, vd],
                                    T.cast(0, dtype),
                                )
                        for j, d in T.grid(BN, D):
                            with T.sblock("load_v"):
                                vj, vd = T.axis.remap("SS", [j, d])
                                Vt[vj, vd] = T.if_then_else(
                                    vkb * BN + vj < seqlen_k,
                                    V[vb, vkb * BN + vj, vh // group, vd],
                                    T.cast(0, dtype),
                                )
                        for i, j, d in T.grid(BM, BN, D):
                            with T.sblock("qk"):
                                vi, vj, vd = T.axis.remap("SSR", [i, j, d])
                                with T.init():
                                    S[vi, vj] = T.float32(0)
                                S[vi, vj] = S[vi, vj] + T.cast(Qt[vi, vd], f32) * T.cast(Kt[vj, vd], f32)
                        for i, j in T.grid(BM, BN):
                            with T.sblock("score"):  # invisible keys -inf
                                vi, vj = T.axis.remap("SS", [i, j])
                                # The test is the same for the whole tile: lowering hoists it out
                                # of the element loops (HoistIfThenElse; causal, it reads the Q block,
                                # see lowering.passes.HoistBlockIndexConditions), so only the tiles
                                # on the causal diagonal or the end of the keys pay for the mask.
                                if tile_visible(vqb, vkb, seqlen_q, seqlen_k):
                                    Sm[vi, vj] = S[vi, vj]
                                else:
                                    Sm[vi, vj] = T.if_then_else(
                                        visible(vqb * BM + vi, vkb * BN + vj, seqlen_q, seqlen_k),
                                        S[vi, vj],
                                        T.float32(-math.inf),
                                    )
                        # The row reductions start from constants; per-row blocks fold the tile's
                        # max and sum into the running ones, as FA2 does. (A reduction init that
                        # read m or l could not be tensorized on its own, and a block can't read
                        # what it writes: hence m_new and l_new.)
                        for i, j in T.grid(BM, BN):
                            with T.sblock("row_max"):
                                vi, vj = T.axis.remap("SR", [i, j])
                                with T.init():
                                    m_tile[vi] = T.float32(NO_MAX)
                                m_tile[vi] = T.max(m_tile[vi], Sm[vi, vj])
                        for i in range(BM):
                            with T.sblock("alpha"):
                                vi = T.axis.spatial(BM, i)
                                # The max moves only past RESCALE_THRESHOLD (so m_new >= m, alpha <= 1);
                                # from NO_MAX it moves to any tile's max that is not NO_MAX itself.
                                new_max = T.meta_var(T.if_then_else(
                                    (m_tile[vi] - m[vi]) * scale2[0] > T.float32(RESCALE_THRESHOLD), m_tile[vi], m[vi]))
                                m_new[vi] = new_max
                                alpha[vi] = T.exp2((m[vi] - new_max) * scale2[0])  # rescales l and acc
                        for i, j in T.grid(BM, BN):
                            with T.sblock("exp"):  # exp2(-inf - finite max) = 0: masked keys add nothing
                                vi, vj = T.axis.remap("SS", [i, j])
                                P[vi, vj] = T.exp2(Sm[vi, vj] * scale2[0] - m_new[vi] * scale2[0])
                        for i, j in T.grid(BM, BN):
                            with T.sblock("row_sum"):
                                vi, vj = T.axis.remap("SR", [i, j])
                                with T.init():
                                    l_tile[vi] = T.float32(0)
                                l_tile[vi] = l_tile[vi] + P[vi, vj]
                        for i, j in T.grid(BM, BN):
                            with T.sblock("cast_p"):
                                vi, vj = T.axis.remap("SS", [i, j])
                                Pc[vi, vj] = T.cast(P[vi, vj], dtype)
                        for i, d, j in T.grid(BM, D, BN):
                            with T.sblock("pv"):
                                vi, vd, vj = T.axis.remap("SSR", [i, d, j])
                                with T.init():  # rescale the running output to the new max
                                    acc[vi, vd] = acc[vi, vd] * alpha[vi]
                                acc[vi, vd] = acc[vi, vd] + T.cast(Pc[vi, vj], f32) * T.cast(Vt[vj, vd], f32)
                        for i in range(BM):
                            with T.sblock("merge_l"):
                                vi = T.axis.spatial(BM, i)
                                l_new[vi] = l[vi] * alpha[vi] + l_tile[vi]
                        for i in range(BM):
                            with T.sblock("update_ml"):  # (m, l) move on in a block of their own
                                vi = T.axis.spatial(BM, i)
                                m[vi] = m_new[vi]
                                l[vi] = l_new[vi]

                for i in range(BM):
                    with T.sblock("inv_l"):  # one division per row, not per output element
                        vi = T.axis.spatial(BM, i)
                        # A row that sees no key has l == 0: it gets 0, not 0/0.
                        l_inv[vi] = T.if_then_else(l[vi] > T.float32(0), T.float32(1) / l[vi], T.float32(0))
                for i, d in T.grid(BM, D):
                    with T.sblock("store_o"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        T.where(vqb * BM + i < seqlen_q)
                        O[vb, vqb * BM + vi, vh, vd] = T.cast(acc[vi, vd] * l_inv[vi], dtype)
                for i in range(BM):
                    with T.sblock("store_lse"):
                        vi = T.axis.spatial(BM, i)
                        T.where(vqb * BM + i < seqlen_q)
                        LSE[vb, vh, vqb * BM + vi] = T.if_then_else(
                            l[vi] > T.float32(0),
                            m[vi] * softmax_scale + T.log(l[vi]),
                            T.float32(-math.inf),
                        )

    return main

