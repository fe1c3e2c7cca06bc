"""The FlashAttention-2 forward pass as one TensorIR program (``attention_forward``), in the layout of
``tvmflash.program``. With ALiBi the slopes are one more argument, and with dropout two more after them:
    alibi_slopes: (batch, heads_q)                    float32, any batch stride (0: one row for all)
    dropout_p:    float32, 0 <= p < 1; dropout_seed: (2,) int64, Philox's seed and offset (``program_dropout``)
and with sinks one more after those (``sinks_argument``; a flex kernel's captured tensors come last):
    sinks:        (heads_q,)                          float32, the sink logit of each query head

With FP8 (``spec.fp8``, FlashAttention-3's e4m3 forward) q and k are e4m3, V is e4m3 and transposed, out is
bf16, and three descales come last (``program.fp8_arguments``):
    v:            (batch, heads_kv, head_dim, keys)   e4m3, keys contiguous; keys >= the visited K/V tiles'
                                                      rows, zero from seqlen_k on (its tiles are read unmasked;
                                                      varlen: ``program.fp8_v_shape``)
    q_descale, k_descale, v_descale: (batch, heads_kv) float32 (varlen: batch the sequences)
The scores are q·k · q_descale · k_descale · softmax_scale (the LSE too), P is cast to e4m3 for P V, and
the output is multiplied by v_descale.

With ``varlen`` (flash-attn's packed sequences) the arguments hold the rows of every sequence as one
batch, and three more arguments, after softmax_scale, say where each sequence is:
    q, out: (1, total_q, heads_q, head_dim); k, v: (1, total_k, heads_kv, head_dim); lse: (1, heads_q, total_q)
    cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32: sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1
    max_seqlen_q: int32, at least every sequence's query count (the grid's Q blocks cover that many rows)
The grid is (batch, heads_q, ceildiv(max_seqlen_q, block_m)); each tile reads its sequence's offsets
and lengths from cu_seqlens, and the Q blocks past its sequence's end visit only ``min_kv_tiles``
tiles and store nothing. Masks, windows and ALiBi distances are those of each sequence alone.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

from tvmflash import tvmscript
from tvmflash.program import (LOG2E, NO_MAX, AttentionSpec, alibi_slope, alibi_slopes_argument,
                              aligned_strides, block_visible, first_kv_block, flex_mask, fp8_arguments, fp8_v_first,
                              fp8_v_shape, has_mask_mod, initial_max, initial_sum, key_visible, kv_blocks_end, longest,
                              output_dtype, rescale_threshold, runs_if, score_scale, sequence_count,
                              sequences, sink_buffer, sink_units, sinks_argument, strided_argument, transformed_score,
                              varlen_arguments)
from tvmflash.program_dropout import dropout_arguments, dropout_scaled, dropout_tile, dropped
from tvmflash.program_e4m3 import e4m3_bits_to_float32, float32_to_e4m3_value
from tvmflash.program_block_sparse import block_walk, sparse_visible
from tvmflash.program_flex import flex_arguments, flex_tile


def attention_forward(spec: AttentionSpec, block_m: int, block_n: int, min_kv_tiles: int = 1,
                      stride_alignment: int = 1, e4m3_bits: bool = False):
    """Return the forward PrimFunc ``main(q, k, v, out, lse, softmax_scale)`` (and ``alibi_slopes``
    last, with ALiBi).

    Each (batch, head, Q block of ``block_m`` rows) is one tile; it streams K/V tiles of
    ``block_n`` rows past its Q block with an online softmax in base 2 (the running max is taken on
    the unscaled scores, and the scale times log2 e is applied inside exp2: softmax_scale must be
    positive, see ``MAX_SOFTMAX_SCALE``). Rows and keys past the end of the sequence are padded with zeros on load and masked
    with -inf in the score, so no length needs to be a multiple of a tile. With ``causal``, the
    mask is aligned bottom-right (key j is seen by query i iff j <= i + seqlen_k - seqlen_q) and
    tiles wholly above the diagonal are not visited; a window's edges bound the tiles a Q block
    visits on both sides alike (``first_kv_block``, ``kv_blocks_end``). Only the tiles that straddle
    the diagonal, a window's edge or the end of the keys are masked (``tile_visible``); the others
    use the scores as they are. A softcap or ALiBi transforms each score in the ``score`` block
    (``transformed_score``), which then holds the scaled logit (and the running max with it). Each
    Q block visits at least ``min_kv_tiles`` K/V tiles (``kv_tiles``). The strides of q, k, v and
    out are arguments, which the caller must make multiples of ``stride_alignment`` bytes. With
    ``spec.varlen``, ``cu_seqlens_q``, ``cu_seqlens_k`` and ``max_seqlen_q`` follow softmax_scale
    (the module docstring says how the sequences are packed). With ``spec.dropout``, ``dropout_p`` and
    ``dropout_seed`` come last (``program_dropout.dropout_arguments``): P is dropped after its row sum, so the LSE is
    that of the whole softmax, as flash-attn's. e4m3_bits (FP8 only): convert by the bits, exactly, for a target
    without an FP8 conversion of its own (``target.converts_fp8``), where TVM's legalized one is wrong at zero
    and the subnormals: the Q, K and V tiles hold the e4m3 bytes as uint8, read by
    ``program_e4m3.e4m3_bits_to_float32``, and P is rounded by ``float32_to_e4m3_value`` into a float32 tile.
    """
    D, BM, BN = spec.head_dim, block_m, block_n
    HQ, HKV = spec.heads_q, spec.heads_kv
    group = HQ // HKV
    dtype = spec.dtype
    out_dtype = output_dtype(spec)  # dtype, or bf16 for FP8
    fp8 = spec.fp8
    f32 = "float32"
    bits = fp8 and e4m3_bits
    tile_dtype = "uint8" if bits else dtype  # the Q, K and V tiles' elements
    p_dtype = f32 if bits else dtype  # P for P V: e4m3's value, in float32 with e4m3_bits

    def tile_element(x):
        """An element of q, k or v as its tile holds it."""
        return T.reinterpret("uint8", x) if bits else x

    def tile_zero():
        return T.uint8(0) if bits else T.cast(0, dtype)

    def operand(x):
        """An element of a Q, K or V tile in float32."""
        return e4m3_bits_to_float32(x) if bits else T.cast(x, f32)

    def quantised_p(x):
        return float32_to_e4m3_value(x) if bits else T.cast(x, dtype)

    def first_kv_tile(qb, seqlen_q, seqlen_k):
        """The first K/V tile Q block qb visits (0 without a left window)."""
        return first_kv_block(spec, qb, BM, BN, seqlen_q, seqlen_k)

    def kv_tiles(qb, seqlen_q, seqlen_k, walk=None):
        """K/V tiles that Q block qb must visit from ``first_kv_tile`` on (``kv_blocks_end``), and
        at least one: a block that sees no key (seqlen_k 0, or causal with seqlen_q > seqlen_k)
        visits one all-masked tile, which leaves its rows 0 with an LSE of -inf as they must be.
        At least ``min_kv_tiles``, too: a software pipeline of s stages over the tiles runs its
        epilogue (s - 1 tiles) unguarded only where the count is provably s - 1 or more (a guard on
        each of its statements cost ptxas 100 registers and spills on sm90); the tiles past the
        keys (or past the diagonal, or past a window) are all masked and change nothing."""
        if walk is not None:  # a BlockMask's list (``program_block_sparse.BlockWalk``)
            return T.max(min_kv_tiles, walk.count)
        end = kv_blocks_end(spec, qb, BM, BN, seqlen_q, seqlen_k)
        if spec.varlen:  # the grid's Q blocks past the sequence's end (max_seqlen_q sizes it) see no key
            end = T.if_then_else(qb * BM < seqlen_q, end, 0)
        if spec.window_left < 0:
            return T.max(min_kv_tiles, end)
        return T.max(min_kv_tiles, end - first_kv_tile(qb, seqlen_q, seqlen_k))

    def visible(row, col, seqlen_q, seqlen_k, flex=None, walk=None, t=None):
        """Is key ``col`` visible to query ``row``? (Both are absolute positions; ``flex``: the tile's
        ``program_flex.FlexTile``, whose mask_mod joins the test; ``walk``: a BlockMask's, whose full
        blocks skip it, at step t.)"""
        seen = key_visible(spec, row, col, seqlen_q, seqlen_k)
        return sparse_visible(walk, t, seen, flex_mask(spec, flex, row, col))

    def tile_visible(qb, kb, seqlen_q, seqlen_k, walk=None, t=None):
        """Does every query of Q block qb (padding rows too) see every key of K/V tile kb? Such
        interior tiles skip the mask. (With a mask_mod no tile is known to: each is masked; with a
        BlockMask, a full block's tiles before the end of the keys.)"""
        if walk is not None:
            return T.And(walk.full(t), block_visible(spec, qb * BM, qb * BM + BM - 1, kb * BN, kb * BN + BN - 1,
                                                     seqlen_q, seqlen_k))
        if has_mask_mod(spec):
            return False
        return block_visible(spec, qb * BM, qb * BM + BM - 1, kb * BN, kb * BN + BN - 1, seqlen_q, seqlen_k)

    def output_factor(v_scale):
        """What the normalised output is multiplied by: 1, or V's descale (FP8)."""
        return v_scale[0] if fp8 else T.float32(1)

    def qk_scale(descales, b, h, softmax_scale):
        """The running max's units: ``score_scale``, or with FP8 softmax_scale times the descales of q
        and k (of batch b, query head h)."""
        if not fp8:
            return score_scale(spec, softmax_scale)
        return softmax_scale * descales[0][b, h // group] * descales[1][b, h // group]

    def v_column(packed, b, key):
        """The column of FP8's transposed V that holds key ``key`` of sequence b (varlen: ``fp8_v_first``)."""
        if packed is None:
            return key
        return fp8_v_first(packed.cu_k[b], b) + key

    @tvmscript.prim_func(s_tir=True)
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
        # q, k, v and out with any strides (``strided_argument``), read through aligned views
        Q_in = T.meta_var(strided_argument(q_handle, (batch, seqlen_q, HQ, D), dtype, "q"))
        K_in = T.meta_var(strided_argument(k_handle, (batch, seqlen_k, HKV, D), dtype, "k"))
        v_shape = T.meta_var(fp8_v_shape(spec, batch, seqlen_k, HKV, D))  # FP8: transposed
        V_in = T.meta_var(strided_argument(v_handle, v_shape, dtype, "v"))
        O_in = T.meta_var(strided_argument(out_handle, (batch, seqlen_q, HQ, D), out_dtype, "o"))
        LSE = T.match_buffer(lse_handle, (batch, HQ, seqlen_q), f32)
        Packed_ = T.meta_var(varlen_arguments(spec))  # parameters with varlen only
        AlibiSlopes = T.meta_var(alibi_slopes_argument(spec, sequence_count(Packed_, batch), HQ))  # with ALiBi only
        Dropout_ = T.meta_var(dropout_arguments(spec))  # parameters with dropout only
        Sinks_ = T.meta_var(sinks_argument(spec, HQ))  # with sinks only
        Flex_ = T.meta_var(flex_arguments(spec))  # a score_mod's and mask_mod's captured tensors, with flex only
        Descales_ = T.meta_var(fp8_arguments(spec, sequence_count(Packed_, batch), HKV))  # with FP8 only
        Q = T.decl_buffer((batch, seqlen_q, HQ, D), dtype, data=Q_in.data, strides=aligned_strides(Q_in, stride_alignment))
        K = T.decl_buffer((batch, seqlen_k, HKV, D), dtype, data=K_in.data, strides=aligned_strides(K_in, stride_alignment))
        V = T.decl_buffer(v_shape, dtype, data=V_in.data, strides=aligned_strides(V_in, stride_alignment))
        O = T.decl_buffer((batch, seqlen_q, HQ, D), out_dtype, data=O_in.data,
                          strides=aligned_strides(O_in, stride_alignment))

        for b, h, qb in T.grid(sequence_count(Packed_, batch), HQ, T.ceildiv(longest(Packed_, seqlen_q), BM)):
            with T.sblock("tile"):
                vb, vh, vqb = T.axis.remap("SSS", [b, h, qb])
                T.sblock_attr(runs_if(Packed_, vb, vqb * BM))
                seq = T.meta_var(sequences(Packed_, vb, seqlen_q, seqlen_k))  # the tile's sequence
                drop = T.meta_var(dropout_tile(Dropout_, vb, vh, HQ))  # None without dropout
                flex = T.meta_var(flex_tile(spec, Flex_, vb, vh, seq.seqlen_q, seq.seqlen_k))  # None without flex
                # a BlockMask's list of the K/V tiles this Q block visits, None without one
                walk = T.meta_var(block_walk(spec, flex, vb, vh, vqb * BM, BM, BN, False, T.ceildiv(seq.seqlen_k, BN)))
                Qt = T.sblock_alloc_buffer((BM, D), tile_dtype)  # the Q block, zero-padded
                S = T.sblock_alloc_buffer((BM, BN), f32)  # Q Kᵀ of one tile, unscaled
                Sm = T.sblock_alloc_buffer((BM, BN), f32)  # S masked (invisible keys -inf)
                P = T.sblock_alloc_buffer((BM, BN), f32)  # exp2((S - running max) * scale2)
                Pc = T.sblock_alloc_buffer((BM, BN), p_dtype)  # P in the input dtype, for P V
                # running max of the unscaled scores: with scale2 > 0 the max commutes with the
                # scaling, which then fuses into exp2's argument (one FMA per score)
                m = T.sblock_alloc_buffer((BM,), f32)
                m_tile = T.sblock_alloc_buffer((BM,), f32)  # max of one tile's masked scores
                m_new = T.sblock_alloc_buffer((BM,), f32)  # m, or m_tile past rescale_threshold
                alpha = T.sblock_alloc_buffer((BM,), f32)  # exp2(m - m_new): rescale factor
                l = T.sblock_alloc_buffer((BM,), f32)  # running sum of P
                l_tile = T.sblock_alloc_buffer((BM,), f32)  # sum of one tile's P
                l_new = T.sblock_alloc_buffer((BM,), f32)  # l * alpha + l_tile
                acc = T.sblock_alloc_buffer((BM, D), f32)  # unnormalised output
                l_inv = T.sblock_alloc_buffer((BM,), f32)  # 1 / l, or 0 for a row that sees no key
                scale2 = T.sblock_alloc_buffer((1,), f32)
                sink = T.meta_var(sink_buffer(spec))  # with sinks only

                v_scale = T.meta_var(T.sblock_alloc_buffer((1,), f32) if fp8 else None)  # the output's descale

                with T.sblock("init_scale"):  # (FP8: the scale times the descales of q and k)
                    scale2[0] = qk_scale(Descales_, vb, vh, softmax_scale) * T.float32(LOG2E)
                if fp8:
                    with T.sblock("init_v_scale"):
                        v_scale[0] = Descales_[2][vb, vh // group]
                if spec.sinks:
                    with T.sblock("init_sink"):
                        sink[0] = sink_units(spec, Sinks_, vh, softmax_scale)
                for i, d in T.grid(BM, D):
                    with T.sblock("load_q"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        Qt[vi, vd] = T.if_then_else(
                            vqb * BM + vi < seq.seqlen_q,
                            tile_element(Q[seq.batch, seq.q_row(vqb * BM + vi), vh, vd]),
                            tile_zero(),
                        )
                for i in range(BM):
                    with T.sblock("init_ml"):
                        vi = T.axis.spatial(BM, i)
                        m[vi] = initial_max(spec, sink)  # NO_MAX, or the sink's
                        l[vi] = initial_sum(spec, sink)
                for i, d in T.grid(BM, D):
                    with T.sblock("init_acc"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        acc[vi, vd] = T.float32(0)

                for kb in range(kv_tiles(vqb, seq.seqlen_q, seq.seqlen_k, walk)):
                    with T.sblock("kv_step"):
                        vkb = T.axis.opaque(kv_tiles(vqb, seq.seqlen_q, seq.seqlen_k, walk), kb)
                        tile = T.meta_var(walk.tile(vkb) if walk is not None else vkb if spec.window_left < 0
                                          else first_kv_tile(vqb, seq.seqlen_q, seq.seqlen_k) + vkb)
                        # Per-tile buffers live in the scope of one K/V step (a software pipeline
                        # over kb can then keep several versions of them).
                        Kt = T.sblock_alloc_buffer((BN, D), tile_dtype)  # one K tile, zero-padded
                        Vt = T.sblock_alloc_buffer((BN, D), tile_dtype)  # one V tile, zero-padded
                        for j, d in T.grid(BN, D):
                            with T.sblock("load_k"):
                                vj, vd = T.axis.remap("SS", [j, d])
                                Kt[vj, vd] = T.if_then_else(
                                    tile * BN + vj < seq.seqlen_k,
                                    tile_element(K[seq.batch, seq.k_row(tile * BN + vj), vh // group, vd]),
                                    tile_zero(),
                                )
                        if fp8:  # V transposed and zero past seqlen_k (the caller's): unmasked
                            for j, d in T.grid(BN, D):
                                with T.sblock("load_v"):
                                    vj, vd = T.axis.remap("SS", [j, d])
                                    Vt[vj, vd] = tile_element(V[seq.batch, vh // group, vd,
                                                                  v_column(Packed_, vb, tile * BN + vj)])
                        else:
                            for j, d in T.grid(BN, D):
                                with T.sblock("load_v"):
                                    vj, vd = T.axis.remap("SS", [j, d])
                                    Vt[vj, vd] = T.if_then_else(
                                        tile * BN + vj < seq.seqlen_k,
                                        V[seq.batch, seq.k_row(tile * BN + vj), vh // group, vd],
                                        T.cast(0, dtype),
                                    )
                        for i, j, d in T.grid(BM, BN, D):
                            with T.sblock("qk"):
                                vi, vj, vd = T.axis.remap("SSR", [i, j, d])
                                with T.init():
                                    S[vi, vj] = T.float32(0)
                                S[vi, vj] = S[vi, vj] + operand(Qt[vi, vd]) * operand(Kt[vj, vd])
                        for i, j in T.grid(BM, BN):
                            with T.sblock("score"):  # invisible keys -inf; softcap, ALiBi
                                vi, vj = T.axis.remap("SS", [i, j])
                                # The test is the same for the whole tile: lowering hoists it out
                                # of the element loops (HoistIfThenElse; causal, it reads the Q block,
                                # see lowering.uniformity.HoistBlockIndexConditions), so only the tiles
                                # on the causal diagonal, a window's edges or the end of the keys pay
                                # for the mask.
                                score = T.meta_var(transformed_score(
                                    spec, S[vi, vj], softmax_scale, alibi_slope(AlibiSlopes, vb, vh),
                                    (vqb * BM - tile * BN + seq.seqlen_k - seq.seqlen_q) + (vi - vj),
                                    flex, vqb * BM + vi, tile * BN + vj))
                                if spec.transforms_score:
                                    # One expression, so that the score is computed once: with a branch
                                    # per tile, common-subexpression elimination computes it ahead of
                                    # both (on sm90, 64 more live registers a thread, and spills).
                                    Sm[vi, vj] = score + T.if_then_else(
                                        T.Or(tile_visible(vqb, tile, seq.seqlen_q, seq.seqlen_k, walk, vkb),
                                             visible(vqb * BM + vi, tile * BN + vj, seq.seqlen_q, seq.seqlen_k, flex,
                                                     walk, vkb)),
                                        T.float32(0), T.float32(-math.inf))
                                elif tile_visible(vqb, tile, seq.seqlen_q, seq.seqlen_k, walk, vkb):
                                    Sm[vi, vj] = score
                                else:
                                    Sm[vi, vj] = T.if_then_else(
                                        visible(vqb * BM + vi, tile * BN + vj, seq.seqlen_q, seq.seqlen_k, flex, walk,
                                                vkb),
                                        score,
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
                                # The max moves only past rescale_threshold (so m_new >= m, alpha <= 1);
                                # from NO_MAX it moves to any tile's max that is not NO_MAX itself.
                                threshold = T.meta_var(T.float32(rescale_threshold(spec)))
                                moves = T.meta_var((m_tile[vi] - m[vi]) * scale2[0] > threshold)
                                new_max = T.meta_var(T.if_then_else(moves, m_tile[vi], m[vi]))
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
                            with T.sblock("cast_p"):  # dropout drops P here, after its row sum (l)
                                vi, vj = T.axis.remap("SS", [i, j])
                                Pc[vi, vj] = quantised_p(dropped(drop, P[vi, vj], vqb * BM + vi, tile * BN + vj))
                        for i, d, j in T.grid(BM, D, BN):
                            with T.sblock("pv"):
                                vi, vd, vj = T.axis.remap("SSR", [i, d, j])
                                with T.init():  # rescale the running output to the new max
                                    acc[vi, vd] = acc[vi, vd] * alpha[vi]
                                acc[vi, vd] = acc[vi, vd] + T.cast(Pc[vi, vj], f32) * operand(Vt[vj, vd])
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
                        # A row that sees no key has l == 0: it gets 0, not 0/0. (FP8: times V's descale.)
                        l_inv[vi] = T.if_then_else(l[vi] > T.float32(0), output_factor(v_scale) / l[vi],
                                                   T.float32(0))
                for i, d in T.grid(BM, D):
                    with T.sblock("store_o"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        T.where(vqb * BM + i < seq.seqlen_q)
                        # (dropout's kept entries scaled by 1 / (1 - p) here, as flash-attn's epilogue
                        # does: a per-row block reads no argument, the GPU schedules derive its code)
                        O[seq.batch, seq.q_row(vqb * BM + vi), vh, vd] = T.cast(
                            dropout_scaled(Dropout_, acc[vi, vd] * l_inv[vi]), out_dtype)
                for i in range(BM):
                    with T.sblock("store_lse"):
                        vi = T.axis.spatial(BM, i)
                        T.where(vqb * BM + i < seq.seqlen_q)
                        LSE[seq.batch, vh, seq.q_row(vqb * BM + vi)] = T.if_then_else(
                            l[vi] > T.float32(0),
                            m[vi] * qk_scale(Descales_, vb, vh, softmax_scale) + T.log(l[vi]),
                            T.float32(-math.inf),
                        )

    return main

