"""Portable CUDA schedule (SIMT, no tensor cores): the fallback for any NVIDIA GPU, and what serves
float32 and the head_dims the tensor-core schedules do not.

The forward: one thread block per (batch, head, Q block) and one thread per query row: the row's Q,
running max/sum and output accumulator stay in registers, and each K/V tile is loaded cooperatively
into shared memory with vectorised copies. The backward and the decode are mapped further down. The
knobs of all three come first.
"""

from __future__ import annotations

import sys

import tvm

from tvmflash.lowering.annotations import MERGED_ATOMIC_ADD_PRAGMA

from . import common
from .common import element_bytes, pipeline_loads, read_index, scalars_local
from .contract import TILE, DecodeTasks, Knob, KnobSet, ProgramSchedule, Schedule, gpu_checked

# ------------------------------------------------------------------------------------------------
# knobs: the forward's, the backward's and the decode's, their checks and shared-memory models
# ------------------------------------------------------------------------------------------------
# The strides of q, k, v and out are whole 16-byte vectors (``program_forward.attention_forward``'s
# stride_alignment; a kernel copies a tensor whose strides are not): the copies move 16 bytes.
STRIDE_ALIGNMENT = 16
DTYPES = ("float16", "bfloat16", "float32")
VECTOR_BYTES = (4, 8, 16)  # a copy moves at least one float32 and at most 16 bytes


def shared_memory_bytes(head_dim: int, dtype: str, knobs: dict) -> int:
    """Shared memory a build with these knobs needs: one K tile and one V tile."""
    return 2 * knobs["block_n"] * head_dim * tvm.DataType(dtype).bits // 8


# One MetaSchedule task per (block_m, block_n); vector_bytes is sampled inside each task (an ExprRV).
# The K and V tiles are static shared memory, 48 KiB at most (ptxas refuses more): float32 from
# head_dim 200 takes 16-key tiles (``choice.fit_shared_memory``).
FORWARD = KnobSet("simt", "forward", (
    Knob("block_m", 64, space=(32, 64, 128), role=TILE),
    Knob("block_n", 32, space=(16, 32, 64), role=TILE),
    Knob("vector_bytes", 16, choices=VECTOR_BYTES, space=VECTOR_BYTES),
), shared_memory=shared_memory_bytes, shared_memory_limit=48 * 1024)


def backward_shared_memory_bytes(head_dim: int, dtype: str, knobs: dict) -> int:
    """Shared memory of the larger backward program: dkdv's Q and dout blocks (and its rows'
    lse and delta), or dq's K and V blocks."""
    element = tvm.DataType(dtype).bits // 8
    return max(2 * knobs["block_m"] * (head_dim * element + 4), 2 * knobs["block_n"] * head_dim * element)


# The backward (``schedule_backward``): its own tiles, as they need not be the forward's; at d256 the
# float32 tiles fit 48 KiB, the static shared memory it is limited to whatever the GPU allows with opt-in.
BACKWARD = KnobSet("simt", "backward", (
    Knob("block_m", 32, space=(16, 32, 64), by_head_dim={256: 16}, role=TILE),
    Knob("block_n", 32, space=(16, 32, 64, 128), by_head_dim={256: 16}, role=TILE),
    Knob("vector_bytes", 16, choices=VECTOR_BYTES, space=VECTOR_BYTES),
), shared_memory=backward_shared_memory_bytes, shared_memory_limit=48 * 1024)


