"""The sm80 schedule: the attention programs on tensor cores (mma.sync m16n8k16 and ldmatrix), for
fp16 and bf16 on sm80 and newer GPUs.

One module a role: ``knobs`` (the knobs of the forward, backward and decode, declared once, with
their checks and shared-memory models), ``intrinsics`` (mma.sync, ldmatrix, fill), ``fragments`` (the
fragment layouts and the schedule steps on them that all three share), ``forward`` (``schedule``),
``backward`` (``schedule_backward``) and ``decode`` (``schedule_decode``). ``SCHEDULE`` is what the
registry (``tvmflash.schedules``) hands out.
"""

import sys

from .. import common, simt
from ..contract import DecodeTasks, ProgramSchedule, Schedule, gpu_checked
from .backward import schedule_backward
from .decode import fp8_byte_tiles, schedule_decode
from .forward import schedule
from .knobs import (BACKWARD, BACKWARD_HEAD_DIMS, DECODE, DECODE_FP8_CACHE_DEFAULTS, DECODE_FP8_UNCHECKED_HEAD_DIMS, DECODE_HEAD_DIMS, DTYPES, FORWARD, MMA_HEAD_DIMS,
                    PASS_CONFIG, STRIDE_ALIGNMENT, decode_query_tokens, decode_tasks_per_sm)

SCHEDULE = Schedule(
    name="sm80", target_kind="cuda", dtypes=DTYPES, min_compute_capability=80, stride_alignment=STRIDE_ALIGNMENT,
    pass_config=PASS_CONFIG,
    forward=ProgramSchedule(FORWARD, schedule, head_dims=gpu_checked(MMA_HEAD_DIMS)),
    backward=ProgramSchedule(BACKWARD, schedule_backward, head_dims=gpu_checked(BACKWARD_HEAD_DIMS)),
    decode=ProgramSchedule(DECODE, schedule_decode, head_dims=gpu_checked(DECODE_HEAD_DIMS), tasks=DecodeTasks(
        tensor_cores=True, query_tokens=decode_query_tokens, per_processor=decode_tasks_per_sm, fp8_cache=True,
        fp8_unchecked_head_dims=DECODE_FP8_UNCHECKED_HEAD_DIMS, fp8_byte_tiles=fp8_byte_tiles,
        fp8_cache_defaults=DECODE_FP8_CACHE_DEFAULTS)),
    # simt: the backward's delta and convert_dq, and decode's merge, run on its schedule
    sources=(sys.modules[__name__], common, simt),
)
