"""Schedules: one module per architecture, each a function ``schedule(sch, **knobs)`` with its
default knobs in ``KNOBS``. They map the one program in ``tvmflash.program`` onto hardware and
never restate it.

Installed as ``tvmflash.schedules``.
"""

from __future__ import annotations

import os
from types import ModuleType

from . import common, cpu, cuda, sm80, sm90  # noqa: F401 - common: in the build cache key (kernels/build.py)

# The schedule for each compute capability, newest first; the CPU has its own.
_CUDA_BY_CAPABILITY: list[tuple[int, ModuleType]] = [(80, sm80), (0, cuda)]


def sm90_setting() -> str:
    """TVMFLASH_SM90: "on" (1), "off" (0) or "records" (unset). By default the wgmma schedule
    (sm_90a only: wgmma is not on later GPUs) serves every workload but head_dim 32
    (``sm90.SM80_HEAD_DIMS``) and one where this device's tuning records say the sm80 schedule is
    faster (``tvmflash.choice.choose_schedule``); 1 forces it, 0 keeps it off."""
    return {"": "records", "0": "off"}.get(os.environ.get("TVMFLASH_SM90", ""), "on")


def sm90_eligible(target, dtype: str) -> bool:
    """Could the sm90 schedule serve this target and dtype (sm_90a, fp16/bf16)?"""
    from tvmflash.target import compute_capability

    return target.kind.name == "cuda" and compute_capability(target) == 90 and dtype in sm90.DTYPES


def for_target(target, dtype: str) -> ModuleType:
    """The schedule module that serves a ``tvm.target.Target`` and dtype (sm90 only when
    TVMFLASH_SM90=1; ``tvmflash.choice.choose_schedule`` may still pick it by the records)."""
    if target.kind.name == "llvm":
        return cpu
    if target.kind.name == "cuda":
        from tvmflash.target import compute_capability

        cc = compute_capability(target)
        if sm90_eligible(target, dtype) and sm90_setting() == "on":
            return sm90
        for min_cc, module in _CUDA_BY_CAPABILITY:
            if cc >= min_cc and dtype in getattr(module, "DTYPES", (dtype,)):
                return module
    raise ValueError(f"target: no tvmflash schedule for target kind {target.kind.name!r}")


def program_for(spec, module: ModuleType, knobs: dict):
    """The program (``tvmflash.program.attention_forward``) for a spec, in these knobs' tiles, with
    the kernel attributes they ask for (``with_kernel_attrs``), as many K/V tiles a Q block at
    the least as the schedule's ``min_kv_tiles(knobs)`` asks (default 1), and its strides'
    ``stride_alignment``."""
    from tvmflash import program

    min_kv_tiles = getattr(module, "min_kv_tiles", lambda knobs: 1)({**module.KNOBS, **knobs})
    func = program.attention_forward(spec, knobs["block_m"], knobs["block_n"], min_kv_tiles=min_kv_tiles,
                                     stride_alignment=stride_alignment(module))
    return with_kernel_attrs(func, module, knobs)


def stride_alignment(module: ModuleType) -> int:
    """Bytes that the strides of q, k, v and out must be a multiple of for a schedule (its
    ``STRIDE_ALIGNMENT``, default 1): the CUDA schedules move 16-byte vectors."""
    return getattr(module, "STRIDE_ALIGNMENT", 1)


def with_kernel_attrs(func, module: ModuleType, knobs: dict):
    """``func`` (the program) with the kernel attributes the schedule asks for these knobs (its
    ``kernel_attrs``, e.g. sm90's ``__launch_bounds__`` minimum of blocks per SM). A schedule's trace
    cannot set function attributes, so Kernel and the tuner put them on the program before it is
    scheduled; the knobs they read must be plain values (a tuner program knob, ``PROGRAM_KNOBS``, not a sampled one)."""
    attrs = getattr(module, "kernel_attrs", lambda knobs: {})(knobs)
    for key, value in attrs.items():
        func = func.with_attr(key, value)
    return func


KNOB_TABLES = {"forward": "KNOBS", "backward": "BACKWARD_KNOBS", "decode": "DECODE_KNOBS"}


def knob_table(module: ModuleType, pass_: str = "forward") -> dict:
    """A schedule's default knobs of one pass (``KNOB_TABLES``): what its records of that pass hold."""
    return getattr(module, KNOB_TABLES[pass_], {})


