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
    vector = vector_bytes // element_bytes(sch, "load_k")
    for name in ("load_k", "load_v"):
        sch.set_scope(name, 0, "shared")
        j, d = sch.get_loops(name)[-2:]
        d, vec = sch.split(d, [None, vector])  # split d itself, so each vector is one row's slice
        _, tx = sch.split(sch.fuse(j, d), [None, block_m])
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(vec)
    # After binding and scoping: a decomposed update block is no longer a reduction block.
    sch.decompose_reduction("qk", sch.get_loops("qk")[2])
    sch.decompose_reduction("pv", sch.get_loops("pv")[2])
    for name in ("qk_update", "pv_update"):
        sch.unroll(sch.get_loops(name)[-1])
    return sch
