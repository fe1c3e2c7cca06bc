"""The sm90 backward (``schedule_backward``, of ``tvmflash.program_backward``): dkdv and dq on wgmma.

delta runs on the SIMT schedule. dkdv and dq are mapped as the forward is, each warpgroup 64 rows
(keys in dkdv, queries in dq): dkdv's tile is block_n keys (64 a warpgroup) and block_m query rows a
step; dq's is dq_block_m query rows (64 a warpgroup) and dq_block_n keys a step. s and dp are in the
"ss" form, the gradients' products in the "rs" form from p or ds in the accumulator registers. By
default (``dq_atomic``) dkdv also makes dq's share on wgmma from dsᵀ staged in shared memory and
adds it by vector atomics. Each program's stream of tiles is loaded in a pipeline, dkdv's by TMA by
default (the knobs and the reasons for their defaults: ``knobs.BACKWARD``). The default
backward on sm_90a at head_dim 64, 96, 128 and 256 (``tvmflash.choice``); at d256, where dk and dv of a
warpgroup's 64 keys do not fit a thread's registers (``knobs.backward_register_problem``), dkdv makes them
in two slices of the columns (the program's ``dkdv_slices``): a warpgroup a slice of the same keys, or a
thread block a slice.
"""

from __future__ import annotations

import tvm
import tvm_ffi

from tvmflash.lowering.annotations import (ATOMIC_ADD_PRAGMA, BULK_REDUCE_PRAGMA, BULK_REDUCE_WAIT_PRAGMA,
                                           DOUBLE_BUFFERED_PRAGMA, MERGED_ATOMIC_ADD_PRAGMA, RUNS_IF, SWIZZLE_COLUMNS,
                                           TMA_LOAD, TMA_REDUCE_PRAGMA, VECTOR_REDUCE_PRAGMA, WGMMA_WAIT_PRAGMA,
                                           swizzle_columns)

from ..common import bind_grid, buffer_info, dkdv_grid, has_block, hide_init_reads, pipeline_loads
from .forward import store_through_shared_memory
from .knobs import PERSISTENT_BLOCKS, dq_share_problem
from .layouts import (WARPGROUP, WG_ROWS, acc_block, acc_index_map, acc_layout, bind_acc_threads, core_matrix_map,
                      pad_core_matrix_stride, row_block, swizzled_map, tile_in_shared_memory)
from .wgmma import warpgroup_gemm, wgmma_intrin_name


def schedule_backward(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int, dq_block_m: int, dq_block_n: int,
                      dkdv_stages: int, dq_stages: int, vec: int, dq_atomic: bool = False,
                      dkdv_copy: str = "cp.async", wgmma_overlap: bool = False, ds_buffers: int = 1,
                      dq_reduce: str = "atomic", dkdv_producer: str = "thread",
                      dkdv_slices: int = 1, dkdv_slicing: str = "rows",
                      dkdv_persistent: bool = False, dkdv_store: str = "direct",
                      dkdv_kv_copy: str = "threads") -> tvm.s_tir.Schedule:
    """delta on the SIMT schedule, dkdv and dq on wgmma (``vec`` elements a copy). The tiles are the
    program's (``program_backward.attention_backward``). ``dq_atomic``: the program has no dq; dkdv
    adds dq's share atomically (``_schedule_dq_share``) and convert_dq runs on SIMT. ``wgmma_overlap``:
    see the comment above ``knobs.BACKWARD``. ``ds_buffers`` and ``dq_reduce``, with ``dq_atomic``: dsᵀ's
    shared-memory tile in 1 or 2 buffers, and dq's share added by "atomic" reductions from the
    registers, or from a shared-memory tile by "vector" atomics or "bulk" reductions
    (``_schedule_dq_share``). ``dkdv_producer``: who issues dkdv's TMA copies, thread 0 or a warpgroup of
    its own (``lowering.tma_producer_warpgroup``: the consumers' barriers named, their registers 240).
    ``dkdv_slices``, ``dkdv_slicing``: the program's (``program_backward.attention_backward``): dk and dv
    in slices of the head_dim columns, a slice a warpgroup of 64 keys ("rows") or a tile ("grid"); the
    schedule reads the tile's rows and the slice's width from dk's buffer. ``dkdv_persistent``: dkdv's tiles
    walked by ``knobs.PERSISTENT_BLOCKS`` thread blocks (``common.persistent_walk``). ``dkdv_store``: dk and dv
    stored from the accumulator registers ("direct": each thread its pairs of adjacent columns) or through a
    shared-memory tile each ("staged", ``_schedule_dkdv``). ``dkdv_kv_copy``: the tile's K and V copied by
    the consumer threads ("threads") or by TMA ("tma", swizzled; needs dkdv_copy "tma")."""
    from .. import simt

    simt.schedule_delta(sch)
    _schedule_dkdv(sch, dkdv_stages, vec, dq_atomic, dkdv_copy, wgmma_overlap, ds_buffers, dq_reduce, dkdv_producer,
                   PERSISTENT_BLOCKS if dkdv_persistent else 0, dkdv_store, dkdv_kv_copy)
    if dq_atomic:
        simt.schedule_convert_dq(sch)
    else:
        _schedule_dq(sch, dq_stages, vec, wgmma_overlap)
    return sch