def knob_problem(module: ModuleType, name: str, value, table: dict | None = None) -> str | None:
    """None if ``value`` is a value of the schedule's knob ``name`` (of ``table``, default its
    forward ``KNOBS``), else why not: one of the schedule's ``CHOICES`` for the knob where it lists
    them, else True or False for a flag, a positive int for an int knob (tile sizes, vector widths,
    counts). Checked before anything is built: a block_m of 0 or "big" would otherwise fail deep
    inside TVM."""
    default = (module.KNOBS if table is None else table)[name]
    choices = getattr(module, "CHOICES", {}).get(name)
    if choices is not None:
        if value in choices and type(value) is type(default):
            return None
        return f"knobs: {name}: the {name_of(module)} schedule takes one of {list(choices)}, got {value!r}"
    if isinstance(default, bool):
        return None if isinstance(value, bool) else f"knobs: {name}: expected True or False, got {value!r}"
    if isinstance(default, int) and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return f"knobs: {name}: expected a positive int, got {value!r}"
    return None


def name_of(module: ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[-1]


BACKWARD_SCHEDULES = ("simt", "sm80", "sm90")


def backward_setting() -> str:
    """TVMFLASH_BACKWARD: the backward schedule asked for, one of ``BACKWARD_SCHEDULES``, or "" (unset):
    the default (``backward_for_target``)."""
    value = os.environ.get("TVMFLASH_BACKWARD", "")
    if value not in ("", *BACKWARD_SCHEDULES):
        raise ValueError(f"TVMFLASH_BACKWARD: expected one of {BACKWARD_SCHEDULES} or unset, got {value!r}")
    return value


def simt_for_target(target) -> ModuleType:
    """The CPU's schedule module, else the SIMT CUDA one on every GPU: what serves the backward and
    decode where no tensor-core schedule does (float32, GPUs before sm80)."""
    if target.kind.name == "llvm":
        return cpu
    if target.kind.name == "cuda":
        return cuda
    raise ValueError(f"target: no tvmflash schedule for target kind {target.kind.name!r}")


DECODE_SCHEDULES = ("simt", "sm80")


def decode_for_target(target, dtype: str, head_dim: int, name: str | None = None) -> ModuleType:
    """The schedule module whose ``schedule_decode`` serves a target: on a GPU of sm80 or newer, for
    fp16/bf16 and a head_dim multiple of 16, sm80's (mma.sync: the products cost a few instructions
    a tile, which leaves the kernel to stream the cache); else the SIMT one, or the CPU's. name
    ("simt" or "sm80"; None: TVMFLASH_DECODE, else the default) asks for one."""
    name = name or os.environ.get("TVMFLASH_DECODE", "")
    if name not in ("", *DECODE_SCHEDULES):
        raise ValueError(f"decode schedule: expected one of {DECODE_SCHEDULES} or unset, got {name!r}")
    if name != "simt" and target.kind.name == "cuda":
        from tvmflash.target import compute_capability

        if compute_capability(target) >= 80 and dtype in sm80.DTYPES and head_dim % 16 == 0:
            return sm80
    if name == "sm80":
        raise ValueError(f"decode schedule sm80: needs a GPU of sm80 or newer, fp16 or bf16 and a head_dim multiple "
                         f"of 16; got {target.kind.name}, {dtype}, head_dim {head_dim}")
    return simt_for_target(target)


def backward_for_target(target, dtype: str, head_dim: int) -> ModuleType:
    """The schedule module whose ``schedule_backward`` serves a target, dtype and head_dim: the CPU's;
    on a GPU, for fp16/bf16 at the head_dims each has, sm90's (wgmma) on sm_90a, else sm80's
    (mma.sync) on sm80 and newer; else the SIMT schedule. TVMFLASH_BACKWARD=sm80 or simt
    (``backward_setting``) skips the schedules before it; so does TVMFLASH_SM90=0 for sm90's, unless
    TVMFLASH_BACKWARD=sm90 asks for it."""
    if target.kind.name == "cuda":
        from tvmflash.target import compute_capability

        setting = backward_setting()
        wanted = setting == "sm90" or (setting == "" and sm90_setting() != "off")
        if wanted and sm90_eligible(target, dtype) and head_dim in sm90.BACKWARD_HEAD_DIMS:
            return sm90
        if (setting != "simt" and compute_capability(target) >= 80 and dtype in sm80.DTYPES
                and head_dim in sm80.BACKWARD_HEAD_DIMS):
            return sm80
    return simt_for_target(target)
