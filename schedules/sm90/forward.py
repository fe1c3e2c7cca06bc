"""The sm90 forward (``schedule``): QK^T and PV on wgmma, the softmax on the accumulator registers.

Mapping:
  * tile (b, h, qb) -> blockIdx.(z, y, x); ``num_warpgroups`` warpgroups (threadIdx.y) of 128
    threads (threadIdx.x). Warpgroup g owns rows [64 g, 64 g + 64) of the Q block, so
    block_m == 64 * num_warpgroups.
  * Q, K, V tiles live in dynamic shared memory, read by wgmma through matrix descriptors. Q is
    in the "interleaved" (no-swizzle) core-matrix layout (``layouts.core_matrix_map``), core
    matrices 16 bytes apart along a row (``layouts.pad_core_matrix_stride``), or (``q_layout``
    "swizzled") in the 128-byte swizzled layout, as is the output's staging tile then; a swizzled
    Q tile may be copied by TMA (``q_copy``). K and V (``kv_layout``, default "swizzled") are in
    the 128-byte swizzled layout (``layouts.swizzled_map``: 64-column halves of 128-byte rows,
    16-byte chunks permuted by row; at a head_dim that is no multiple of 64, d96, the 64-byte
    swizzle: 32-column groups of 64-byte rows), or padded core matrices like Q. All are copied
    along the rows, 16 bytes a thread. The K/V tiles are loaded in a software pipeline
    (num_stages 2, the default, or 3), by TMA (``kv_copy`` "tma", the default:
    ``tvmflash.lowering.tma_copies`` turns the pipeline's copies into one thread's
    ``cp.async.bulk.tensor`` on the stage's mbarriers, and the K/V loop keeps no __syncthreads) or
    by every thread's cp.async ("cp.async": each step waits for its tile and syncs once,
    ``lowering.cp_async_barriers.OneBarrierPerPipelinedStep``), or plainly (num_stages 1). QK^T reads both
    operands through descriptors ("ss" form), K K-major; PV takes P from registers ("rs" form) and
    V through a descriptor, N-major (``imm-trans-b`` = 1), so V is never transposed.
  * qk: S = Q K^T: one tensor intrinsic per warpgroup and K/V tile covers the whole 64 x block_n
    x head_dim product: head_dim/16 ``wgmma.mma_async.m64n{block_n}k16`` in one commit group.
    S stays in the wgmma accumulator registers (``layouts.acc_layout``).
  * The online softmax runs on the accumulator registers, all 128 threads of each warpgroup:
    the masked score, P and its fp16/bf16 cast keep the accumulator layout. Row max and row sum
    are quad-shuffle reductions (``common.row_reduce_intrin`` with ``layouts.acc_rows``, the same
    intrinsic the sm80 schedule uses on mma.sync fragments). With row_state "registers" (the
    default) the per-row values live in the registers of the quads that hold the rows, and the
    K/V step has only the barriers of the K/V tiles; "shared" keeps them in shared memory, one
    thread per row (about 5 more __syncthreads per tile).
  * producer (default "thread"): who issues the TMA copies, thread 0 of the first warpgroup or, as
    in FA3, a warpgroup of its own that gives its registers to the two consumer warpgroups
    (``tvmflash.lowering.tma_copies``; one block an SM, 240 registers a consumer thread, room for block_n
    128 at d128). Correct on the H200 but slower than the default there so far, also with
    q_layout "swizzled" and three stages of block_n 128; it is in the tuning space.
  * min_blocks_per_sm (default 2): ``__launch_bounds__(256, 2)``, so that two blocks share an SM
    (128 registers a thread; unbounded, d128 takes 137 and one block fills the SM). block_m 256
    (four warpgroups a K/V tile, one block an SM) is in the tuning space.
  * pv: acc += P V (``m64n{head_dim}k16``, block_n/16 of them). The accumulator layout of S is,
    per 16 columns, the A-register layout of the "rs" form, so the cast P is the A operand as it
    is (no shared memory round trip). The output accumulator stays in registers across all K/V
    tiles and is rescaled and stored from them. The rescale by alpha (pv's init) runs under a
    warp-wide test (``annotations.SKIP_UNIT_RESCALE_PRAGMA``), skipped where every row of the warp
    keeps its max: with the program's ``RESCALE_THRESHOLD`` that is most tiles after the first few
    (a sixth of a d128 K/V step's instructions; measured faster on the H200).
"""