# The decode (``schedule_decode``). query_tokens: query tokens per task (its rows: those tokens
# times the GQA group's heads); block_n: keys per K/V tile, a multiple of threads (each thread owns
# block_n / threads keys of a tile in Q Kᵀ); threads: per thread block; vector_bytes: the width of
# each thread's K/V copies. num_stages: 1 copies each K/V tile with plain vector loads at the top of
# its step; 2 or 3 make the K/V-tile loop a cp.async software pipeline (common.pipeline_loads),
# tiles num_stages - 1 ahead.
# Defaults (chosen by reasoning from the generated code, not yet measured against the other sets;
# benchmarks/decode_bench.py --knobs compares them): one warp a task, owning its keys with its own
# running max and sum (no barrier across warps), one key a lane, 32-key tiles in two stages,
# unrolled, each thread its own row max: 37 KiB of shared memory for GQA 32/8, six tasks an SM.
# row_max: "shuffle" reduces each row's tile max across the threads (TVM's cross-thread reduction:
# warp shuffles, a row at a time, and two barriers a row in a block of several warps); "each_thread"
# has every thread reduce the whole tile's masked scores from shared memory itself (all rows at
# once, independent loads: no shuffle chain, no barrier beyond the one after the scores; block_n *
# rows reads a thread, so for one-warp tasks). unroll: 1 unrolls Q Kᵀ's head_dim steps and P V's
# keys (independent shared loads in flight: one warp a task has little else to hide their latency
# with), 0 leaves the loops to nvcc (which unrolls P V by 4 and Q Kᵀ not at all).
DECODE_PASS_CONFIG = {
    "tirx.use_async_copy": True,  # cp.async for the pipelined K/V copies
    # StorageRewrite retypes the K tile, read only 8 elements at a time, as bfloat16x8, and
    # InjectPTXAsyncCopy (TVM 0.27) then fails on the vector store index its copies meet.
    "tirx.disable_storage_rewrite": True,
}
# Shared rows of the K tiles are padded by 16 bytes: a quarter-warp's 16-byte reads of 8 rows (one
# key each, Q Kᵀ) then fall in 8 different groups of 4 banks. V's rows are not: P V reads one key's
# row across the threads, contiguous, and the 16 bytes a row saved let six one-warp tasks of GQA
# 32/8 fit an SM's 228 KiB instead of five.
_ROW_PAD_BYTES = 16


def decode_shared_memory_bytes(head_dim: int, dtype: str, knobs: dict, group: int = 8) -> int:
    """Shared memory of a decode task: the K tiles (padded rows) and V tiles, the query rows and the
    per-key buffers of the scores, P and the row sums (float32), for a GQA group of ``group``
    query heads (default 8, the largest usual one: an upper bound)."""
    element = tvm.DataType(dtype).bits // 8
    rows = group * knobs["query_tokens"]
    return (knobs["num_stages"] * knobs["block_n"] * (2 * head_dim * element + _ROW_PAD_BYTES)
            + 3 * rows * knobs["block_n"] * 4 + rows * head_dim * 4 + 64)


