"""The AMX schedule: the CPU forward in bf16 with its two products on Intel AMX's tiles
(``tdpbf16ps``), where the llvm target's CPU has amx-tile and amx-bf16 (Sapphire Rapids and newer).
The backward and decode stay the CPU schedule's.

``knobs`` (the forward's), ``intrinsics`` (the tile product), ``packing`` (the right operands' layout), ``rows``
(the softmax's row reductions), ``forward`` (``schedule``).
"""

import sys

from tvmflash import target as targets

from .. import common, cpu
from ..contract import ProgramSchedule, Schedule
from . import intrinsics, packing, rows
from .forward import schedule
from .knobs import DTYPES, FORWARD, HEAD_DIMS

SCHEDULE = Schedule(
    name="amx", target_kind="llvm", dtypes=DTYPES, cpu_features=targets.AMX_FEATURES, prepare=targets.enable_amx,
    forward=ProgramSchedule(FORWARD, schedule, head_dims=HEAD_DIMS),
    sources=(sys.modules[__name__], sys.modules[schedule.__module__], intrinsics, packing, rows, common, cpu),
)
