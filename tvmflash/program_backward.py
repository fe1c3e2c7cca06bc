"""The FlashAttention-2 backward pass as TensorIR: three programs in one IRModule.

Like ``tvmflash.program`` (the forward), this states *what* is computed; the schedules in
``schedules/`` (``schedule_backward``) transform it by function and block names.

Layout (flash-attn's; the forward's, plus the gradients):
    q, dout, dq:      (batch, seqlen_q, heads_q,  head_dim)   dtype
    k, v, dk, dv:     (batch, seqlen_k, heads_kv, head_dim)   dtype
    out:              (batch, seqlen_q, heads_q,  head_dim)   dtype, the forward's output
    lse, dlse, delta: (batch, heads_q,  seqlen_q)              float32 (lse in natural log)
    lse2:             (batch, heads_q,  seqlen_q)              float32, lse · log2 e
(delta and lse2, which the caller allocates for the programs, with any batch and head strides:
``ROW_VALUE_ALIGNMENT`` keeps a TMA copy of their rows possible.)

With s = scale · q kᵀ, p = softmax(s) (= exp(s - lse)), out = p v and a loss L(out, lse):
    dv = pᵀ · dout
    dp = dout · vᵀ
    ds = p ∘ (dp - delta),   delta = rowsum(dout ∘ out) - dlse
    dq = scale · ds · k,     dk = scale · dsᵀ · q
(dlse enters because ∂lse/∂s = p: it adds dlse · p to ds.) With a softcap or ALiBi the softmax is
that of the logit softcap · tanh(s / softcap) - slope · |i + seqlen_k - seqlen_q - j|
(``program.transformed_score``), and ds (of s) is the logit's times the softcap's derivative
1 - tanh²; the slopes get no gradient. With dropout (``program_dropout``: the forward's kept entries,
recomputed from the same seed, scaled by 1 / (1 - p)) out = (p ∘ keep) v / (1 - p), so dv = (p ∘ keep)ᵀ
dout / (1 - p) and ds = p ∘ (dp ∘ keep / (1 - p) - delta), delta unchanged (rowsum(dout ∘ out) is
still rowsum(p ∘ dp ∘ keep) / (1 - p)); dkdv and dq take dropout_p and dropout_seed last. The programs:

``delta``  delta = rowsum(dout ∘ out) - dlse, one value per query row, and lse2 = lse · log2 e
           (the steps' exp2 takes it; computed once here, the steps copy it).
``dkdv``   one tile per (batch, K/V head, K/V block of ``block_n`` keys): the Q blocks of
           ``block_m`` rows of *every query head of the group* stream past it, so dk and dv of a
           GQA/MQA group are summed in the tile's fp32 accumulators (no atomics). p is recomputed
           from q, k and the saved lse. With ``dkdv_slices`` (``attention_backward``) dk and dv come in
           slices of the head_dim columns, p and ds recomputed for each.
``dq``     one tile per (batch, query head, Q block): the K/V blocks stream past it, recomputing p
           and ds. A pass of its own by default: each dq element is summed by one tile in a fixed
           order, so gradients are bitwise reproducible from run to run (``deterministic=True``
           costs nothing), at the price of computing q kᵀ and dout vᵀ twice. With ``dq_atomic``
           (``attention_backward``), FA2's way, dkdv adds each step's ds k into an fp32
           accumulator instead and ``convert_dq`` rounds it: five products instead of seven, but an
           fp32 addition to memory per element per step, in an order that changes from run to run.

As in the forward: batch and the sequence lengths are symbolic; rows and keys past the ends are
padded with zeros on load; causal masks are aligned bottom-right and tiles wholly above the
diagonal are skipped (``dkdv`` starts at the first Q block that sees its first key, ``dq`` stops
at the last K/V block its last row sees), and a window's edges skip tiles on both sides alike
(``dkdv`` also stops at the last Q block that sees its last key, ``dq`` starts at the first K/V
block its first row sees); only tiles on the diagonal, a window's edges or at the end of the keys
are masked. dk, dv and dq are reductions whose init carries the accumulator over from the last
step (a reduction block needs an init to be vectorised, decomposed or tensorized). The products
that feed a matmul (p for dv, ds for dq and dk) are rounded to the input dtype, as the forward
rounds p for p v (so that tensor cores can take them); everything else is fp32. A row that sees no key (lse -inf) gets p = 0 from the mask, hence zero gradients,
never NaN (``load_q``).
"""

from __future__ import annotations

import math

import tvm
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from tvmflash import (program, program_backward_tiles, program_block_sparse, program_dropout, program_flex,
                      program_flex_gradient, tvmscript)
from tvmflash.program import LOG2E, AttentionSpec

def lse2_of(spec: AttentionSpec, lse):
    """lse · log2 e, what the steps subtract from the scores in exp2. With flex, a row that sees no key
    (lse -inf) gets +inf instead: a score_mod may leave such a row's scores finite or -inf where no mask
    hides them, and exp2(score - inf) is then 0, where exp2(score + inf) or exp2(-inf + inf) would not be."""
    if spec.flex is None:
        return lse * T.float32(LOG2E)
    return T.if_then_else(tvm.tirx.EQ(lse, T.float32(-math.inf)), T.float32(math.inf), lse * T.float32(LOG2E))


def programs(dq_atomic: bool = False) -> tuple:
    """The programs of the IRModule, in the order they run (dkdv and dq both read delta; convert_dq
    reads what dkdv summed)."""
    return ("delta", "dkdv", "convert_dq") if dq_atomic else ("delta", "dkdv", "dq")