def decode_tasks_per_sm(head_dim: int, dtype: str, knobs: dict, group: int = 8) -> int:
    """Thread blocks of the split kernel that one SM holds at once (by shared memory and threads;
    228 KiB and 2048 threads an SM, sm80 to sm90, 1 KiB reserved a block), for choosing the split
    count."""
    by_shared = (228 * 1024) // (decode_shared_memory_bytes(head_dim, dtype, knobs, group) + 1024)
    return max(1, min(by_shared, 2048 // knobs["threads"], 32))


def decode_rules(knobs: dict) -> str | None:
    """Why these decode knobs do not go together, or None."""
    if knobs["block_n"] % knobs["threads"]:
        return f"block_n ({knobs['block_n']}) must be a multiple of threads ({knobs['threads']})"
    return None


# The head_dims decode builds at (cross-compiled and through nvcc at every multiple of 8): the
# accumulator's (row, column) pairs split over the threads evenly only at multiples of 32 (else
# ``blockize`` fails on the split's predicate). The forward and the backward build at every multiple of 8.
DECODE_HEAD_DIMS = tuple(range(32, 257, 32))


def decode_build_problem(head_dim: int, dtype: str, knobs: dict) -> str | None:
    """Why these decode knobs cannot build at this head_dim and dtype, or None."""
    if (head_dim * tvm.DataType(dtype).bits // 8) % knobs["vector_bytes"]:
        return f"vector_bytes ({knobs['vector_bytes']}) must divide a row of head_dim {head_dim} {dtype}"
    return None


DECODE = KnobSet("simt", "decode", (
    Knob("query_tokens", 1, space=(1, 2, 4)),
    Knob("block_n", 32, space=(32, 64, 128, 256)),
    Knob("threads", 32, space=(32, 64, 128, 256)),
    Knob("vector_bytes", 16, choices=VECTOR_BYTES, space=VECTOR_BYTES),
    Knob("num_stages", 2, choices=(1, 2, 3), space=(1, 2, 3)),
    Knob("row_max", "each_thread", choices=("shuffle", "each_thread"), space=("shuffle", "each_thread")),
    Knob("unroll", 1, choices=(0, 1), space=(0, 1)),
), rules=decode_rules, build_problem=decode_build_problem, shared_memory=decode_shared_memory_bytes)


# ------------------------------------------------------------------------------------------------
# the forward (tvmflash.program)
# ------------------------------------------------------------------------------------------------
# Blocks that work on one query row each: their row loop becomes threadIdx.x.
_ROW_BLOCKS = ("load_q", "init_ml", "init_acc", "qk", "score", "row_max", "exp", "alpha", "row_sum", "cast_p", "pv",
               "merge_l", "update_ml", "inv_l", "store_o", "store_lse")


def schedule(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int, vector_bytes: int) -> tvm.s_tir.Schedule:
    """Map the attention program onto CUDA threads: block_m threads, one per query row.

    vector_bytes: the width of each thread's global -> shared copies (an int, or a
    ``sample_categorical`` ExprRV when the tuner samples it).
    """
    tile = sch.get_sblock("tile")
    sch.bind(sch.fuse(*sch.get_loops(tile)), "blockIdx.x")
    for name in _ROW_BLOCKS:
        sch.bind(sch.get_loops(name)[0], "threadIdx.x")
    # Per-row state lives in registers (compaction keeps one row per thread).
    for name, index in [("load_q", 0), ("init_ml", 0), ("init_ml", 1), ("init_acc", 0), ("qk", 0),
                        ("score", 0), ("row_max", 0), ("exp", 0), ("alpha", 0), ("alpha", 1), ("row_sum", 0),
                        ("merge_l", 0), ("inv_l", 0), ("cast_p", 0)]:
        sch.set_scope(name, index, "local")
    scalars_local(sch)
    # K/V tiles: all threads copy them into shared memory, vector_bytes at a time.
    for name in ("load_k", "load_v"):
        _copy_to_shared(sch, name, block_m, vector_bytes)
    # After binding and scoping: a decomposed update block is no longer a reduction block.
    sch.decompose_reduction("qk", sch.get_loops("qk")[2])
    sch.decompose_reduction("pv", sch.get_loops("pv")[2])
    for name in ("qk_update", "pv_update"):
        sch.unroll(sch.get_loops(name)[-1])
    return sch


def _copy_to_shared(sch, name, threads, vector_bytes):
    """A (rows, head_dim) load block into shared memory, copied by all ``threads`` threads,
    vector_bytes at a time."""
    sch.set_scope(name, 0, "shared")
    rows, d = sch.get_loops(name)[-2:]
    d, vec = sch.split(d, [None, vector_bytes // element_bytes(sch, name)])  # each vector is one row's slice
    _, tx = sch.split(sch.fuse(rows, d), [None, threads])
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)


# ------------------------------------------------------------------------------------------------
# the backward (tvmflash.program_backward): delta, dkdv and dq on SIMT threads
# ------------------------------------------------------------------------------------------------
# dkdv runs one thread per key (block_n threads): the key's rows of K, V, dk and dv, and its column
# of each (block_m, block_n) tile, stay in its registers; the Q and dout blocks are copied into shared
# memory, where every thread reads the same element at a time (a broadcast). dq runs one thread per
# query row (block_m threads), as the forward does, with the K and V blocks in shared memory.
def schedule_backward(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int,
                      vector_bytes: int) -> tvm.s_tir.Schedule:
    """Map the backward programs onto CUDA threads (see above). vector_bytes: the width of the
    global -> shared copies (an int, or a ``sample_categorical`` ExprRV when the tuner samples it)."""
    schedule_delta(sch)
    schedule_backward_program(sch, "dkdv", block_n, vector_bytes)
    schedule_backward_program(sch, "dq", block_m, vector_bytes)
    return sch


def schedule_delta(sch: tvm.s_tir.Schedule) -> None:
    """The delta program: each query row's sum over head_dim by a group of lanes, each lane 16 bytes
    of out and of dout (one vector load each), then shuffles (TVM's cross-thread reduction), and the
    row's delta and lse2 written from the sum in registers. (A thread a row, looping over head_dim,
    measured far slower: it reads out and dout with little of the memory bandwidth.)"""
    sch.work_on("delta")
    b, i, h, d = sch.get_loops("delta")
    reads = sch.get(sch.get_sblock("delta")).reads
    operands = [n for n, region in enumerate(reads) if region.source.name in ("dO", "O")]
    vector = 16 * 8 // tvm.DataType(str(reads[operands[0]].source.dtype)).bits
    lanes = int(sch.get(d).extent) // vector
    rows, row = sch.split(sch.fuse(b, i, h), [None, max(1, 256 // lanes)])
    lane, _ = sch.split(d, [lanes, vector])
    for operand in operands:  # dout and out: each lane's 16 bytes in one vector load
        loaded = sch.cache_read("delta", operand, "local")
        sch.compute_at(loaded, lane)
        sch.vectorize(sch.get_loops(loaded)[-1])
    sch.reverse_compute_at("finish_rows", row)
    sch.set_scope("delta", 0, "local")
    sch.bind(rows, "blockIdx.x")
    sch.bind(row, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")


def schedule_convert_dq(sch: tvm.s_tir.Schedule, threads: int = 256) -> None:
    """The convert_dq program (dq = dq_accum · scale, rounded): elementwise, each thread four
    consecutive floats (one 16-byte load)."""
    sch.work_on("convert_dq")
    loops = sch.get_loops("convert_dq")
    fused = sch.fuse(*loops[:-1])
    d0, d1 = sch.split(loops[-1], [None, 4])
    bx, tx = sch.split(sch.fuse(fused, d0), [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(d1)


def schedule_backward_program(sch: tvm.s_tir.Schedule, func: str, threads: int, vector_bytes) -> None:
    """The dkdv program (one thread a key, ``threads`` = block_n) or the dq program (one thread a
    query row, ``threads`` = block_m) on SIMT threads."""
    per_thread, shared = {
        "dkdv": (("load_k", "load_v", "init_dk", "init_dv", "qk", "exp", "cast_p", "dv", "dp", "ds", "dk", "store_dk",
                  "store_dv"), ("load_q", "load_do")),
        "dq": (("load_q", "load_do", "load_lse", "load_delta", "init_dq", "qk", "exp", "dp", "ds", "dq", "store_dq"),
               ("load_k", "load_v"))}[func]
    sch.work_on(func)
    sch.bind(sch.fuse(*sch.get_loops("tile")), "blockIdx.x")
    for name in per_thread:
        sch.bind(sch.get_loops(name)[0], "threadIdx.x")  # this thread's row: its key or its query
    for name in shared:
        _copy_to_shared(sch, name, threads, vector_bytes)
    if func == "dkdv":  # the rows' lse and delta: one thread a row
        for name in ("load_lse", "load_delta"):
            sch.set_scope(name, 0, "shared")
            outer, tx = sch.split(sch.get_loops(name)[0], [None, threads])
            sch.bind(tx, "threadIdx.x")
    # Per-thread state in registers (compaction keeps the thread's row or column).
    own = {"dkdv": [("load_k", 0), ("load_v", 0), ("init_dk", 0), ("init_dv", 0), ("cast_p", 0)],
           "dq": [("load_q", 0), ("load_do", 0), ("load_lse", 0), ("load_delta", 0), ("init_dq", 0)]}[func]
    for name, index in [("init_scale", 0), ("qk", 0), ("exp", 0), ("dp", 0), ("ds", 0)] + own:
        sch.set_scope(name, index, "local")
    if func == "dkdv" and common.has_block(sch, "capture_gradient"):  # a learned capture's gradient
        sch.bind(sch.get_loops("capture_gradient")[0], "threadIdx.x")  # this thread's key, its queries in turn
        # 1: each thread its own runs (block_n may be 16: no whole warps for a warp's sum)
        sch.annotate(sch.get_loops("capture_gradient")[1], MERGED_ATOMIC_ADD_PRAGMA, 1)
    # Each product's inner loop unrolled; its outer loop kept (ptxas unrolled it too at head_dim
    # 64 in float32, and spilled kilobytes a thread).
    for name in ("qk", "dp") + (("dv", "dk") if func == "dkdv" else ("dq",)):
        sch.decompose_reduction(name, sch.get_loops(name)[2])
        outer, inner = sch.get_loops(f"{name}_update")[-2:]
        sch.unroll(inner)
        sch.annotate(outer, "disable_unroll", True)


# ------------------------------------------------------------------------------------------------
# decode (tvmflash.program_decode): the split program and the merge program, on SIMT threads
# ------------------------------------------------------------------------------------------------
def schedule_decode(sch: tvm.s_tir.Schedule, *, query_tokens: int, block_n: int, threads: int,
                    vector_bytes: int, num_stages: int, row_max: str = "shuffle",
                    unroll: int = 0) -> tvm.s_tir.Schedule:
    """Map the decode programs (functions ``split``, ``single`` and ``merge``) onto SIMT CUDA threads.

    split: one thread block of ``threads`` per task: blockIdx.x = (sequence, K/V head), y = query
    block, z = split. The K/V tiles are copied into shared memory (K's rows padded, vector_bytes a
    copy, coalesced). In Q Kᵀ each thread owns keys of the tile: it reads its K row 16 bytes at a
    time and the query rows (float32, shared, broadcast) alike, so the GQA group's heads share one
    read of the tile. The row max: row_max="shuffle" reduces across the threads (TVM's cross-thread
    reduction: warp shuffles, then shared memory), "each_thread" has every thread reduce the whole
    tile from shared memory; the row sums stay per thread and reduce once, after the last tile.
    unroll=1 unrolls Q Kᵀ's head_dim steps and P V's keys. In P V
    each thread owns (row, head_dim column) pairs of the output, in registers, and loops over the
    tile's keys reading V (shared) and P (shared, stored key-major so that one vector read
    broadcasts a key's P for every row). The per-row running max and rescale factor are replicated
    in every thread's registers.

    single (when the module has it): the split program writing the output itself (one split, no
    merge), scheduled as split.

    merge: ``schedule_decode_merge``.
    """
    names = {gv.name_hint for gv in sch.mod.functions}
    for func in [name for name in ("split", "single") if name in names]:  # single: the split program, final
        sch.work_on(func)
        element = element_bytes(sch, "load_k")
        rows, head_dim = (int(x) for x in sch.get(sch.get_sblock("load_q")).writes[0].source.shape)

        b, hk, qb, s = sch.get_loops("tile")
        sch.bind(sch.fuse(b, hk), "blockIdx.x")  # a constant inner extent: cheap index arithmetic
        sch.bind(qb, "blockIdx.y")
        sch.bind(s, "blockIdx.z")

        def by_threads(loops):
            """Fuse ``loops`` and spread them over the threads (the inner part bound)."""
            _, tx = sch.split(sch.fuse(*loops), [None, threads])
            sch.bind(tx, "threadIdx.x")

        def keys_by_threads(block, rows_inside=True):
            """The (row, key) loops of a per-key block: keys over the threads, rows inside (or outside,
            as a cross-thread reduction needs its reduced loops innermost)."""
            r, j = sch.get_loops(block)[-2:]
            jt, jo = sch.split(j, [threads, None])  # thread t: keys t * k .. t * k + k - 1 (compact registers)
            sch.reorder(*((jt, jo, r) if rows_inside else (r, jo, jt)))
            sch.bind(jt, "threadIdx.x")
            if rows_inside:  # they index the thread's registers: unrolled, their indices are constants
                sch.unroll(jo)
                sch.unroll(r)

        # Per-task and per-row values: every thread computes and keeps its own copy.
        for name, index in [("init_scale", 0), ("split_range", 0), ("init_m", 0), ("alpha", 0), ("alpha", 1),
                            ("inv_l", 0)]:
            sch.set_scope(name, index, "local")
        for name in ("init_m", "alpha", "update_m", "inv_l"):
            sch.unroll(sch.get_loops(name)[-1])

        sch.set_scope("load_q", 0, "shared")
        by_threads(sch.get_loops("load_q")[-2:])

        # The output accumulator, in registers: each thread owns rows_inner rows of head_dim columns
        # (the same ones in every block that touches it); rows_inner rows of one key's P are one read.
        rows_inner = max(1, min(rows, rows * head_dim // threads))
        while rows % rows_inner:
            rows_inner -= 1

        def acc_by_threads(block, rows_inner=rows_inner):
            """The (row, column) loops of a block over the accumulator (P V: and its key loop inside) as
            thread, [key,] column, row: thread t owns consecutive (row group, column) pairs, so that its
            registers compact to exactly its own, and reads V and P once a key for all of them."""
            r, d = sch.get_loops(block)[-3:-1] if block == "pv" else sch.get_loops(block)[-2:]
            keys = sch.get_loops(block)[-1:] if block == "pv" else []
            r_outer, r_inner = sch.split(r, [None, rows_inner])
            sch.reorder(r_outer, d, *keys, r_inner)
            tx, columns = sch.split(sch.fuse(r_outer, d), [threads, None])
            sch.reorder(tx, *keys, columns, r_inner)
            sch.bind(tx, "threadIdx.x")
            sch.unroll(columns)
            sch.unroll(r_inner)

        for name in ("init_acc", "pv", "store_o"):
            acc_by_threads(name)
        sch.set_scope("init_acc", 0, "local")

        # K/V tiles: coalesced vector copies into shared rows (K's padded).
        vector = vector_bytes // element
        for name in ("load_k", "load_v"):
            sch.set_scope(name, 0, "shared.dyn")
            if name == "load_k":
                sch.storage_align(name, 0, axis=0, factor=head_dim, offset=_ROW_PAD_BYTES // element)
            j, d = sch.get_loops(name)[-2:]
            d, vec = sch.split(d, [None, vector])
            by_threads([j, d])
            sch.vectorize(vec)

        # Q Kᵀ: thread t owns keys t, t + threads, ...; per 16 bytes of its K row (a local copy), it
        # reads the same columns of every query row (local copies too) and keeps its scores in registers.
        r, j, d = sch.get_loops("qk")[-3:]
        jt, jo = sch.split(j, [threads, None])
        d_outer, d_inner = sch.split(d, [None, 16 // element])
        sch.reorder(jt, jo, d_outer, r, d_inner)
        sch.bind(jt, "threadIdx.x")
        sch.unroll(jo)
        sch.set_scope("qk", 0, "local")
        sch.decompose_reduction("qk", d_outer)
        update = sch.get_sblock("qk_update")
        sch.unroll(r)
        sch.unroll(d_inner)
        # kv_step is not a stage pipeline (pv and update_m write acc and m after other blocks read
        # them), so no block can be computed at a loop under it: the update's loop nest gets a block of
        # its own, and the local copies go in there.
        sch.blockize(d_outer)
        qk_d_outer = d_outer
        for buffer in ("Kt", "Qt"):
            copy = sch.cache_read(update, read_index(sch, update, buffer), "local")
            sch.compute_at(copy, d_outer)
            _vectorize_rows(sch, copy, 16)

        for name in ("score", "exp", "sum_p", "init_l", "update_l"):
            keys_by_threads(name)
        sch.set_scope("sum_p", 0, "local")
        # The running per-key sums in shared memory: the row sum after the last tile reads them in a loop
        # over the rows that stays rolled (it holds a cross-thread reduction), where registers would be
        # indexed dynamically, and spill from 8 rows up.
        sch.set_scope("init_l", 0, "shared")
        # The masked scores in shared memory: the row max reads them in a loop over the rows that stays
        # rolled (it holds a cross-thread reduction), where registers would be indexed dynamically.
        sch.set_scope("score", 0, "shared")
        # P: every thread reads every key's, key-major: P[j, 0:rows] is one broadcast vector read.
        sch.set_scope("exp", 0, "shared")
        sch.transform_layout("exp", ("write", 0), lambda r, j: (j, r))
        # The row max across the threads (the key loop bound: TVM lowers it with shuffles); the row
        # sums once, after the last tile.
        # The results go to shared memory: the row loop around a cross-thread reduction stays rolled
        # (TVM 0.27's LowerThreadAllreduce fails on an unrolled one), and a register array indexed by
        # a rolled loop would be a stack array.
        if row_max == "each_thread":  # every thread reduces every key of the tile, all rows at once, in registers
            sch.set_scope("row_max", 0, "local")
            for loop in sch.get_loops("row_max")[-2:]:
                sch.unroll(loop)
        else:
            keys_by_threads("row_max", rows_inside=False)
            sch.set_scope("row_max", 0, "shared")
        keys_by_threads("row_sum", rows_inside=False)
        sch.set_scope("row_sum", 0, "shared")

        # P V: keys serial in each thread; a key's P for the thread's rows, and its V for the thread's
        # columns, read once each (vector reads into registers).
        pv_j = sch.get_loops("pv")[-3]
        sch.decompose_reduction("pv", pv_j)
        pv = sch.get_sblock("pv_update")
        sch.blockize(pv_j)  # a scope for the local copies (as in Q Kᵀ)
        for buffer in ("P", "Vt"):
            copy = sch.cache_read(pv, read_index(sch, pv, buffer), "local")
            sch.compute_at(copy, pv_j)
            _vectorize_rows(sch, copy, 16)
        if unroll:  # every key's loads issued ahead of its FMAs (after the copies went in: compute_at needs the loop)
            sch.unroll(pv_j)
            sch.unroll(qk_d_outer)

        if num_stages > 1:
            pipeline_loads(sch, num_stages)

        # Each thread writes the (same) LSE of every row: a row bound to a thread would index the
        # per-row registers by threadIdx, which puts them on the stack.
        sch.unroll(sch.get_loops("store_lse")[-1])

    schedule_decode_merge(sch)
    return sch


def schedule_decode_merge(sch: tvm.s_tir.Schedule) -> None:
    """The merge of a decode module (function ``merge``): one thread block per (sequence, token, head),
    blockIdx.x = (token, head), y = sequence; one thread per head_dim column; the LSE max and sum
    across the threads, a split a thread."""
    sch.work_on("merge")
    b, t, h = sch.get_loops("row")
    sch.bind(sch.fuse(t, h), "blockIdx.x")
    sch.bind(b, "blockIdx.y")
    columns = int(sch.get(sch.get_loops("store_o")[-1]).extent)  # head_dim: the block's threads
    # The splits' LSE max and sum across the threads (a split a thread: one round trip to memory for
    # all of them, not one a split), the results in every thread's registers.
    sch.set_scope("finite_max", 0, "local")
    for name in ("lse_max", "lse_sum"):
        sch.set_scope(name, 0, "local")
        _, s_threads = sch.split(sch.get_loops(name)[-1], [None, columns])
        sch.bind(s_threads, "threadIdx.x")
    # Each thread a head_dim column; the splits' partial outputs read MERGE_UNROLL at a time.
    d, s = sch.get_loops("merge_o")[-2:]
    sch.bind(d, "threadIdx.x")
    sch.set_scope("merge_o", 0, "local")
    sch.decompose_reduction("merge_o", s)
    _, s_inner = sch.split(s, [None, MERGE_UNROLL])
    sch.unroll(s_inner)
    sch.bind(sch.get_loops("store_o")[-1], "threadIdx.x")


MERGE_UNROLL = 8  # splits whose partial outputs a merge thread has in flight at once


def _vectorize_rows(sch, block, vector_bytes: int) -> None:
    """Vectorize the inner loop of a copy block (rows of one buffer), vector_bytes at a time."""
    loop = sch.get_loops(block)[-1]
    if not hasattr(sch.get(loop).body, "block") or not sch.get(loop).body.block.same_as(sch.get(block)):
        return  # a copy of one element: no loop of its own (this one is its consumer's)
    extent = int(sch.get(loop).extent)
    lanes = min(extent, vector_bytes // (tvm.DataType(str(sch.get(block).writes[0].source.dtype)).bits // 8))
    lanes = 1 << (lanes.bit_length() - 1)
    while extent % lanes:  # the widest power of two that divides the loop (a vector type exists for it)
        lanes //= 2
    if lanes > 1:
        _, inner = sch.split(loop, [None, lanes])
        sch.vectorize(inner)


SCHEDULE = Schedule(
    name="simt", target_kind="cuda", dtypes=DTYPES, stride_alignment=STRIDE_ALIGNMENT,
    forward=ProgramSchedule(FORWARD, schedule, head_dims=gpu_checked()),
    backward=ProgramSchedule(BACKWARD, schedule_backward, head_dims=gpu_checked()),
    decode=ProgramSchedule(DECODE, schedule_decode, head_dims=gpu_checked(DECODE_HEAD_DIMS), pass_config=DECODE_PASS_CONFIG,
                           tasks=DecodeTasks(per_processor=decode_tasks_per_sm)),
    sources=(sys.modules[__name__], common),
    fallback=True,  # the products on CUDA cores: the torch API pads to a tensor-core schedule's head_dim first
)
