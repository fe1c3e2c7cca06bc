"""The AMX schedule: the CPU forward and backward in bf16 with their products on Intel AMX's tiles
(``tdpbf16ps``), where the llvm target's CPU has amx-tile and amx-bf16 (Sapphire Rapids and newer).
Decode stays the CPU schedule's.

``knobs`` (the forward's and the backward's), ``intrinsics`` (the tile product), ``packing`` (the right
operands' layout), ``rows`` (the softmax's row reductions), ``forward`` (``schedule``), ``backward``
(``schedule_backward``).
"""

import sys

from tvmflash import target as targets

from .. import common, cpu
from ..contract import ProgramSchedule, Schedule
from . import backward, intrinsics, packing, rows
from .backward import schedule_backward
from .forward import schedule
from .knobs import BACKWARD, DTYPES, FORWARD, HEAD_DIMS

SCHEDULE = Schedule(
    name="amx", target_kind="llvm", dtypes=DTYPES, cpu_features=targets.AMX_FEATURES, prepare=targets.enable_amx,
    forward=ProgramSchedule(FORWARD, schedule, head_dims=HEAD_DIMS),
    # no StorageRewrite: it puts a bf16 tile of dkdv's into the storage of a float32 one whose use has
    # ended, and the tile loads' uint16 pointers into it then fail LowerIntrin's type check
    backward=ProgramSchedule(BACKWARD, schedule_backward, head_dims=HEAD_DIMS,
                             pass_config={"tirx.disable_storage_rewrite": True}),
    ordered_dq_accumulation=True,  # dq_atomic's tasks as the CPU schedule's (``cpu.backward_tiles``)
    sources=(sys.modules[__name__], sys.modules[schedule.__module__], backward, intrinsics, packing, rows, common, cpu),
)