def dq_accumulator_rows(seqlen_q: int, block_m: int, sparse: bool = False) -> int:
    """The rows of dq_accum for ``seqlen_q`` query rows (varlen: every sequence's, packed): enough
    for the last Q block's rows past the end, whose share is 0 (q = dout = delta = 0 there), and with
    block sparsity (``sparse``) for the Q block after it, which the steps past a list visit
    (``program_block_sparse.BlockWalk``)."""
    return seqlen_q + (2 if sparse else 1) * block_m


def attention_backward(spec: AttentionSpec, block_m: int, block_n: int, dq_block_m: int | None = None,
                       dq_block_n: int | None = None, dq_atomic: bool = False, stride_alignment: int = 1,
                       dkdv_slices: int = 1, dkdv_slicing: str = "rows") -> tvm.IRModule:
    """The backward programs for a spec: dkdv in tiles of ``block_m`` query rows by ``block_n`` keys,
    dq in tiles of ``dq_block_m`` by ``dq_block_n`` (by default dkdv's).

    ``delta(out, dout, lse, dlse, delta, lse2)``,
    ``dkdv(q, k, v, dout, lse2, delta, dk, dv, softmax_scale)``,
    ``dq(q, k, v, dout, lse2, delta, dq, softmax_scale)``: shapes in the module docstring. Run them
    in ``programs()``' order. q, k and v are taken with any batch, sequence and head strides, as the
    forward takes them (``program.strided_argument``), which the caller must make multiples of
    ``stride_alignment`` bytes; the other tensors compact.

    ``dq_atomic``: no dq program; dkdv also adds each step's ds k into ``dq_accum`` (float32
    (batch, ``dq_accumulator_rows``, heads_q, head_dim), zeroed by the caller), after softmax_scale:
    ``dkdv(q, k, v, dout, lse2, delta, dk, dv, softmax_scale, dq_accum)``, and
    ``convert_dq(dq_accum, dq, softmax_scale)`` scales and rounds it into dq. Every K/V tile adds into
    the same rows, so a schedule that runs tiles at once makes the addition atomic, and the sum's
    order (its rounding) changes from run to run.

    ``dkdv_slices``: dk and dv (and with ``dq_atomic`` dq's share) made in this many equal slices of the
    head_dim columns, p and ds recomputed from the whole head_dim for each, so that the steps' two
    products q kᵀ and dout vᵀ are made once a slice (at 2 slices 7 products of head_dim columns for 5),
    and what holds a slice's gradients holds 1 / dkdv_slices of them (sm90 at d256, where dk and dv of
    a warpgroup's 64 keys alone take 256 registers a thread). ``dkdv_slicing`` "rows": the tile's rows
    are the K/V block's keys once a slice (row r: key r % block_n of slice r // block_n; sᵀ, pᵀ, dpᵀ
    and dsᵀ of block_n · dkdv_slices rows), so that a schedule that gives rows to threads gives each its
    slice while the slices share the tile's q, dout, K and V; "grid": a tile a slice, the slices of a
    K/V block side by side in the grid (K/V block kb, slice c: tile kb · dkdv_slices + c).
    """
    if spec.head_dim % dkdv_slices or dkdv_slicing not in DKDV_SLICINGS:
        raise ValueError(f"dkdv_slices, dkdv_slicing: {dkdv_slices} slices of head_dim {spec.head_dim} "
                         f"{dkdv_slicing!r}; expected a divisor and one of {DKDV_SLICINGS}")
    module = _programs(spec, block_m, block_n, dq_atomic, stride_alignment, dkdv_slices, dkdv_slicing)
    if dq_atomic:
        return module
    dq_tile = (dq_block_m or block_m, dq_block_n or block_n)
    if dq_tile != (block_m, block_n):
        module["dq"] = _programs(spec, *dq_tile, stride_alignment=stride_alignment)["dq"]
    return module


DKDV_SLICINGS = ("rows", "grid")  # where dkdv's slices of the gradients' columns go (``attention_backward``)

# delta's and lse2's head stride, in elements, is a multiple of this (``padded_rows``): 16 bytes, so
# that TMA may copy their rows (its strides are multiples of 16 bytes)
ROW_VALUE_ALIGNMENT = 4


