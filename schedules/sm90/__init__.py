"""sm90 (Hopper, sm_90a) schedule: QK^T and PV on ``wgmma.mma_async``.

On sm_90a it is the default, unless the tuning records say the sm80 schedule is faster for a
workload (``tvmflash.kernel.choose_schedule``; ``TVMFLASH_SM90=1`` forces it, 0 turns it off).
Correct on the H200 (the GPU tests pass with it). BENCHMARKS.md has its H200 grids.

One file per role:
  * ``knobs``: the knob tables (defaults, per head_dim, varlen, backward), their values and tuning
    spaces, the knob checks, the shared-memory model, the kernel attributes and the build flags.
  * ``layouts``: the wgmma accumulator's registers, core matrices and swizzled tiles, and the steps
    that put a tile or an accumulator there.
  * ``wgmma``: the wgmma tensor intrinsics and their matrix descriptors.
  * ``forward``: ``schedule``, the forward.
  * ``backward``: ``schedule_backward``, dkdv and dq.
"""

from .backward import schedule_backward
from .forward import schedule
from .knobs import (ASYNC_PROXY_OPERANDS, BACKWARD_HEAD_DIMS, BACKWARD_KNOBS, BACKWARD_KNOBS_FOR_HEAD_DIM,
                    BACKWARD_SPACE, BACKWARD_VARLEN_KNOBS_FOR_HEAD_DIM, CHOICES, DTYPES, HOIST_BLOCK_INDEX_CONDITIONS,
                    KNOBS, KNOBS_FOR_HEAD_DIM, PASS_CONFIG, PROGRAM_KNOBS, SM80_HEAD_DIMS, SPACE, STRIDE_ALIGNMENT,
                    STRUCTURE_KNOBS, VARLEN_KNOBS, backward_knobs_problem, backward_shared_memory_bytes, kernel_attrs,
                    knobs_problem, min_kv_tiles, register_problem, shared_memory_bytes, valid_knobs)
from .layouts import acc_rows
from .wgmma import wgmma_intrin_name

__all__ = [
    "ASYNC_PROXY_OPERANDS", "BACKWARD_HEAD_DIMS", "BACKWARD_KNOBS", "BACKWARD_KNOBS_FOR_HEAD_DIM", "BACKWARD_SPACE",
    "BACKWARD_VARLEN_KNOBS_FOR_HEAD_DIM", "CHOICES", "DTYPES", "HOIST_BLOCK_INDEX_CONDITIONS", "KNOBS",
    "KNOBS_FOR_HEAD_DIM", "PASS_CONFIG", "PROGRAM_KNOBS", "SM80_HEAD_DIMS", "SPACE", "STRIDE_ALIGNMENT",
    "STRUCTURE_KNOBS", "VARLEN_KNOBS", "acc_rows", "backward_knobs_problem", "backward_shared_memory_bytes",
    "kernel_attrs", "knobs_problem", "min_kv_tiles", "register_problem", "schedule", "schedule_backward",
    "shared_memory_bytes", "valid_knobs", "wgmma_intrin_name",
]
