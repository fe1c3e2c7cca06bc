"""sm90 (Hopper, sm_90a) schedule: QK^T and PV on ``wgmma.mma_async``.

On sm_90a it is the default at the head_dims it prefers, unless this GPU's tuning records say the
sm80 schedule is faster for a workload (``tvmflash.choice``; ``TVMFLASH_SM90=1`` forces it, 0 turns
it off). wgmma exists on sm_90a alone: no other GPU runs this schedule.

One file per role:
  * ``knobs``: the forward's and the backward's knobs, declared once, with the rules between them,
    the build checks (registers, alignment), the shared-memory models, the kernel attributes and the
    build flags.
  * ``layouts``: the wgmma accumulator's registers, core matrices and swizzled tiles, and the steps
    that put a tile or an accumulator there.
  * ``wgmma``: the wgmma tensor intrinsics and their matrix descriptors.
  * ``forward``: ``schedule``, the forward.
  * ``forward_fp8``: ``schedule_fp8``, the FP8 (e4m3) forward (``SCHEDULE.fp8_forward``).
  * ``backward``: ``schedule_backward``, dkdv and dq.
"""

import sys

from .. import common, simt
from ..contract import Fp8Forward, ProgramSchedule, Schedule, gpu_checked
from .backward import schedule_backward
from .forward import schedule
from .forward_fp8 import schedule_fp8
from .knobs import (ASYNC_PROXY_OPERANDS, BACKWARD, BACKWARD_HEAD_DIMS, BACKWARD_UNCHECKED_HEAD_DIMS, DTYPES, FORWARD,
                    FP8_FORWARD, FP8_HEAD_DIMS, FP8_UNCHECKED_HEAD_DIMS, HEAD_DIMS,
                    HOIST_BLOCK_INDEX_CONDITIONS, PASS_CONFIG, PREFERRED_HEAD_DIMS, STRIDE_ALIGNMENT, kernel_attrs,
                    min_kv_tiles)
from .layouts import acc_rows
from .wgmma import wgmma_intrin_name

__all__ = ["SCHEDULE", "acc_rows", "schedule", "schedule_backward", "schedule_fp8", "wgmma_intrin_name"]

SCHEDULE = Schedule(
    name="sm90", target_kind="cuda", dtypes=DTYPES, compute_capabilities=(90,), stride_alignment=STRIDE_ALIGNMENT,
    pass_config=PASS_CONFIG, async_proxy_operands=ASYNC_PROXY_OPERANDS,
    hoist_block_index_conditions=HOIST_BLOCK_INDEX_CONDITIONS, kernel_attrs=kernel_attrs, min_kv_tiles=min_kv_tiles,
    forward=ProgramSchedule(FORWARD, schedule, head_dims=gpu_checked(HEAD_DIMS), preferred_head_dims=PREFERRED_HEAD_DIMS),
    backward=ProgramSchedule(BACKWARD, schedule_backward, head_dims=BACKWARD_HEAD_DIMS,
                             unchecked_head_dims=BACKWARD_UNCHECKED_HEAD_DIMS),
    fp8_forward=Fp8Forward(FP8_FORWARD, schedule_fp8, FP8_HEAD_DIMS, unchecked_head_dims=FP8_UNCHECKED_HEAD_DIMS),
    # simt: the backward's delta and convert_dq run on its schedule
    sources=(sys.modules[__name__], common, simt),
)