from __future__ import annotations

import tvm

from tvmflash.lowering.annotations import (SKIP_UNIT_RESCALE_PRAGMA, SWIZZLE_COLUMNS,
                                           TMA_LOAD, WGMMA_WAIT_PRAGMA, swizzle_columns)

from ..common import (bind_grid, buffer_info, hide_init_reads, pipeline_loads, quad_row_block, quad_row_init,
                      row_quad_map, row_reduce_intrin, scalars_local, staged_row_block, tensorize_row_reduce)
from .knobs import FORWARD
from .layouts import (PAD_ELEMENTS, WARPGROUP, WARPS_PER_WARPGROUP, acc_block, acc_index_map, acc_rows,
                      row_block, swizzled_map, tile_in_shared_memory)
from .wgmma import warpgroup_gemm, wgmma_intrin_name


def store_through_shared_memory(sch, head_dim, num_warpgroups, vec, swizzled, columns=SWIZZLE_COLUMNS,
                                   name="store_o"):
    """The output goes to global memory through shared memory: the accumulator threads write their
    pairs of adjacent columns (one 32-bit store each) into a row-major tile whose rows are padded
    by 16 bytes (so the 8 rows a warp writes at once hit different banks), then all threads copy
    the tile out along its rows, 16 bytes each. Straight from the accumulator layout it was 2-byte
    stores, each warp's touching 8 sectors for 64 bytes, which measured clearly slower on the H200.
    The tile reuses the K/V and Q tiles' shared memory (dead by then). ``swizzled`` (q_layout
    "swizzled"): the tile is in the Q tile's swizzled layout instead, as large as the Q tile and as
    free of bank conflicts (the 8 rows a warp writes at once land in 8 different 16-byte chunks). ``name``:
    the store block (dkdv's store_dk and store_dv with ``dkdv_store`` "staged", whose tiles are (1, rows, 1,
    head_dim) too)."""
    acc_block(sch, name, num_warpgroups)
    sch.vectorize(sch.get_loops(name)[-1])  # a thread's two adjacent columns
    copy = sch.cache_write(name, 0, "shared.dyn")
    if swizzled:  # the tile is (1, block_m, 1, head_dim), a slice of O
        sch.transform_layout(name, ("write", 0), lambda b, r, h, c: swizzled_map(r, c, columns),
                             assume_injective_transform=True)
    else:  # axis 2's stride is the row stride
        sch.storage_align(name, 0, axis=2, factor=head_dim, offset=PAD_ELEMENTS)
    # Its rows: those of the sequence (a symbolic count, at most block_m); 16 bytes a thread.
    b, r, h, c = sch.get_loops(copy)[-4:]
    c_hi, v = sch.split(c, [None, vec])
    _, ty, tx = sch.split(sch.fuse(b, r, h, c_hi), [None, num_warpgroups, WARPGROUP])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(v)


def row_state_in_registers(sch, BN, num_warpgroups, rows=acc_rows, p_block=acc_block):
    """row_state "registers" (FA2's way, as sm80's): the per-row values (m, l, m_tile, m_new,
    alpha, l_tile, l_new, l_inv) in the registers of the quads that hold the rows, each lane a
    copy (``common.row_quad_map``); row max and row sum fold into them (quad mode of
    ``common.row_reduce_intrin``), the per-row blocks run on the quads (``common.quad_row_block``),
    and the K/V step has no barrier but those of the K/V tiles. store_lse reads the values back
    through shared memory once, after the loop (``common.staged_row_block``). ``rows`` and ``p_block``: S's
    layout for the row reductions and cast_p's thread binding (FP8's permuted ones: ``forward_fp8``)."""
    per_row = (("init_ml", 0), ("init_ml", 1), ("row_max", 0), ("alpha", 0), ("alpha", 1), ("row_sum", 0),
               ("merge_l", 0), ("inv_l", 0))  # m, l, m_tile, m_new, alpha, l_tile, l_new, l_inv
    for name, idx in per_row:
        sch.set_scope(name, idx, "local")
        sch.transform_layout(name, ("write", idx), row_quad_map)
    for name, op in (("row_max", "max"), ("row_sum", "sum")):
        tensorize_row_reduce(sch, name, row_reduce_intrin(op, rows(BN), "local"), num_warpgroups, WARPGROUP,
                             quad_row_init(sch, WARPS_PER_WARPGROUP))
    p_block(sch, "cast_p", num_warpgroups)
    for name in ("init_ml", "alpha", "merge_l", "update_ml", "inv_l"):
        quad_row_block(sch, name, num_warpgroups, WARPS_PER_WARPGROUP)
    staged_row_block(sch, "store_lse", num_warpgroups, lambda sch, name: row_block(sch, name, num_warpgroups),
                     WARPS_PER_WARPGROUP)