def padded_rows(seqlen_q: int) -> int:
    """The head stride of delta and lse2 for ``seqlen_q`` rows: the caller allocates (batch,
    heads_q, padded_rows(seqlen_q)) and passes the first ``seqlen_q`` of each head's rows."""
    return -(-seqlen_q // ROW_VALUE_ALIGNMENT) * ROW_VALUE_ALIGNMENT


def _row_values_argument(handle, shape, name: str):
    """A (batch, heads_q, seqlen_q) float32 parameter (Delta, LSE2) named ``name``, with any batch and
    head strides (int32 arguments ``{name.lower()}_stride_b``, ``_h``)."""
    strides = (T.int32(), T.int32())
    for axis, stride in zip("bh", strides):
        IRBuilder.name(f"{name.lower()}_stride_{axis}", stride)
    buffer = T.match_buffer(handle, shape, "float32", strides=(*strides, 1))
    IRBuilder.name(name, buffer)
    return buffer


def _dq_accumulator_argument(dq_atomic: bool, batch, heads: int, head_dim: int):
    """With ``dq_atomic``, one more parameter of the dkdv being parsed: dq_accum, float32 (batch,
    rows, heads, head_dim); None without."""
    if not dq_atomic:
        return None
    handle = T.arg("dq_accum_handle", T.handle())
    rows = T.int32()
    IRBuilder.name("dq_accum_rows", rows)
    accum = T.match_buffer(handle, (batch, rows, heads, head_dim), "float32")
    IRBuilder.name("DQaccum", accum)
    return accum


def _programs(spec: AttentionSpec, block_m: int, block_n: int, dq_atomic: bool = False,
              stride_alignment: int = 1, dkdv_slices: int = 1, dkdv_slicing: str = "rows") -> tvm.IRModule:
    """The three programs, all in tiles of ``block_m`` query rows by ``block_n`` keys (``dq_atomic``:
    delta, dkdv with dq's share, convert_dq; ``dkdv_slices``: ``attention_backward``'s)."""
    D, BM, BN = spec.head_dim, block_m, block_n
    SLICES, DC = dkdv_slices, spec.head_dim // dkdv_slices  # dkdv's slices of the gradients' columns
    GRID_SLICES = SLICES if dkdv_slicing == "grid" else 1  # dkdv tiles a K/V block
    ROW_SLICES = SLICES if dkdv_slicing == "rows" else 1  # each key's rows in a dkdv tile
    KEY_ROWS = BN * ROW_SLICES  # the rows of dkdv's tiles (sᵀ, ..., dk, dv)
    DQ_COLUMNS = D // GRID_SLICES  # the columns of a dkdv tile's share of dq
    HQ, HKV = spec.heads_q, spec.heads_kv
    group = HQ // HKV
    dtype = spec.dtype
    left = spec.window_left
    f32 = "float32"

    (visible, tile_visible, first_q_block, q_blocks, first_kv_block, kv_blocks, block_walk,
     block_walks) = program_backward_tiles.tile_ranges(spec, BM, BN)

    padding_lse2 = T.float32(math.inf) if spec.flex is not None else T.float32(0)

    def key_of(r):
        """The key (in its K/V block) of row r of a dkdv tile (with one slice of rows, r: so that the
        program is the one without slices)."""
        return r if ROW_SLICES == 1 else r % BN

    def column_of(tile):
        """dkdv's map from (row, column) of its gradients' tiles to the head_dim column: their slice's,
        the row's (``ROW_SLICES``) or the tile's (``GRID_SLICES``); the identity with one slice."""
        if SLICES == 1:
            return lambda r, d: d
        if ROW_SLICES > 1:
            return lambda r, d: r // BN * DC + d
        return lambda r, d: tile % SLICES * DC + d

    def dq_column_of(tile):
        """dkdv's map from a column of its dq share to the head_dim column."""
        return (lambda d: d) if GRID_SLICES == 1 else (lambda d: tile % SLICES * DC + d)

    def ds_row(d, j):
        """The row of dsᵀ that dq's share of head_dim column d reads for key j: its slice's (every slice's
        row of a key holds the same ds; reading its own lets the threads of a slice make its columns)."""
        return j if ROW_SLICES == 1 else d // DC * BN + j

    def padded(buffer, row, limit, *index):
        """buffer[index] for a row before ``limit``, else 0 in the input dtype."""
        return T.if_then_else(row < limit, buffer[index], T.cast(0, dtype))

    @tvmscript.prim_func(s_tir=True)
    def delta(out_handle: T.handle, dout_handle: T.handle, lse_handle: T.handle, dlse_handle: T.handle,
              delta_handle: T.handle, lse2_handle: T.handle):
        T.func_attr({"global_symbol": "delta", "tirx.noalias": True})
        batch = T.int32()
        seqlen_q = T.int32()
        O = T.match_buffer(out_handle, (batch, seqlen_q, HQ, D), dtype)
        dO = T.match_buffer(dout_handle, (batch, seqlen_q, HQ, D), dtype)
        LSE = T.match_buffer(lse_handle, (batch, HQ, seqlen_q), f32)
        dLSE = T.match_buffer(dlse_handle, (batch, HQ, seqlen_q), f32)
        Delta = T.meta_var(_row_values_argument(delta_handle, (batch, HQ, seqlen_q), "Delta"))
        LSE2 = T.meta_var(_row_values_argument(lse2_handle, (batch, HQ, seqlen_q), "LSE2"))
        rowsum = T.sblock_alloc_buffer((batch, seqlen_q, HQ), f32)  # a schedule keeps each row's where it is used
        for b, i, h, d in T.grid(batch, seqlen_q, HQ, D):
            with T.sblock("delta"):  # from 0, the sum's identity: a schedule may sum across threads
                vb, vi, vh, vd = T.axis.remap("SSSR", [b, i, h, d])
                with T.init():
                    rowsum[vb, vi, vh] = T.float32(0)
                rowsum[vb, vi, vh] = rowsum[vb, vi, vh] + T.cast(dO[vb, vi, vh, vd], f32) * T.cast(O[vb, vi, vh, vd], f32)
        for b, i, h in T.grid(batch, seqlen_q, HQ):
            with T.sblock("finish_rows"):  # and lse · log2 e, which the dkdv and dq steps copy as it is
                vb, vi, vh = T.axis.remap("SSS", [b, i, h])
                Delta[vb, vh, vi] = rowsum[vb, vi, vh] - dLSE[vb, vh, vi]
                LSE2[vb, vh, vi] = lse2_of(spec, LSE[vb, vh, vi])

    def steps(keys_first: bool):
        """The steps both programs take, written once: (load_kv, load_q, p_and_ds). Each program
        takes fresh ones: a macro suffixes the block names of its second and later uses (qk_1),
        and the schedules find the blocks by name.

        The (block_m, block_n) tiles of s, p, dp and ds have the program's own rows first: queries
        in dq, whose products are ds k; keys (``keys_first``: the tiles are sᵀ, pᵀ, ...) in dkdv,
        whose products are pᵀ dout and dsᵀ q. Each product's left operand then has its output's
        rows, so a schedule can keep it where the tile was made (tensor cores: in the registers of
        the warp that owns the rows)."""
        ROWS, COLS = (KEY_ROWS, BM) if keys_first else (BM, BN)

        def query_key(r, c):
            """(query, key) of tile element (r, c)."""
            return (c, key_of(r)) if keys_first else (r, c)

        def operand_row(r):
            """The row of the left operands (K, V or q, dout) that tile row r multiplies."""
            return key_of(r) if keys_first else r

        @T.macro
        def load_kv(Kt, Vt, K, V, seq, hk, kb):
            """The K and V blocks kb of K/V head hk of sequence ``seq`` (``program.Sequences``),
            zero-padded."""
            for j, d in T.grid(BN, D):
                with T.sblock("load_k"):
                    vj, vd = T.axis.remap("SS", [j, d])
                    Kt[vj, vd] = padded(K, kb * BN + vj, seq.seqlen_k, seq.batch, seq.k_row(kb * BN + vj), hk, vd)
            for j, d in T.grid(BN, D):
                with T.sblock("load_v"):
                    vj, vd = T.axis.remap("SS", [j, d])
                    Vt[vj, vd] = padded(V, kb * BN + vj, seq.seqlen_k, seq.batch, seq.k_row(kb * BN + vj), hk, vd)

        @T.macro
        def load_q(Qt, dOt, lse2, delta_t, Q, dO, LSE2, Delta, seq, h, qb):
            """The q and dout blocks qb of query head h of sequence ``seq`` and their rows' lse ·
            log2 e and delta, all zero-padded: copies, which a schedule can make asynchronous. A row that sees no key
            (lse -inf) is only ever in masked tiles (rows see more keys as they go down, so a block
            whose first row sees a tile's last key has no such row), where the mask gives its p 0;
            a row past the end has q = dout = delta = 0 and adds nothing whatever its p (with flex its
            lse2 is +inf, so that its p is 0: a score_mod may make its scores large, and inf · 0 is NaN)."""
            for i, d in T.grid(BM, D):
                with T.sblock("load_q"):
                    vi, vd = T.axis.remap("SS", [i, d])
                    Qt[vi, vd] = padded(Q, qb * BM + vi, seq.seqlen_q, seq.batch, seq.q_row(qb * BM + vi), h, vd)
            for i, d in T.grid(BM, D):
                with T.sblock("load_do"):
                    vi, vd = T.axis.remap("SS", [i, d])
                    dOt[vi, vd] = padded(dO, qb * BM + vi, seq.seqlen_q, seq.batch, seq.q_row(qb * BM + vi), h, vd)
            for i in range(BM):
                with T.sblock("load_lse"):
                    vi = T.axis.spatial(BM, i)
                    lse2[vi] = T.if_then_else(qb * BM + vi < seq.seqlen_q, LSE2[seq.batch, h, seq.q_row(qb * BM + vi)],
                                              padding_lse2)
            for i in range(BM):
                with T.sblock("load_delta"):
                    vi = T.axis.spatial(BM, i)
                    delta_t[vi] = T.if_then_else(qb * BM + vi < seq.seqlen_q, Delta[seq.batch, h, seq.q_row(qb * BM + vi)], T.float32(0))

        @T.macro
        def p_and_ds(Qt, Kt, dOt, Vt, lse2, delta_t, scale2, S, P, dP, dSc, qb, kb, seqlen_q, seqlen_k, softmax_scale,
                     slope, drop, flex, walk, step):
            """p of Q block qb and K/V block kb, recomputed from the scores and lse (0 where masked; the
            score transformed as the forward's, ``program.transformed_score``, ALiBi's with
            ``slope``, a score_mod's with ``flex``, the tile's ``program_flex.FlexTile``, None without), and
            ds = p (dp - delta) (times the softcap's or the score_mod's derivative) rounded to the input
            dtype. Each tile's (r, c) element is that of query and key ``query_key(r, c)``; its
            products are rows times columns: q kᵀ and dout vᵀ, or k qᵀ and v doutᵀ. With dropout
            (``drop``, ``program_dropout.TileDropout``) dp is that of the kept entries, scaled: out's
            gradient reaches p only through them. ``walk``: a BlockMask's list being walked (None without),
            at ``step``: its full blocks skip mask_mod."""
            qk_rows, qk_cols = T.meta_var((Kt, Qt) if keys_first else (Qt, Kt))
            dp_rows, dp_cols = T.meta_var((Vt, dOt) if keys_first else (dOt, Vt))
            for r, c, d in T.grid(ROWS, COLS, D):
                with T.sblock("qk"):  # s = q kᵀ, unscaled
                    vr, vc, vd = T.axis.remap("SSR", [r, c, d])
                    with T.init():
                        S[vr, vc] = T.float32(0)
                    S[vr, vc] = S[vr, vc] + T.cast(qk_rows[operand_row(vr), vd], f32) * T.cast(qk_cols[vc, vd], f32)
            for r, c, d in T.grid(ROWS, COLS, D):
                with T.sblock("dp"):  # dp = dout vᵀ, right after s: a schedule can issue both before p
                    vr, vc, vd = T.axis.remap("SSR", [r, c, d])
                    with T.init():
                        dP[vr, vc] = T.float32(0)
                    dP[vr, vc] = dP[vr, vc] + T.cast(dp_rows[operand_row(vr), vd], f32) * T.cast(dp_cols[vc, vd], f32)
            for r, c in T.grid(ROWS, COLS):
                with T.sblock("exp"):
                    vr, vc = T.axis.remap("SS", [r, c])
                    i, j = T.meta_var(query_key(vr, vc))
                    score = T.meta_var(program.transformed_score(
                        spec, S[vr, vc], softmax_scale, slope, qb * BM + i + seqlen_k - seqlen_q - (kb * BN + j),
                        flex, qb * BM + i, kb * BN + j))
                    if tile_visible(qb, kb, seqlen_q, seqlen_k, walk, step):
                        P[vr, vc] = T.exp2(score * scale2[0] - lse2[i])
                    else:
                        P[vr, vc] = T.if_then_else(
                            visible(qb * BM + i, kb * BN + j, seqlen_q, seqlen_k, flex, walk, step),
                            T.exp2(score * scale2[0] - lse2[i]),
                            T.float32(0),
                        )
            for r, c in T.grid(ROWS, COLS):
                with T.sblock("ds"):  # ds = p (dp - delta)
                    vr, vc = T.axis.remap("SS", [r, c])
                    i, j = T.meta_var(query_key(vr, vc))
                    dp = T.meta_var(program_dropout.dropped(drop, program_dropout.dropout_scaled(drop, dP[vr, vc]), qb * BM + i, kb * BN + j))
                    dSc[vr, vc] = T.cast(
                        program.softcap_gradient(spec, P[vr, vc] * (dp - delta_t[i]), S[vr, vc], softmax_scale,
                                                 flex, qb * BM + i, kb * BN + j),
                        dtype)

        return load_kv, load_q, p_and_ds

    load_kv, load_q, p_and_ds = steps(keys_first=True)

    @tvmscript.prim_func(s_tir=True)
    def dkdv(
        q_handle: T.handle,
        k_handle: T.handle,
        v_handle: T.handle,
        dout_handle: T.handle,
        lse2_handle: T.handle,
        delta_handle: T.handle,
        dk_handle: T.handle,
        dv_handle: T.handle,
        softmax_scale: T.float32,
    ):
        T.func_attr({"global_symbol": "dkdv", "tirx.noalias": True})
        batch = T.int32()
        seqlen_q = T.int32()
        seqlen_k = T.int32()
        Q_in = T.meta_var(program.strided_argument(q_handle, (batch, seqlen_q, HQ, D), dtype, "q"))
        K_in = T.meta_var(program.strided_argument(k_handle, (batch, seqlen_k, HKV, D), dtype, "k"))
        V_in = T.meta_var(program.strided_argument(v_handle, (batch, seqlen_k, HKV, D), dtype, "v"))
        dO = T.match_buffer(dout_handle, (batch, seqlen_q, HQ, D), dtype)
        LSE2 = T.meta_var(_row_values_argument(lse2_handle, (batch, HQ, seqlen_q), "LSE2"))
        Delta = T.meta_var(_row_values_argument(delta_handle, (batch, HQ, seqlen_q), "Delta"))
        dK = T.match_buffer(dk_handle, (batch, seqlen_k, HKV, D), dtype)
        dV = T.match_buffer(dv_handle, (batch, seqlen_k, HKV, D), dtype)
        DQaccum = T.meta_var(_dq_accumulator_argument(dq_atomic, batch, HQ, D))  # with dq_atomic only
        Packed_ = T.meta_var(program.varlen_arguments(spec, "max_seqlen_k"))  # parameters with varlen only
        AlibiSlopes = T.meta_var(program.alibi_slopes_argument(spec, program.sequence_count(Packed_, batch), HQ))  # with ALiBi only
        Dropout_ = T.meta_var(program_dropout.dropout_arguments(spec))  # parameters with dropout only
        Flex_ = T.meta_var(program_flex.flex_arguments(spec))  # a score_mod's and mask_mod's tensors, flex only
        Grads_ = T.meta_var(program_flex_gradient.gradient_arguments(spec, Flex_))  # learned captures' only
        # q, k and v with any strides (``program.strided_argument``: a packed qkv's thirds, as the
        # forward takes them), read through aligned views; dout (and delta's out) compact
        Q = T.decl_buffer(Q_in.shape, dtype, data=Q_in.data, strides=program.aligned_strides(Q_in, stride_alignment))
        K = T.decl_buffer(K_in.shape, dtype, data=K_in.data, strides=program.aligned_strides(K_in, stride_alignment))
        V = T.decl_buffer(V_in.shape, dtype, data=V_in.data, strides=program.aligned_strides(V_in, stride_alignment))

        for b, hk, kbc in T.grid(program.sequence_count(Packed_, batch), HKV,
                                 T.ceildiv(program.longest(Packed_, seqlen_k), BN) * GRID_SLICES):
            with T.sblock("tile"):
                vb, vhk, vkbc = T.axis.remap("SSS", [b, hk, kbc])
                # the K/V block and the slice of the gradients' columns (with one slice, the block alone)
                vkb = T.meta_var(vkbc if GRID_SLICES == 1 else vkbc // GRID_SLICES)
                column = T.meta_var(column_of(vkbc))
                dq_column = T.meta_var(dq_column_of(vkbc))
                T.sblock_attr(program.runs_if(Packed_, vb, vkb * BN, keys=True))
                seq = T.meta_var(program.sequences(Packed_, vb, seqlen_q, seqlen_k))  # the tile's sequence
                Kt = T.sblock_alloc_buffer((BN, D), dtype)  # the K block, zero-padded
                Vt = T.sblock_alloc_buffer((BN, D), dtype)  # the V block, zero-padded
                # dsᵀ q and pᵀ dout, summed over the group's heads: row r, column d is key key_of(r)'s column
                # column(r, d) (its slice's)
                dk_acc = T.sblock_alloc_buffer((KEY_ROWS, DC), f32)  # dsᵀ q, summed over the group's heads
                dv_acc = T.sblock_alloc_buffer((KEY_ROWS, DC), f32)  # pᵀ dout, summed over the group's heads
                scale2 = T.sblock_alloc_buffer((1,), f32)

                with T.sblock("init_scale"):
                    scale2[0] = program.score_scale(spec, softmax_scale) * T.float32(LOG2E)
                load_kv(Kt, Vt, K, V, seq, vhk, vkb)
                for j, d in T.grid(KEY_ROWS, DC):
                    with T.sblock("init_dk"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        dk_acc[vj, vd] = T.float32(0)
                for j, d in T.grid(KEY_ROWS, DC):
                    with T.sblock("init_dv"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        dv_acc[vj, vd] = T.float32(0)

                # A BlockMask's lists of the Q blocks this K/V block's query heads visit, None without one
                walks = T.meta_var(block_walks(Flex_, vb, vhk, vkb, seq.seqlen_q))
                # One step per (query head of the group, Q block).
                for g, t in T.grid(group, q_blocks(vkb, seq.seqlen_q, seq.seqlen_k, walks)):
                    with T.sblock("q_step"):
                        vg = T.axis.opaque(group, g)
                        vt = T.axis.opaque(q_blocks(vkb, seq.seqlen_q, seq.seqlen_k, walks), t)
                        Qt = T.sblock_alloc_buffer((BM, D), dtype)  # the Q block, zero-padded
                        dOt = T.sblock_alloc_buffer((BM, D), dtype)  # the dout block, zero-padded
                        lse2 = T.sblock_alloc_buffer((BM,), f32)  # lse · log2 e
                        delta_t = T.sblock_alloc_buffer((BM,), f32)  # delta, 0 past the end
                        S = T.sblock_alloc_buffer((KEY_ROWS, BM), f32)  # sᵀ = k qᵀ, unscaled
                        P = T.sblock_alloc_buffer((KEY_ROWS, BM), f32)  # pᵀ = exp(s - lse)ᵀ, 0 where masked
                        dP = T.sblock_alloc_buffer((KEY_ROWS, BM), f32)  # dpᵀ = v doutᵀ
                        dSc = T.sblock_alloc_buffer((KEY_ROWS, BM), dtype)  # dsᵀ in the input dtype, for dk
                        Pc = T.sblock_alloc_buffer((KEY_ROWS, BM), dtype)  # pᵀ in the input dtype, for dv
                        if dq_atomic:
                            dq_share = T.sblock_alloc_buffer((BM, DQ_COLUMNS), f32)  # ds k of this K/V block

                        walk = T.meta_var(block_walk(Flex_, vb, vhk * group + vg, vkb, seq.seqlen_q))
                        qb = T.meta_var(walk.tile(vt) if walk is not None
                                        else first_q_block(vkb, seq.seqlen_q, seq.seqlen_k) + vt)
                        drop = T.meta_var(program_dropout.dropout_tile(Dropout_, vb, vhk * group + vg, HQ))  # None without
                        load_q(Qt, dOt, lse2, delta_t, Q, dO, LSE2, Delta, seq, vhk * group + vg, qb)
                        p_and_ds(Qt, Kt, dOt, Vt, lse2, delta_t, scale2, S, P, dP, dSc, qb, vkb, seq.seqlen_q, seq.seqlen_k,
                                 softmax_scale, program.alibi_slope(AlibiSlopes, vb, vhk * group + vg), drop,
                                 program_flex.flex_tile(spec, Flex_, vb, vhk * group + vg, seq.seqlen_q, seq.seqlen_k),
                                 walk, vt)
                        program_flex_gradient.add_capture_gradients(  # learned captures only
                            Grads_, program_flex.flex_tile(spec, Flex_, vb, vhk * group + vg, seq.seqlen_q, seq.seqlen_k),
                            Flex_, P, dP, delta_t, S, softmax_scale, qb * BM, vkb * BN, KEY_ROWS, BM, BN,
                            vkbc % GRID_SLICES == 0)
                        for j, i in T.grid(KEY_ROWS, BM):
                            with T.sblock("cast_p"):  # the kept entries of p (dropout), scaled at dv's store
                                vj, vi = T.axis.remap("SS", [j, i])
                                Pc[vj, vi] = T.cast(program_dropout.dropped(drop, P[vj, vi], qb * BM + vi, vkb * BN + key_of(vj)), dtype)
                        for j, d, i in T.grid(KEY_ROWS, DC, BM):
                            with T.sblock("dv"):  # dv += pᵀ dout
                                vj, vd, vi = T.axis.remap("SSR", [j, d, i])
                                with T.init():  # carried over from the last step
                                    dv_acc[vj, vd] = dv_acc[vj, vd]
                                dv_acc[vj, vd] = dv_acc[vj, vd] + T.cast(Pc[vj, vi], f32) * T.cast(dOt[vi, column(vj, vd)], f32)
                        if dq_atomic:
                            for i, d, j in T.grid(BM, DQ_COLUMNS, BN):
                                with T.sblock("dq"):  # this K/V block's share of dq: ds k, before dk: a schedule
                                    # can issue dv, dq and dk back to back and add dq's share while dk runs
                                    vi, vd, vj = T.axis.remap("SSR", [i, d, j])
                                    with T.init():
                                        dq_share[vi, vd] = T.float32(0)
                                    dq_share[vi, vd] = dq_share[vi, vd] + T.cast(dSc[ds_row(vd, vj), vi], f32) * T.cast(Kt[vj, dq_column(vd)], f32)
                        for j, d, i in T.grid(KEY_ROWS, DC, BM):
                            with T.sblock("dk"):  # dk += dsᵀ q (scaled at the store)
                                vj, vd, vi = T.axis.remap("SSR", [j, d, i])
                                with T.init():  # carried over from the last step
                                    dk_acc[vj, vd] = dk_acc[vj, vd]
                                dk_acc[vj, vd] = dk_acc[vj, vd] + T.cast(dSc[vj, vi], f32) * T.cast(Qt[vi, column(vj, vd)], f32)
                        if dq_atomic:
                            for i, d in T.grid(BM, DQ_COLUMNS):
                                with T.sblock("accumulate_dq"):  # summed over the K/V tiles in any order
                                    vi, vd = T.axis.remap("SS", [i, d])
                                    row = T.meta_var(seq.q_row(qb * BM + vi))
                                    # declared a write alone: the tiles' additions commute (a schedule
                                    # that runs tiles at once makes them atomic), so no tile waits on
                                    # another's, and the tiles stay independent (a grid)
                                    T.reads(dq_share[vi, vd])
                                    T.writes(DQaccum[seq.batch, row, vhk * group + vg, dq_column(vd)])
                                    DQaccum[seq.batch, row, vhk * group + vg, dq_column(vd)] = (
                                        DQaccum[seq.batch, row, vhk * group + vg, dq_column(vd)] + dq_share[vi, vd])

                for j, d in T.grid(KEY_ROWS, DC):
                    with T.sblock("store_dk"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        T.where(vkb * BN + key_of(j) < seq.seqlen_k)
                        dK[seq.batch, seq.k_row(vkb * BN + key_of(vj)), vhk, column(vj, vd)] = T.cast(dk_acc[vj, vd] * softmax_scale, dtype)
                for j, d in T.grid(KEY_ROWS, DC):
                    with T.sblock("store_dv"):
                        vj, vd = T.axis.remap("SS", [j, d])
                        T.where(vkb * BN + key_of(j) < seq.seqlen_k)
                        dV[seq.batch, seq.k_row(vkb * BN + key_of(vj)), vhk, column(vj, vd)] = T.cast(
                            program_dropout.dropout_scaled(Dropout_, dv_acc[vj, vd]), dtype)

    load_kv, load_q, p_and_ds = steps(keys_first=False)

    @tvmscript.prim_func(s_tir=True)
    def dq(
        q_handle: T.handle,
        k_handle: T.handle,
        v_handle: T.handle,
        dout_handle: T.handle,
        lse2_handle: T.handle,
        delta_handle: T.handle,
        dq_handle: T.handle,
        softmax_scale: T.float32,
    ):
        T.func_attr({"global_symbol": "dq", "tirx.noalias": True})
        batch = T.int32()
        seqlen_q = T.int32()
        seqlen_k = T.int32()
        Q_in = T.meta_var(program.strided_argument(q_handle, (batch, seqlen_q, HQ, D), dtype, "q"))
        K_in = T.meta_var(program.strided_argument(k_handle, (batch, seqlen_k, HKV, D), dtype, "k"))
        V_in = T.meta_var(program.strided_argument(v_handle, (batch, seqlen_k, HKV, D), dtype, "v"))
        dO = T.match_buffer(dout_handle, (batch, seqlen_q, HQ, D), dtype)
        LSE2 = T.meta_var(_row_values_argument(lse2_handle, (batch, HQ, seqlen_q), "LSE2"))
        Delta = T.meta_var(_row_values_argument(delta_handle, (batch, HQ, seqlen_q), "Delta"))
        dQ = T.match_buffer(dq_handle, (batch, seqlen_q, HQ, D), dtype)
        Packed_ = T.meta_var(program.varlen_arguments(spec, "max_seqlen_q"))  # parameters with varlen only
        AlibiSlopes = T.meta_var(program.alibi_slopes_argument(spec, program.sequence_count(Packed_, batch), HQ))  # with ALiBi only
        Dropout_ = T.meta_var(program_dropout.dropout_arguments(spec))  # parameters with dropout only
        Flex_ = T.meta_var(program_flex.flex_arguments(spec))  # a score_mod's and mask_mod's tensors, flex only
        # q, k and v with any strides (``program.strided_argument``: a packed qkv's thirds, as the
        # forward takes them), read through aligned views; dout (and delta's out) compact
        Q = T.decl_buffer(Q_in.shape, dtype, data=Q_in.data, strides=program.aligned_strides(Q_in, stride_alignment))
        K = T.decl_buffer(K_in.shape, dtype, data=K_in.data, strides=program.aligned_strides(K_in, stride_alignment))
        V = T.decl_buffer(V_in.shape, dtype, data=V_in.data, strides=program.aligned_strides(V_in, stride_alignment))

        for b, h, qb in T.grid(program.sequence_count(Packed_, batch), HQ, T.ceildiv(program.longest(Packed_, seqlen_q), BM)):
            with T.sblock("tile"):
                vb, vh, vqb = T.axis.remap("SSS", [b, h, qb])
                T.sblock_attr(program.runs_if(Packed_, vb, vqb * BM))
                seq = T.meta_var(program.sequences(Packed_, vb, seqlen_q, seqlen_k))  # the tile's sequence
                Qt = T.sblock_alloc_buffer((BM, D), dtype)  # the Q block, zero-padded
                dOt = T.sblock_alloc_buffer((BM, D), dtype)  # the dout block, zero-padded
                lse2 = T.sblock_alloc_buffer((BM,), f32)  # lse · log2 e
                delta_t = T.sblock_alloc_buffer((BM,), f32)  # delta, 0 past the end
                dq_acc = T.sblock_alloc_buffer((BM, D), f32)  # ds k (scaled at the store)
                scale2 = T.sblock_alloc_buffer((1,), f32)

                with T.sblock("init_scale"):
                    scale2[0] = program.score_scale(spec, softmax_scale) * T.float32(LOG2E)
                load_q(Qt, dOt, lse2, delta_t, Q, dO, LSE2, Delta, seq, vh, vqb)
                for i, d in T.grid(BM, D):
                    with T.sblock("init_dq"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        dq_acc[vi, vd] = T.float32(0)

                # a BlockMask's list of the K/V blocks this Q block visits, None without one
                walk = T.meta_var(program_block_sparse.block_walk(
                    spec, program_flex.flex_tile(spec, Flex_, vb, vh, seq.seqlen_q, seq.seqlen_k), vb, vh, vqb * BM, BM,
                    BN, False, T.ceildiv(seq.seqlen_k, BN)))
                for kb in range(kv_blocks(vqb, seq.seqlen_q, seq.seqlen_k, walk)):
                    with T.sblock("kv_step"):
                        vkb = T.axis.opaque(kv_blocks(vqb, seq.seqlen_q, seq.seqlen_k, walk), kb)
                        block = T.meta_var(walk.tile(vkb) if walk is not None else vkb if left < 0
                                           else first_kv_block(vqb, seq.seqlen_q, seq.seqlen_k) + vkb)
                        Kt = T.sblock_alloc_buffer((BN, D), dtype)  # one K block, zero-padded
                        Vt = T.sblock_alloc_buffer((BN, D), dtype)  # one V block, zero-padded
                        S = T.sblock_alloc_buffer((BM, BN), f32)  # q kᵀ, unscaled
                        P = T.sblock_alloc_buffer((BM, BN), f32)  # exp(s - lse), 0 where masked
                        dP = T.sblock_alloc_buffer((BM, BN), f32)  # dout vᵀ
                        dSc = T.sblock_alloc_buffer((BM, BN), dtype)  # ds in the input dtype, for dq

                        load_kv(Kt, Vt, K, V, seq, vh // group, block)
                        p_and_ds(Qt, Kt, dOt, Vt, lse2, delta_t, scale2, S, P, dP, dSc, vqb, block, seq.seqlen_q, seq.seqlen_k,
                                 softmax_scale, program.alibi_slope(AlibiSlopes, vb, vh),
                                 program_dropout.dropout_tile(Dropout_, vb, vh, HQ),
                                 program_flex.flex_tile(spec, Flex_, vb, vh, seq.seqlen_q, seq.seqlen_k), walk, vkb)
                        for i, d, j in T.grid(BM, D, BN):
                            with T.sblock("dq"):  # dq += ds k
                                vi, vd, vj = T.axis.remap("SSR", [i, d, j])
                                with T.init():  # carried over from the last step
                                    dq_acc[vi, vd] = dq_acc[vi, vd]
                                dq_acc[vi, vd] = dq_acc[vi, vd] + T.cast(dSc[vi, vj], f32) * T.cast(Kt[vj, vd], f32)

                for i, d in T.grid(BM, D):
                    with T.sblock("store_dq"):
                        vi, vd = T.axis.remap("SS", [i, d])
                        T.where(vqb * BM + i < seq.seqlen_q)
                        dQ[seq.batch, seq.q_row(vqb * BM + vi), vh, vd] = T.cast(dq_acc[vi, vd] * softmax_scale, dtype)

    @tvmscript.prim_func(s_tir=True)
    def convert_dq(dq_accum_handle: T.handle, dq_handle: T.handle, softmax_scale: T.float32):
        T.func_attr({"global_symbol": "convert_dq", "tirx.noalias": True})
        batch = T.int32()
        seqlen_q = T.int32()
        rows = T.int32()
        DQaccum = T.match_buffer(dq_accum_handle, (batch, rows, HQ, D), f32)
        dQ = T.match_buffer(dq_handle, (batch, seqlen_q, HQ, D), dtype)
        for b, i, h, d in T.grid(batch, seqlen_q, HQ, D):
            with T.sblock("convert_dq"):
                vb, vi, vh, vd = T.axis.remap("SSSS", [b, i, h, d])
                dQ[vb, vi, vh, vd] = T.cast(DQaccum[vb, vi, vh, vd] * softmax_scale, dtype)

    if dq_atomic:
        return tvm.IRModule({"delta": delta, "dkdv": dkdv, "convert_dq": convert_dq})
    return tvm.IRModule({"delta": delta, "dkdv": dkdv, "dq": dq})
