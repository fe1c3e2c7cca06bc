"""Schedules: one per architecture, each mapping the programs of ``tvmflash.program`` (the forward),
``program_backward`` and ``program_decode`` onto hardware without restating them.

Each declares itself once as a ``contract.Schedule``: its knobs (defaults, choices, tuning space,
per-head_dim defaults, what they constrain), the function that schedules each program, and what its
builds need. ``SCHEDULES`` lists them by name, in the order of preference on a GPU that several can
serve; ``tvmflash.choice`` picks one. Installed as ``tvmflash.schedules``.
"""

from __future__ import annotations

from . import amx, cpu, simt, sm80, sm90
from .contract import Schedule

# name -> schedule, the most specialised first: sm90 (sm_90a alone), sm80 (sm80 and newer), SIMT (any
# NVIDIA GPU), then the CPU's: AMX (a CPU with AMX bf16) before the plain one.
SCHEDULES: dict[str, Schedule] = {s.name: s for s in (sm90.SCHEDULE, sm80.SCHEDULE, simt.SCHEDULE, amx.SCHEDULE,
                                                      cpu.SCHEDULE)}


def program_for(spec, schedule: Schedule, knobs: dict, **options):
    """The forward program (``tvmflash.program_forward.attention_forward``) for a spec, in these knobs' tiles,
    with the kernel attributes they ask for (``with_kernel_attrs``), as many K/V tiles a Q block at the
    least as the schedule's ``min_kv_tiles`` asks, and its strides' alignment (options: ``attention_forward``'s
    others, e.g. FP8's e4m3_bits)."""
    from tvmflash import program_forward

    func = program_forward.attention_forward(spec, knobs["block_m"], knobs["block_n"],
                                             min_kv_tiles=schedule.min_kv_tiles(knobs),
                                             stride_alignment=schedule.stride_alignment, **options)
    return with_kernel_attrs(func, schedule, knobs)


def with_kernel_attrs(func, schedule: Schedule, knobs: dict):
    """``func`` (a program) with the kernel attributes the schedule asks for these knobs (e.g. sm90's
    ``__launch_bounds__`` minimum of blocks per SM). A schedule's trace cannot set function attributes,
    so the kernels and the tuner put them on the program before it is scheduled; the knobs they read
    must be plain values (a ``PROGRAM`` knob, not a sampled one)."""
    for key, value in schedule.kernel_attrs(knobs).items():
        func = func.with_attr(key, value)
    return func