def _row_state_in_shared_memory(sch, BN, num_warpgroups):
    """row_state "shared": row max and row sum are quad-shuffle reductions into per-row values in
    shared memory (m_tile, l_tile); the per-row blocks run one thread per row (thread r of the
    warpgroup, r < 64), and what the accumulator threads read back by row (m_new in exp, alpha in
    pv_init, l_inv in store_o) is in shared memory. About 5 __syncthreads a K/V step."""
    # m_tile and l_tile in static shared memory, m_new and alpha in dynamic: ThreadSync plans each
    # scope on its own, and for "shared.dyn" it takes every access as one buffer's (the pool the
    # buffers are merged into) and trusts two accesses to be the same thread's only when their
    # index names the innermost thread variable (threadIdx.y here; the row is 64 threadIdx.y +
    # threadIdx.x, bound to a let by CSE). Were m_tile dynamic too, block ``alpha``'s read of it
    # after its store of m_new (one row thread, under ``threadIdx.x < 64``) would need a barrier
    # inside that guard: "Cannot insert syncs inside condition".
    for name, idx in (("row_max", 0), ("row_sum", 0)):  # m_tile, l_tile
        sch.set_scope(name, idx, "shared")
    for name, idx in (("alpha", 0), ("alpha", 1)):  # m_new, alpha
        sch.set_scope(name, idx, "shared.dyn")
    for name, op in (("row_max", "max"), ("row_sum", "sum")):
        tensorize_row_reduce(sch, name, row_reduce_intrin(op, acc_rows(BN), "shared"), num_warpgroups, WARPGROUP)
    acc_block(sch, "cast_p", num_warpgroups)
    # The running sum l stays in its row's register. store_o, run by the accumulator threads, reads
    # its inverse (inv_l, one row thread each, after the last K/V tile) from shared memory.
    sch.set_scope("inv_l", 0, "shared.dyn")
    for name in ("init_ml", "alpha", "merge_l", "update_ml", "inv_l", "store_lse"):
        row_block(sch, name, num_warpgroups)
    for name, idx in (("init_ml", 0), ("init_ml", 1), ("merge_l", 0)):  # m, l, l_new: per-row blocks only
        sch.set_scope(name, idx, "local")