def _backward_warpgroups(rows: int, what: str) -> int:
    if rows % WG_ROWS:
        raise ValueError(f"knobs: the sm90 backward gives each warpgroup 64 {what}, so it needs a multiple of 64, "
                         f"got {rows}")
    return rows // WG_ROWS


def _schedule_dkdv(sch: tvm.s_tir.Schedule, num_stages: int, vec: int, dq_atomic: bool = False,
                   copy: str = "cp.async", overlap: bool = False, ds_buffers: int = 1, dq_reduce: str = "atomic",
                   producer: str = "thread", persistent_blocks: int = 0, store: str = "direct",
                   kv_copy: str = "threads") -> None:
    """dkdv: its tiles are key-first (sᵀ = k qᵀ, ...), so warpgroup g owns keys [64 g, 64 g + 64) of
    the K/V block, as the forward's warpgroups own query rows: sᵀ and dpᵀ on wgmma with K or V as A
    and q or dout as B (K-major), pᵀ and dsᵀ in the accumulator registers, which are the A operand
    of dv += pᵀ dout and dk += dsᵀ q (the "rs" form, dout and q as N-major B), and dv, dk in
    accumulator registers across the Q blocks, stored from them. ``persistent_blocks``: that many thread
    blocks walk the tiles (``common.persistent_walk``), 0: a thread block a tile. ``store`` "staged": dk and
    dv go out as the forward's output does (``forward.store_through_shared_memory``): the threads write
    their pairs of adjacent columns into a padded row-major tile, and all copy it out along its rows, 16
    bytes a thread, where "direct" stores each pair from the registers (a 4-byte store a pair, each warp's
    touching 8 rows: 64 such stores a thread at d128, all at the tile's end)."""
    sch.work_on("dkdv")
    dtype, BM, D, BN = buffer_info(sch)
    # the tile's rows (dk's), 64 a warpgroup: block_n keys, once a slice of the columns with dkdv_slicing
    # "rows" (each warpgroup's keys its slice's), and the columns of dk, dv and dq's share they make: head_dim,
    # or a slice, whose products read q, dout and K from the slice's first column on (whole swizzled groups)
    rows, DC = (int(extent) for extent in sch.get(sch.get_sblock("dk")).writes[0].source.shape)
    groups = _backward_warpgroups(rows, "keys (block_n · dkdv_slices)")
    if BM % 16 or D % 16:
        raise ValueError(f"knobs: the sm90 dkdv needs block_m and head_dim multiples of 16, got {BM} and {D}")
    if persistent_blocks:
        _check_persistent(sch, copy)
    staged = dkdv_grid(sch, dq_atomic, persistent_blocks)  # dsᵀ's copy to shared memory with dq_atomic
    tma = copy == "tma"
    # q and dout swizzled for TMA: 128-byte rows, or at d96 (no multiple of 64) 64-byte rows
    columns = swizzle_columns(D) if tma else SWIZZLE_COLUMNS
    # K and V swizzled, by TMA copies once a tile (issued by thread 0 of the first warpgroup: the tiles stay the
    # consumers' own, so that dkdv_store "staged" may reuse their memory, ``tma_copies._one_off_copy``)
    kv_tma = kv_copy == "tma"
    for name in ("load_k", "load_v", "load_q", "load_do"):
        tile_in_shared_memory(sch, name, groups, vec, swizzled=tma and (name in ("load_q", "load_do") or kv_tma),
                              columns=columns)
    if kv_tma:
        for name in ("load_k", "load_v"):
            sch.annotate(sch.get_sblock(name), TMA_LOAD, producer)
    for name in ("load_lse", "load_delta"):  # BM rows, any number of warpgroups
        _spread_rows(sch, name, groups)
    if tma:  # the Q block's tiles and its rows' values by TMA
        for name in ("load_q", "load_do", "load_lse", "load_delta"):
            sch.annotate(sch.get_sblock(name), TMA_LOAD, producer)
    _backward_step(sch, ("cast_p",), groups, BM, D, dtype, num_stages, overlap, b_swizzled=tma, swizzle=columns,
                   a_swizzled=kv_tma)
    if has_block(sch, "capture_gradient"):  # a learned capture's gradient: each thread its elements of dsᵀ
        acc_block(sch, "capture_gradient", groups)
        # the loops in each thread; 2: whole warps, so a warp whose runs end on one element adds once
        sch.annotate(sch.get_loops("capture_gradient")[-3], MERGED_ATOMIC_ADD_PRAGMA, 2)
    # With overlap dv and dq's share only committed: dk's wait ends them. dv only where TMA places the Q
    # block's tiles: the threads' copies (cp.async; varlen's) leave dout's tile to TVM's shared-memory
    # planner, which, seeing dv's wgmma as dout's last reader, gives dsᵀ's tile (written while dv would
    # still run) the same bytes: dv then read dsᵀ for dout (varlen's dv off by 2.9 on an H100, 2026-12-07).
    # dq's share reads dsᵀ and K, which nothing writes before dk's wait.
    dv_in_flight = overlap and tma
    for name in ("dv", "dk"):
        _backward_accumulate(sch, name, groups, DC, BM, dtype, b_swizzled=tma, wait=not dv_in_flight or name == "dk",
                             swizzle=columns, store=store == "direct")
        if store == "staged":
            store_through_shared_memory(sch, DC, groups, vec, swizzled=False, name=f"store_{name}")
    if dq_atomic:
        share_columns = int(sch.get(sch.get_sblock("dq")).writes[0].source.shape[1])  # head_dim, or the tile's slice
        _schedule_dq_share(sch, staged, groups, BM, share_columns, BN, dtype, ds_buffers, dq_reduce, overlap,
                           k_swizzle=columns if kv_tma else None)
    if num_stages > 1:
        pipeline_loads(sch, num_stages, step="q_step", loads=("load_q", "load_do", "load_lse", "load_delta"))


