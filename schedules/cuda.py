"""Portable CUDA schedule (SIMT, no tensor cores): the fallback for any NVIDIA GPU.

One thread block per (batch, head, Q block) and one thread per query row: the row's Q, running
max/sum and output accumulator stay in registers, and each K/V tile is loaded cooperatively into
shared memory with vectorised copies.
"""

from __future__ import annotations

import tvm

from .common import element_bytes

KNOBS = {"block_m": 64, "block_n": 32, "vector_bytes": 16}
# The strides of q, k, v and out are whole 16-byte vectors (``program.attention_forward``'s
# stride_alignment; ``kernel.Kernel`` copies a tensor whose strides are not): the copies move 16 bytes.
STRIDE_ALIGNMENT = 16
# Tuning space (``tvmflash tune``): one MetaSchedule task per (block_m, block_n); vector_bytes is
# sampled inside each task (it may be an ExprRV).
SPACE = {"block_m": [32, 64, 128], "block_n": [16, 32, 64], "vector_bytes": [4, 8, 16]}
# The values a knob may take, where not any positive int (``schedules.knob_problem``): a copy moves
# at least one float32 and at most 16 bytes.
CHOICES = {"vector_bytes": (4, 8, 16)}

# Blocks that work on one query row each: their row loop becomes threadIdx.x.
_ROW_BLOCKS = ("load_q", "init_ml", "init_acc", "qk", "score", "row_max", "exp", "alpha", "row_sum", "cast_p", "pv",
               "merge_l", "update_ml", "inv_l", "store_o", "store_lse")


def shared_memory_bytes(head_dim: int, dtype: str, knobs: dict) -> int:
    """Shared memory a build with these knobs needs: one K tile and one V tile."""
    return 2 * knobs["block_n"] * head_dim * tvm.DataType(dtype).bits // 8


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
    sch.set_scope("init_scale", 0, "local")
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


# The backward (``tvmflash.program_backward``). dkdv runs one thread per key (block_n threads): the
# key's rows of K, V, dk and dv, and its column of each (block_m, block_n) tile, stay in its
# registers; the Q and dout blocks are copied into shared memory, where every thread reads the same
# element at a time (a broadcast). dq runs one thread per query row (block_m threads), as the
# forward does, with the K and V blocks in shared memory.
BACKWARD_KNOBS = {"block_m": 32, "block_n": 32, "vector_bytes": 16}
BACKWARD_KNOBS_FOR_HEAD_DIM = {256: {"block_m": 16, "block_n": 16}}  # float32 tiles within 48 KiB
BACKWARD_SPACE = {"block_m": [16, 32, 64], "block_n": [16, 32, 64, 128], "vector_bytes": [4, 8, 16]}
BACKWARD_SHARED_MEMORY_LIMIT = 48 * 1024  # static shared memory, whatever the GPU allows with opt-in


def backward_shared_memory_bytes(head_dim: int, dtype: str, knobs: dict) -> int:
    """Shared memory of the larger backward program: dkdv's Q and dout blocks (and its rows'
    lse and delta), or dq's K and V blocks."""
    element = tvm.DataType(dtype).bits // 8
    return max(2 * knobs["block_m"] * (head_dim * element + 4), 2 * knobs["block_n"] * head_dim * element)


def schedule_backward(sch: tvm.s_tir.Schedule, *, block_m: int, block_n: int,
                      vector_bytes: int) -> tvm.s_tir.Schedule:
    """Map the backward programs onto CUDA threads (see above). vector_bytes: the width of the
    global -> shared copies (an int, or a ``sample_categorical`` ExprRV when the tuner samples it)."""
    schedule_delta(sch)
    schedule_backward_program(sch, "dkdv", block_n, vector_bytes)
    schedule_backward_program(sch, "dq", block_m, vector_bytes)
    return sch


def schedule_delta(sch: tvm.s_tir.Schedule) -> None:
    """The delta program: one thread a query row, 128 a thread block."""
    sch.work_on("delta")
    b, i, h, _ = sch.get_loops("delta")
    blocks, threads = sch.split(sch.fuse(b, i, h), [None, 128])
    sch.bind(blocks, "blockIdx.x")
    sch.bind(threads, "threadIdx.x")


def schedule_backward_program(sch: tvm.s_tir.Schedule, func: str, threads: int, vector_bytes) -> None:
    """The dkdv program (one thread a key, ``threads`` = block_n) or the dq program (one thread a
    query row, ``threads`` = block_m) on SIMT threads."""
    per_thread, shared = {
        "dkdv": (("load_k", "load_v", "init_dkdv", "qk", "exp", "cast_p", "dv", "dp", "ds", "dk", "store_dk",
                  "store_dv"), ("load_q", "load_do")),
        "dq": (("load_q", "load_do", "load_lse", "init_dq", "qk", "exp", "dp", "ds", "dq", "store_dq"),
               ("load_k", "load_v"))}[func]
    sch.work_on(func)
    sch.bind(sch.fuse(*sch.get_loops("tile")), "blockIdx.x")
    for name in per_thread:
        loops = sch.get_loops(name)
        # the loop over this thread's row (dkdv: the key j, second in the (i, j) tiles) goes first
        row = loops[1] if func == "dkdv" and name in ("qk", "exp", "cast_p", "dp", "ds") else loops[0]
        if row != loops[0]:
            sch.reorder(row, loops[0])
        sch.bind(row, "threadIdx.x")
    for name in shared:
        _copy_to_shared(sch, name, threads, vector_bytes)
    if func == "dkdv":  # the rows' lse and delta: one thread a row
        sch.set_scope("load_lse", 0, "shared")
        sch.set_scope("load_lse", 1, "shared")
        outer, tx = sch.split(sch.get_loops("load_lse")[0], [None, threads])
        sch.bind(tx, "threadIdx.x")
    # Per-thread state in registers (compaction keeps the thread's row or column).
    own = {"dkdv": [("load_k", 0), ("load_v", 0), ("init_dkdv", 0), ("init_dkdv", 1), ("cast_p", 0)],
           "dq": [("load_q", 0), ("load_do", 0), ("load_lse", 0), ("load_lse", 1), ("init_dq", 0)]}[func]
    for name, index in [("init_scale", 0), ("qk", 0), ("exp", 0), ("dp", 0), ("ds", 0)] + own:
        sch.set_scope(name, index, "local")
    # Each product's inner loop unrolled; its outer loop kept (ptxas unrolled it too at head_dim
    # 64 in float32, and spilled 12-19 KiB a thread).
    for name in ("qk", "dp") + (("dv", "dk") if func == "dkdv" else ("dq",)):
        sch.decompose_reduction(name, sch.get_loops(name)[2])
        outer, inner = sch.get_loops(f"{name}_update")[-2:]
        sch.unroll(inner)
        sch.annotate(outer, "disable_unroll", True)