def schedule(
    sch: tvm.s_tir.Schedule,
    *,
    block_m: int,
    block_n: int,
    num_warpgroups: int,
    vec: int,
    num_stages: int = 2,
    min_blocks_per_sm: int = 2,
    row_state: str = "registers",
    kv_layout: str = "swizzled",
    kv_copy: str = "tma",
    producer: str = "thread",
    q_layout: str = "core_matrices",
    q_copy: str = "threads",
    o_store: str = "staged",
    overlap: int = 0,
) -> tvm.s_tir.Schedule:
    """Map the attention program onto sm90 wgmma. See the module docstring. (min_blocks_per_sm
    is a kernel attribute, ``knobs.kernel_attrs``: the caller puts it on the program.)"""
    dtype, BM, D, BN = buffer_info(sch)
    assert (BM, BN) == (block_m, block_n), "schedule knobs must match the program's tiles"
    problem = FORWARD.problem(
        {"block_m": block_m, "block_n": block_n, "num_warpgroups": num_warpgroups, "vec": vec, "num_stages": num_stages,
         "min_blocks_per_sm": min_blocks_per_sm, "row_state": row_state, "kv_layout": kv_layout, "kv_copy": kv_copy,
         "producer": producer, "q_layout": q_layout, "q_copy": q_copy, "o_store": o_store, "overlap": overlap}, D, dtype)
    if problem:
        raise ValueError(problem)
    swizzled, q_swizzled = kv_layout == "swizzled", q_layout == "swizzled"
    columns = swizzle_columns(D)  # 64 (the 128-byte swizzle) or, at d96, 32 (64-byte)
    qk_intrin = wgmma_intrin_name(BN, D, dtype, "k", fence_operands=num_stages == 1, b_swizzled=swizzled,
                                  a_swizzled=q_swizzled, swizzle=columns)
    pv_intrin = wgmma_intrin_name(D, BN, dtype, "mn", a_regs=True, b_swizzled=swizzled, wait=not overlap,
                                  swizzle=columns)

    # ---- grid -----------------------------------------------------------------------------
    bind_grid(sch)

    # ---- Q, K, V tiles into shared memory, as q_layout and kv_layout say ----------------------
    for name in ("load_q", "load_k", "load_v"):
        tile_in_shared_memory(sch, name, num_warpgroups, vec, q_swizzled if name == "load_q" else swizzled, columns)
        if (q_copy if name == "load_q" else kv_copy) == "tma":  # lowered to one thread's TMA copy (tvmflash.lowering.tma_copies)
            sch.annotate(sch.get_sblock(name), TMA_LOAD, producer)

    # ---- qk: S = Q K^T on wgmma, S in accumulator registers --------------------------------
    sch.set_scope("qk", 0, "local")
    sch.transform_layout("qk", ("write", 0), acc_index_map)
    rows = warpgroup_gemm(sch, "qk", num_warpgroups)
    sch.tensorize(rows, qk_intrin)

    # ---- P (the A operand of pv) stays in registers ---------------------------------------
    # The accumulator layout of S (64 x block_n) is, per 16 columns, the A-fragment layout of
    # wgmma's register ("rs") form, so Pc, cast in place, is pv's A operand as it is.
    sch.set_scope("cast_p", 0, "local")
    sch.transform_layout("cast_p", ("write", 0), acc_index_map)

    # ---- pv: acc += P V on wgmma, acc in registers across K/V tiles ------------------------
    sch.set_scope("pv", 0, "local")
    sch.transform_layout("pv", ("write", 0), acc_index_map)
    pv = sch.get_sblock("pv")
    rows = warpgroup_gemm(sch, pv, num_warpgroups)  # pv_init: the rescale acc *= alpha
    # decompose_reduction leaves the init's read of alpha on the update block; drop it so the
    # update matches the intrinsic's description (reads C, A, B only).
    hide_init_reads(sch, pv)
    if row_state == "registers":  # alpha in each thread's registers: skip the rescale where it is 1
        sch.annotate(sch.get_loops("pv_init")[-3], SKIP_UNIT_RESCALE_PRAGMA, 1)  # its first per-thread loop
    sch.tensorize(rows, pv_intrin)

    acc_block(sch, "init_acc", num_warpgroups)
    if o_store == "staged":
        store_through_shared_memory(sch, D, num_warpgroups, vec, q_swizzled, columns)
    else:  # each thread stores the pairs of adjacent columns it holds
        acc_block(sch, "store_o", num_warpgroups)
        sch.vectorize(sch.get_loops("store_o")[-1])

    # ---- softmax on the accumulator registers -------------------------------------------
    # S, the masked score and P keep the accumulator layout, and each thread works on the
    # elements it holds (all 128 threads of the warpgroup).
    for name in ("score", "exp"):
        sch.set_scope(name, 0, "local")
        sch.transform_layout(name, ("write", 0), acc_index_map)
        acc_block(sch, name, num_warpgroups)
    scalars_local(sch)  # the scale in log2 units (and a sink): scalars the per-row blocks read
    if row_state == "registers":
        row_state_in_registers(sch, BN, num_warpgroups)
    else:
        _row_state_in_shared_memory(sch, BN, num_warpgroups)
    if num_stages > 1:  # last: it annotates kv_step's final children
        pipeline_loads(sch, num_stages, lagged=("pv",) if overlap else ())
    if overlap:  # the last PV is waited for, and its accumulators fenced, before the output reads them
        sch.annotate(sch.get_loops("store_o")[-3], WGMMA_WAIT_PRAGMA, 0)  # its first per-thread loop
    return sch
