"""The sm80 forward: the attention program on tensor cores (mma.sync m16n8k16 + ldmatrix).

Mapping (FA2 style):
  * tile (b, h, qb) -> blockIdx.(z, y, x); num_warps warps (threadIdx.y), 32 lanes (threadIdx.x).
  * warp w owns rows [32 w, 32 w + 32) of the Q block (block_m == 32 * num_warps).
  * qk: S = Q K^T with mma.sync (ldmatrix Q as A, ldmatrix K as B^T); S stays in register
    fragments ("warp" scope).
  * pv: acc += P V with mma.sync (P straight from registers as A, ldmatrix.trans V as B); the
    output accumulator stays in register fragments across all K/V tiles, and is rescaled and
    stored from them.
  * The online softmax runs on the fragments: the masked score, P and its fp16/bf16 cast keep the
    mma accumulator layout, which is also the A-operand layout, so P never leaves registers. Row
    max and row sum are our own intrinsics: per-lane partials, then two xor shuffles across the
    quad of lanes that shares a row. The per-row running values (max, sum, rescale factor) stay
    in "local" buffers replicated on each quad (row_state "registers", the default; FA2's way):
    the per-row blocks run through intrinsics derived from the blocks themselves
    (quad_rows_intrin), and the K/V loop keeps only the 2 barriers of the K/V tiles. Each lane's
    per-row buffers compact to 4 statically indexed values (registers, no local memory: ptxas
    -v shows no stack frame at d64) thanks to a second buffer compaction after the match buffers
    are lowered (tvm_fixes.CompactAgainAfterMatchBuffers); store_lse reads the final m
    and l through a shared-memory copy (one barrier after the loop, see common.staged_row_block).
    row_state "shared" keeps them in shared memory instead, one lane per row, which costs ~7
    __syncthreads per tile.
  * Shared tiles have padded rows, so ldmatrix is free of bank conflicts.
  * num_stages: 1 loads each K/V tile with plain vector loads at the top of its step. 2 or 3 make
    the K/V-tile loop a software pipeline (TVM's InjectSoftwarePipeline): load_k/load_v become
    cp.async copies issued num_stages - 1 tiles ahead into num_stages shared buffers, with
    cp.async.wait_group before the tile's compute. It needs tvmflash.lowering's
    no_warp_thread_sync (else "Cannot insert syncs inside condition" in the pipeline epilogue).
"""

from __future__ import annotations

import tvm

from ..common import (bind_grid, buffer_info, hide_init_reads, pipeline_loads, quad_row_block, quad_row_init,
                      row_quad_map, row_reduce_intrin, scalars_local, staged_row_block, tensorize_row_reduce)
from .fragments import (copy_to_shared, fill_fragments, frag_index_map, frag_rows, fragment_elementwise, fragment_lanes,
                        row_block, store_fragments, warp_gemm_operands)
from .intrinsics import intrin_names
from .knobs import NUM_STAGES, ROW_STATES, WARP


