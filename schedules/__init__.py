"""Schedules: one module per architecture, each a function ``schedule(sch, **knobs)`` with its
default knobs in ``KNOBS``. They map the one program in ``tvmflash.program`` onto hardware and
never restate it.

Installed as ``tvmflash.schedules``.
"""

from __future__ import annotations

from types import ModuleType

from . import cpu, cuda, sm80

# The schedule for each compute capability, newest first; the CPU has its own.
_CUDA_BY_CAPABILITY: list[tuple[int, ModuleType]] = [(80, sm80), (0, cuda)]


def for_target(target, dtype: str) -> ModuleType:
    """The schedule module that serves a ``tvm.target.Target`` and dtype."""
    if target.kind.name == "llvm":
        return cpu
    if target.kind.name == "cuda":
        from tvmflash.target import compute_capability

        cc = compute_capability(target)
        for min_cc, module in _CUDA_BY_CAPABILITY:
            if cc >= min_cc and dtype in getattr(module, "DTYPES", (dtype,)):
                return module
    raise ValueError(f"target: no tvmflash schedule for target kind {target.kind.name!r}")


def name_of(module: ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[-1]