def _check_persistent(sch, copy):
    """Why dkdv's tiles cannot be walked by persistent thread blocks (``dkdv_persistent``), as a ValueError:
    the TMA lowering carries its pipeline across tiles (not cp.async's), every thread block's walk the same
    shape (not varlen's tiles, each under its sequence's test), and a tile's step count an expression (not
    a BlockMask's, read from memory once a thread block, before the producer's and consumers' branches)."""
    loads = []
    tvm_ffi.structural_walk(sch.get(sch.get_loops("q_step")[-1]).extent,
                            (tvm.ir.expr.TensorLoad, lambda n: loads.append(n)))
    if copy != "tma" or RUNS_IF in sch.get(sch.get_sblock("tile")).annotations or loads:
        raise ValueError("knobs: dkdv_persistent walks dkdv's tiles with their TMA pipeline carried across them: it "
                         f"needs dkdv_copy 'tma' (got {copy!r}), and takes neither varlen nor a BlockMask")


def _schedule_dq_share(sch, staged, groups, BM, D, BN, dtype, ds_buffers=1, dq_reduce="atomic", overlap=False,
                       k_swizzle=None):
    """dq's share of a dkdv step, ds k, added atomically into the fp32 dq (FA2's way, as sm80's
    ``dq_atomic``). Each warpgroup holds dsᵀ of its keys, but ds k sums over all the block's keys:
    the threads write their dsᵀ elements to shared memory (core matrices), and each warpgroup then
    makes the 64 query rows of ds k for its share of the head_dim columns on wgmma (dsᵀ read
    transposed as A, K N-major as B) and adds its accumulator registers into global memory, two
    adjacent columns a ``red.global.add.v2.f32`` (``ATOMIC_ADD_PRAGMA``).

    The writes of dsᵀ wait at a block-wide barrier for the previous step's readers; with
    ``ds_buffers`` 2 the steps write two tiles in turn and that barrier goes
    (``lowering.double_buffers``): the warpgroups, held together once a step instead of twice, may
    each be in a different phase of the step (one on the tensor cores while the other computes ds).

    With ``dq_reduce`` "bulk" (FA3's way) the threads write their accumulator registers into a
    shared-memory tile of ds k (rows padded by 8 floats: a warp's writes meet no bank twice) instead,
    and each warpgroup's first 64 threads add one row of its columns each, by one bulk reduction
    (``cp.reduce.async.bulk``, ``BULK_REDUCE_PRAGMA``): the copy engine does the additions, where
    the atomics cost every thread 16 reductions a step at d128. Before the next step's writes each
    thread waits until its reductions have read the tile, and the warpgroup at its named barrier;
    before the thread block ends, until they are complete. With "vector" the warpgroup's threads read
    the tile back and add it four columns a ``red.global.add.v4.f32``, consecutive threads consecutive
    columns (``VECTOR_REDUCE_PRAGMA``): half the atomics' instructions, each warp's covering whole
    128-byte lines where the atomics from the accumulator layout touch 8 rows' 32 bytes each. With
    "tma" the tile is unpadded, in TMA's 128-byte swizzle of float32 rows (``swizzled_map``, 32 columns:
    the pair stores meet no bank twice), and thread 0 of each warpgroup adds all its 64 x cols by one TMA
    reduction through dq_accum's tensor map (``TMA_REDUCE_PRAGMA``, ``lowering.tma_reductions``): one
    operation a warpgroup a step where "bulk" has 64.

    With ``overlap`` (wgmma_overlap) dq's wgmma is only committed, as dv's is: dv, dq and dk go to
    the tensor cores back to back (dsᵀ is written and the warpgroups meet at their barrier while dv
    runs), and dk's wait ends all three. The share's first loop then fences dq's accumulators, and
    pᵀ's registers, which dv read until that wait (FA3's order)."""
    problem = dq_share_problem(BM, D, groups)
    if problem:
        raise ValueError(problem)
    cols = D // groups
    sch.transform_layout(staged, ("write", 0), core_matrix_map)
    pad_core_matrix_stride(sch, staged)
    acc_block(sch, staged, groups)
    sch.vectorize(sch.get_loops(staged)[-1])
    if ds_buffers == 2:  # the outermost loop in each thread
        sch.annotate(sch.get_loops(staged)[-3], DOUBLE_BUFFERED_PRAGMA, 1)

    def by_columns(i, d):  # (query row, column) -> (warpgroup, register): warpgroups split the columns
        return (d // cols, acc_layout(i, d % cols)[1])

    def columns_by_warpgroup(i, d):  # (query row, column) loops -> warpgroup outside the rows; the rows loop
        wg, d = sch.split(d, [groups, cols])
        sch.reorder(wg, i, d)
        sch.bind(wg, "threadIdx.y")
        return i

    block = sch.get_sblock("dq")
    from_tile = dq_reduce != "atomic"  # "bulk" and "vector" add ds k from a shared-memory tile
    # that tile, copied from the accumulators before they take their register layout (so that the copy
    # keeps the logical one)
    share = sch.cache_read("accumulate_dq", 0, "shared.dyn") if from_tile else "accumulate_dq"
    sch.set_scope(block, 0, "local")
    sch.transform_layout(block, ("write", 0), by_columns)
    i = columns_by_warpgroup(*sch.get_loops(block)[-3:-1])  # (i, d, j): the reduction j stays innermost
    init = sch.decompose_reduction(block, i)
    bind_acc_threads(sch, init)
    sch.tensorize(i, wgmma_intrin_name(cols, BN, dtype, "mn", a_major="mn", wait=not overlap,
                                       b_swizzled=k_swizzle is not None, swizzle=k_swizzle or SWIZZLE_COLUMNS))
    columns_by_warpgroup(*sch.get_loops(share)[-2:])
    bind_acc_threads(sch, share)
    if overlap:  # the loops in each thread
        sch.annotate(sch.get_loops(share)[-3], WGMMA_WAIT_PRAGMA, "dq_share+Pc")
    if not from_tile:  # the loops in each thread; 2: a thread's two adjacent columns go as one vector reduction
        sch.annotate(sch.get_loops(share)[-3], ATOMIC_ADD_PRAGMA, 2)
        return
    if dq_reduce == "tma":  # TMA's layout: 128-byte rows of float32 in its swizzle
        sch.transform_layout(share, ("write", 0), lambda r, c: swizzled_map(r, c, columns=32, chunk=4),
                             assume_injective_transform=True)
    else:
        sch.storage_align(share, 0, axis=0, factor=32, offset=8)
    sch.annotate(sch.get_loops(share)[-3], BULK_REDUCE_WAIT_PRAGMA, WARPGROUP)
    i = columns_by_warpgroup(*sch.get_loops("accumulate_dq")[-2:])
    sch.annotate(i, {"bulk": BULK_REDUCE_PRAGMA, "vector": VECTOR_REDUCE_PRAGMA, "tma": TMA_REDUCE_PRAGMA}[dq_reduce],
                 WARPGROUP)
    sch.annotate(sch.get_loops("store_dk")[-3], BULK_REDUCE_WAIT_PRAGMA, 0)  # complete before the block ends


def _schedule_dq(sch: tvm.s_tir.Schedule, num_stages: int, vec: int, overlap: bool = False) -> None:
    """dq, mapped as the forward is (a Q block, the K/V blocks streamed past it): s and dp on wgmma
    with q or dout as A and K or V as B (K-major), p and ds in accumulator registers, ds the A operand
    of dq += ds k (K as N-major B), dq in accumulator registers across the K/V blocks."""
    sch.work_on("dq")
    dtype, BM, D, BN = buffer_info(sch)
    groups = _backward_warpgroups(BM, "query rows (dq_block_m)")
    if BN % 16 or D % 16:
        raise ValueError(f"knobs: the sm90 dq needs dq_block_n and head_dim multiples of 16, got {BN} and {D}")
    bind_grid(sch)
    for name in ("load_q", "load_do", "load_k", "load_v"):
        tile_in_shared_memory(sch, name, groups, vec, swizzled=False)
    for name in ("load_lse", "load_delta"):
        sch.set_scope(name, 0, "shared.dyn")
        row_block(sch, name, groups)
    _backward_step(sch, (), groups, BN, D, dtype, num_stages, overlap)
    _backward_accumulate(sch, "dq", groups, D, BN, dtype)
    if num_stages > 1:
        pipeline_loads(sch, num_stages)


def _spread_rows(sch, name, groups):
    """A per-row copy of any number of rows over the block's threads."""
    sch.set_scope(name, 0, "shared.dyn")
    _, ty, tx = sch.split(sch.get_loops(name)[-1], [None, groups, WARPGROUP])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")


def _backward_step(sch, casts, groups, cols, D, dtype, num_stages, overlap, b_swizzled=False,
                   swizzle=SWIZZLE_COLUMNS, a_swizzled=False):
    """What dkdv and dq share: s and dp on wgmma ("ss": A and B K-major from shared memory, N =
    ``cols``), p, ds and ``casts`` on the accumulator registers, each thread its elements. With
    ``overlap`` dp's wgmma is only committed: p's exponentials run while it does, and ds waits for
    it. With one stage, s's fence and barrier make the step's tiles visible to both products (dp
    reads none that is written after them). ``swizzle``: a swizzled B's row, in columns."""
    sch.set_scope("init_scale", 0, "local")  # each thread its copy of the scale
    for name in ("qk", "dp"):
        sch.set_scope(name, 0, "local")
        sch.transform_layout(name, ("write", 0), acc_index_map)
        rows = warpgroup_gemm(sch, name, groups)
        sch.tensorize(rows, wgmma_intrin_name(cols, D, dtype, "k", fence_operands=num_stages == 1 and name == "qk",
                                              b_swizzled=b_swizzled, wait=not overlap or name == "qk",
                                              swizzle=swizzle, a_swizzled=a_swizzled))
    for name in ("exp", "ds", *casts):
        sch.set_scope(name, 0, "local")
        sch.transform_layout(name, ("write", 0), acc_index_map)
        acc_block(sch, name, groups)
    if overlap:
        sch.annotate(sch.get_loops("ds")[-3], WGMMA_WAIT_PRAGMA, "dP")  # its first per-thread loop


def _backward_accumulate(sch, name, groups, D, k, dtype, b_swizzled=False, wait=True, swizzle=SWIZZLE_COLUMNS,
                         store=True):
    """A gradient's product on wgmma ("rs": A, the p or ds of the step, from the accumulator
    registers; B N-major from shared memory), the gradient in accumulator registers across the
    steps, zeroed first and stored from them (each thread its pairs of adjacent columns). Without
    ``wait`` only committed: a later product's wait ends it. ``store`` False: the store is left to the caller."""
    sch.set_scope(name, 0, "local")
    sch.transform_layout(name, ("write", 0), acc_index_map)
    block = sch.get_sblock(name)
    rows = warpgroup_gemm(sch, block, groups)
    hide_init_reads(sch, block)
    sch.tensorize(rows, wgmma_intrin_name(D, k, dtype, "mn", a_regs=True, b_swizzled=b_swizzled, wait=wait,
                                          swizzle=swizzle))
    acc_block(sch, f"init_{name}", groups)
    if store:
        acc_block(sch, f"store_{name}", groups)
        sch.vectorize(sch.get_loops(f"store_{name}")[-1])