def schedule(
    sch: tvm.s_tir.Schedule,
    *,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    vec: int,
    row_state: str = "registers",
) -> tvm.s_tir.Schedule:
    """Map the attention program onto sm80 tensor cores. See the module docstring."""
    dtype, BM, D, BN = buffer_info(sch)
    assert (BM, BN) == (block_m, block_n), "schedule knobs must match the program's tiles"
    if block_m != WARP * num_warps:
        raise ValueError(f"block_m: the sm80 schedule maps one row per lane, so block_m must be 32 * num_warps "
                         f"= {WARP * num_warps}, got {block_m}")
    if block_n % 16 or D % 16:
        raise ValueError(f"block_n and head_dim: expected multiples of 16, got {block_n} and {D}")
    if not isinstance(num_stages, int) or num_stages not in NUM_STAGES:
        raise ValueError(f"num_stages: the sm80 schedule takes one of {NUM_STAGES}, got {num_stages!r}")
    if row_state not in ROW_STATES:
        raise ValueError(f"row_state: the sm80 schedule takes one of {ROW_STATES}, got {row_state!r}")
    quads = row_state == "registers"
    names = intrin_names(dtype)

    # ---- grid -----------------------------------------------------------------------------
    bind_grid(sch)

    # ---- Q, K, V tiles into (dynamic) shared memory ---------------------------------------
    for name in ("load_q", "load_k", "load_v"):
        sch.set_scope(name, 0, "shared.dyn")
        # Rows padded by 16 bytes: the 8 rows an ldmatrix reads then fall in different banks.
        sch.storage_align(name, 0, axis=0, factor=D, offset=8)
        # 16-byte vector copies.
        copy_to_shared(sch, name, num_warps, vec)

    # ---- per-row state ---------------------------------------------------------------------
    scalars_local(sch)
    sch.set_scope("init_ml", 0, "local")  # m: only per-row blocks touch it
    # The per-row values but m: read by the fragment lanes (exp, pv_init, store_o) or
    # written by the quad reductions. "shared": in shared memory, one lane per row. "registers":
    # each lane keeps the values of the rows it holds fragments of (local scope is not relaxed over
    # threadIdx, so each compacts to a few registers per thread).
    per_row_scope = "local" if quads else "shared.dyn"
    # l, m_tile, m_new, alpha, l_tile, l_new, l_inv
    per_row = (("init_ml", 1), ("row_max", 0), ("alpha", 0), ("alpha", 1), ("row_sum", 0), ("merge_l", 0),
               ("inv_l", 0))
    for name, index in per_row:
        sch.set_scope(name, index, per_row_scope)
    if quads:
        for name, index in (("init_ml", 0), *per_row):
            sch.transform_layout(name, ("write", index), row_quad_map)

    # ---- softmax on the fragments ----------------------------------------------------------
    # S, the masked score, P and its cast Pc all keep the mma accumulator layout, and each lane
    # works on the elements it holds. The cast Pc is directly the A operand of the pv mma (the
    # accumulator layout of m16n8k16 is its A layout), so P never goes through shared memory.
    for name in ("qk", "score", "exp", "cast_p"):
        sch.set_scope(name, 0, "warp")
        sch.transform_layout(name, ("write", 0), frag_index_map)

    # ---- qk: S = Q K^T on tensor cores, S kept as mma fragments ("warp" scope) -------------
    qk = sch.get_sblock("qk")
    warp_gemm_operands(sch, qk, num_warps, [(1, names["ld_a"]), (2, names["ld_b_trans"])])  # Qt, Kt
    sch.tensorize(sch.get_loops(qk)[-3], names["mma_nt"])
    sch.tensorize(sch.get_loops("qk_init")[-2], names["fill"])

    for name in ("score", "exp", "cast_p"):
        fragment_elementwise(sch, name, num_warps)
    # Row max and row sum: per-lane partial results combined across each quad by shuffles
    # (common.row_reduce_intrin, shared with sm90), into per-row values in shared memory or, with
    # row_state "registers", in each quad's registers.
    for name, op in (("row_max", "max"), ("row_sum", "sum")):
        intrin = row_reduce_intrin(op, frag_rows(BM // num_warps, BN), per_row_scope)
        tensorize_row_reduce(sch, name, intrin, num_warps, WARP, quad_row_init(sch) if quads else None)

    # ---- pv: acc += P V on tensor cores, acc kept as fragments across K/V tiles ------------
    sch.set_scope("pv", 0, "warp")
    sch.transform_layout("pv", ("write", 0), frag_index_map)
    pv = sch.get_sblock("pv")
    # pv_init (from decompose_reduction) is the rescale acc *= alpha, on fragments.
    pv_o = warp_gemm_operands(sch, pv, num_warps, [(2, None), (3, names["ld_b"])])  # Pc (already), Vt
    for blk in (pv_o, pv):
        hide_init_reads(sch, blk)
    sch.tensorize(sch.get_loops(pv)[-3], names["mma_nn"])
    fragment_lanes(sch, "pv_init")  # the rescale

    fill_fragments(sch, "init_acc", num_warps, names["fill"])
    store_fragments(sch, "store_o", num_warps)  # the epilogue, straight from the fragments

    if quads:  # per-row values on the quads that hold the rows
        for name in ("init_ml", "alpha", "merge_l", "update_ml", "inv_l"):
            quad_row_block(sch, name, num_warps)
        staged_row_block(sch, "store_lse", num_warps, lambda sch, name: row_block(sch, name, num_warps))
    else:  # one lane per row
        for name in ("init_ml", "alpha", "merge_l", "update_ml", "inv_l", "store_lse"):
            row_block(sch, name, num_warps)
    # ---- K/V loads: cp.async software pipeline (last: it annotates kv_step's final children) -
    if num_stages > 1:
        pipeline_loads(sch, num_stages)
    return sch
