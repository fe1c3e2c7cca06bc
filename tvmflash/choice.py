"""Which schedule serves a kernel, and with which knobs: the forward's (and varlen's), the backward's
and decode's. The kernels (``tvmflash.kernels``) and the tuner ask here and nowhere else."""

from __future__ import annotations

import math
import os
from types import ModuleType
from typing import NamedTuple

from tvmflash import database
from tvmflash import schedules as schedule_registry
from tvmflash import target as targets

WORKLOAD_FIELDS = ("head_dim", "dtype", "causal")  # what tuning records are keyed by


class Choice(NamedTuple):
    """A kernel's schedule and knobs, and where each came from."""

    schedule: ModuleType
    schedule_source: str
    knobs: dict
    knobs_source: str
    record: dict | None  # the tuning record the knobs came from; None for given knobs or defaults


# ----------------------------------------------------------------------------- the environment
def forward_setting() -> str:
    """What of the environment may change the forward's schedule for one target (TVMFLASH_SM90):
    part of every key that names a forward kernel."""
    return schedule_registry.sm90_setting()


def backward_setting() -> tuple[str, str]:
    """What of the environment may change the backward's schedule for one target
    (TVMFLASH_BACKWARD, TVMFLASH_SM90): part of every key that names a backward kernel."""
    return schedule_registry.backward_setting(), schedule_registry.sm90_setting()


def decode_setting() -> str:
    """TVMFLASH_DECODE: the decode schedule asked for ("" unset; ``decode_schedule``)."""
    return os.environ.get("TVMFLASH_DECODE", "")


# ----------------------------------------------------------------------------- workloads and defaults
def workload(spec_args: dict) -> dict:
    """What tuning records are keyed by: head_dim, dtype and causal (a variant runs the same tiles, so
    its kernel takes the knobs tuned for the plain workload)."""
    return {name: spec_args[name] for name in WORKLOAD_FIELDS}


def backward_workload(spec_args: dict) -> dict:
    """What the backward's tuning records are keyed by: the forward's workload and its pass."""
    return {**workload(spec_args), "pass": "backward"}


def decode_workload(head_dim: int, dtype: str, page_size: int) -> dict:
    """What decode's tuning records are keyed by: head_dim, dtype and the cache layout (0:
    contiguous), with its pass (a variant takes the plain workload's knobs, as the forward's)."""
    return {"head_dim": head_dim, "dtype": dtype, "causal": False, "pass": "decode", "page_size": page_size}


def default_knobs(schedule, head_dim: int, varlen: bool = False) -> dict:
    """A schedule's default knobs for a head_dim: ``KNOBS``, updated by ``KNOBS_FOR_HEAD_DIM`` (and
    with varlen by ``VARLEN_KNOBS``, the knobs that varlen's packed sequences require)."""
    return {**schedule.KNOBS, **getattr(schedule, "KNOBS_FOR_HEAD_DIM", {}).get(head_dim, {}),
            **(getattr(schedule, "VARLEN_KNOBS", {}) if varlen else {})}


def backward_default_knobs(schedule, head_dim: int) -> dict:
    """A schedule's default backward knobs for a head_dim: ``BACKWARD_KNOBS``, updated by
    ``BACKWARD_KNOBS_FOR_HEAD_DIM``."""
    return {**schedule.BACKWARD_KNOBS, **getattr(schedule, "BACKWARD_KNOBS_FOR_HEAD_DIM", {}).get(head_dim, {})}


def build_options(schedule) -> dict:
    """What a schedule module asks of ``lowering.build`` (plain values: the tuner's builder workers
    receive them pickled): its PassContext config, whether its tensor-core operands are read
    through the async proxy (wgmma), and whether conditions on the block indices are hoisted."""
    return {"pass_config": getattr(schedule, "PASS_CONFIG", {}),
            "async_proxy_operands": getattr(schedule, "ASYNC_PROXY_OPERANDS", False),
            "hoist_block_index_conditions": getattr(schedule, "HOIST_BLOCK_INDEX_CONDITIONS", False)}


def decode_build_options(schedule) -> dict:
    """``build_options`` for decode's module: the schedule's ``DECODE_PASS_CONFIG``."""
    return {**build_options(schedule), "pass_config": getattr(schedule, "DECODE_PASS_CONFIG", {})}


# ----------------------------------------------------------------------------- the forward
def choose_schedule(target, spec_args: dict, knobs: dict | None) -> tuple[ModuleType, str, dict]:
    """The schedule module for a kernel, why, and the best records it read ({schedule name: record
    or None}, empty if it read none). ``schedules.for_target`` decides, except on sm_90a with
    TVMFLASH_SM90 unset and no knobs given: there this device's tuned records (``tvmflash tune`` or
    the shipped logs) of both schedules, measured at the same shape, pick the faster; without them
    the sm90 schedule serves every head_dim but those of ``sm90.SM80_HEAD_DIMS``. Given knobs keep
    the target's schedule, unless (on sm_90a, TVMFLASH_SM90 not 0) some are the sm90 schedule's
    alone: ``tvmflash tune`` and a user pass its records' knobs that way. varlen takes the
    same schedules: the sm90 schedule's TMA K/V boxes read past a sequence's last key into the next
    sequence (or, past the packed tensor's end, TMA's zeros), keys that the mask hides as it hides
    any key past the sequence's end, as FA3 does; its output and LSE stores are the program's,
    predicated on the sequence's rows."""
    module = schedule_registry.for_target(target, spec_args["dtype"])
    sm80, sm90 = schedule_registry.sm80, schedule_registry.sm90
    if (knobs and module is sm80 and schedule_registry.sm90_setting() != "off"
            and schedule_registry.sm90_eligible(target, spec_args["dtype"])
            and not set(knobs) <= set(sm80.KNOBS) and set(knobs) <= set(sm90.KNOBS)):
        return sm90, "the knobs' (knobs of the sm90 schedule only)", {}
    if (knobs or module is not sm80 or schedule_registry.sm90_setting() != "records"
            or not schedule_registry.sm90_eligible(target, spec_args["dtype"])):
        return module, "the target's", {}
    records = {name: database.lookup(target, name, workload(spec_args)) for name in ("sm80", "sm90")}
    r80, r90 = records["sm80"], records["sm90"]
    if not (r80 and r90 and r80.get("shape") == r90.get("shape")):
        if spec_args["head_dim"] in sm90.SM80_HEAD_DIMS:
            return module, (f"sm80's for head_dim {spec_args['head_dim']} on sm_90a (measured faster than sm90; "
                            "no tuning records of both schedules to compare)"), records
        return sm90, "sm_90a's (no tuning records of both schedules to compare)", records
    times = f"sm90 {r90['mean_ms']:.3f} ms, sm80 {r80['mean_ms']:.3f} ms at {r90.get('shape')}"
    return (sm90, f"tuned records: {times}", records) if r90["mean_ms"] <= r80["mean_ms"] else \
        (module, f"tuned records favour sm80: {times}", records)


def resolve_forward(target, spec_args: dict, knobs: dict | None) -> Choice:
    """The forward's (and varlen's) schedule (``choose_schedule``) and knobs: the caller's (checked),
    else the tuned ones for this GPU (if `tvmflash tune` or the shipped logs have them), else the
    schedule's defaults; those that need more shared memory than the target has shrunk to fit
    (``fit_shared_memory``)."""
    schedule, schedule_source, records = choose_schedule(target, spec_args, knobs)
    schedule_name = schedule_registry.name_of(schedule)
    check_knob_names(schedule, knobs, schedule.KNOBS)
    for name, value in (knobs or {}).items():
        problem = schedule_registry.knob_problem(schedule, name, value)
        if problem:
            raise ValueError(problem)
    if knobs:
        tuned = None
    else:  # choose_schedule may have read this schedule's best record already
        tuned = records[schedule_name] if schedule_name in records else database.lookup(
            target, schedule_name, workload(spec_args))
    varlen = spec_args.get("varlen", False)
    required = getattr(schedule, "VARLEN_KNOBS", {}) if varlen else {}  # over the tuned (dense) knobs
    wrong = {name: value for name, value in (knobs or {}).items() if name in required and value != required[name]}
    if wrong:
        raise ValueError(f"knobs: varlen on the {schedule_name} schedule takes {required}, got {wrong}")
    defaults = default_knobs(schedule, spec_args["head_dim"], varlen)
    chosen = {**defaults, **(tuned["knobs"] if tuned else {}), **required, **(knobs or {})}
    if knobs:
        source = "given"
    elif tuned:
        # tuning stores the defaults where none of its candidates beat them: they are no tuned knobs
        what = "defaults (tuning found none faster:" if chosen == defaults else "tuned ("
        source = f"{what} {tuned['source']}, {tuned['mean_ms']:.3f} ms at {tuned.get('shape')})"
    else:
        source = "defaults"
    chosen, source = fit_shared_memory(target, schedule, spec_args["head_dim"], spec_args["dtype"], chosen, source,
                                       given=bool(knobs))
    return Choice(schedule, schedule_source, chosen, source, tuned)


def bucket_knobs(target, spec_args: dict, chosen: Choice) -> dict[int, tuple[dict, str]]:
    """By seqlen_k bucket (``database.SEQLEN_BUCKETS``): the knobs tuned for that bucket and where
    they came from, for each bucket other than that of the record ``chosen``'s knobs came from whose
    record has other knobs. None for given knobs, defaults or varlen (whose knobs are no bucket's)."""
    if chosen.record is None or spec_args.get("varlen"):
        return {}
    own, schedule = database.bucket(chosen.record), chosen.schedule
    found = {}
    for index, seqlen in enumerate(database.bucket_seqlens()):
        record = None if index == own else database.lookup(target, schedule_registry.name_of(schedule),
                                                           workload(spec_args), seqlen)
        if record is None or database.bucket(record) != index:
            continue
        knobs = {**default_knobs(schedule, spec_args["head_dim"]), **record["knobs"]}
        if knobs == chosen.knobs:
            continue
        source = (f"tuned for {database.bucket_label(index)} ({record['source']}, "
                  f"{record['mean_ms']:.3f} ms at {record.get('shape')})")
        found[index] = fit_shared_memory(target, schedule, spec_args["head_dim"], spec_args["dtype"], knobs, source,
                                         given=False)
    return found


def fit_shared_memory(target, schedule, head_dim: int, dtype: str, knobs: dict, source: str,
                      given: bool) -> tuple[dict, str]:
    """(knobs, source), where knobs whose tiles need more shared memory than the target allows are an
    error for the caller's own (``given``), else the defaults (or tuned knobs) shrunk along the
    schedule's SPACE, fewer pipeline stages first, then smaller K/V tiles, then smaller Q blocks."""
    def over(knobs):
        return targets.shared_memory_over(target, schedule, head_dim, dtype, knobs)

    problem = over(knobs)
    if problem is None:
        return knobs, source
    if given:
        raise ValueError(f"knobs: {knobs} need {problem}; try a smaller block_n or num_stages")
    space, shrunk = schedule.SPACE, dict(knobs)
    for name in ("num_stages", "block_n", "block_m"):
        values = space.get(name)
        for value in sorted(v for v in (values if isinstance(values, list) else []) if v < shrunk.get(name, 0))[::-1]:
            shrunk[name] = value
            for dependent, rule in space.items():  # e.g. num_warps follows block_m
                if callable(rule):
                    shrunk[dependent] = rule(shrunk)[0]
            if over(shrunk) is None:
                return shrunk, f"{source}, shrunk to fit shared memory (they needed {problem})"
    raise ValueError(f"no knobs of the {schedule_registry.name_of(schedule)} schedule fit the shared memory "
                     f"at head_dim {head_dim}: the {source} knobs need {problem}")


# ----------------------------------------------------------------------------- knobs of every pass
def check_knob_names(schedule, knobs: dict | None, known: dict, kind: str = "") -> None:
    """Every knob given is one of ``known``, the schedule's knobs of this ``kind`` (its KNOBS,
    BACKWARD_KNOBS or DECODE_KNOBS)."""
    unknown = set(knobs or {}) - set(known)
    if unknown:
        raise ValueError(f"knobs: {sorted(unknown)} are not {kind}knobs of the "
                         f"{schedule_registry.name_of(schedule)} schedule; it has {sorted(known)}")


def take_knobs(defaults: dict, tuned: dict | None, given: dict | None) -> tuple[dict, str]:
    """The knobs of another pass's kernel (backward, decode): the caller's over a tuned record's over
    the defaults, and where they came from."""
    knobs = {**defaults, **(tuned["knobs"] if tuned else {}), **(given or {})}
    if given:
        return knobs, "given"
    if tuned:
        return knobs, f"tuned ({tuned['source']}, {tuned['mean_ms']:.3f} ms at {tuned.get('shape')})"
    return knobs, "defaults"


# ----------------------------------------------------------------------------- the backward
def backward_schedule(target, dtype: str, head_dim: int) -> ModuleType:
    """The backward's schedule for a target, dtype and head_dim (``schedules.backward_for_target``)."""
    return schedule_registry.backward_for_target(target, dtype, head_dim)


def resolve_backward(target, spec_args: dict, knobs: dict | None, deterministic: bool = False) -> Choice:
    """The backward's schedule (``backward_schedule``) and knobs: the caller's, else
    those `tvmflash tune --pass backward` stored for this GPU (dense kernels: varlen keeps the
    defaults), else the defaults; checked against the schedule's rules and shared memory.
    deterministic turns off ``dq_atomic`` (an error where the caller asked for it)."""
    head_dim, dtype, varlen = spec_args["head_dim"], spec_args["dtype"], spec_args.get("varlen", False)
    schedule = backward_schedule(target, dtype, head_dim)
    schedule_name = schedule_registry.name_of(schedule)
    check_knob_names(schedule, knobs, schedule.BACKWARD_KNOBS, "backward ")
    defaults = backward_default_knobs(schedule, head_dim)
    tuned = None if knobs or varlen else database.lookup(target, schedule_name, backward_workload(spec_args))
    if varlen:
        defaults.update(getattr(schedule, "BACKWARD_VARLEN_KNOBS_FOR_HEAD_DIM", {}).get(head_dim, {}))
    chosen, source = take_knobs(defaults, tuned, knobs)
    if varlen and chosen.get("dkdv_copy") == "tma":
        raise ValueError("knobs: dkdv_copy 'tma' reads the rows past a sequence's end, which varlen packs with the "
                         "next sequence's: the varlen backward takes dkdv_copy 'cp.async'")
    if deterministic and chosen.get("dq_atomic", False):  # the dq pass instead: one sum a dq element, in a fixed order
        if (knobs or {}).get("dq_atomic"):
            raise ValueError("knobs: dq_atomic sums dq by fp32 atomics, in an order that changes from run to "
                             "run, and deterministic=True asks for bitwise-equal gradients: leave one out")
        chosen["dq_atomic"] = False
    check = getattr(schedule, "backward_knobs_problem", None)
    problem = check(head_dim, dtype, chosen) if check and targets.is_cuda(target) else None
    if problem:
        raise ValueError(problem)
    needs = getattr(schedule, "backward_shared_memory_bytes", None)
    if needs and targets.is_cuda(target):
        need = needs(head_dim, dtype, chosen)
        limit = min(int(target.attrs.get("max_shared_memory_per_block", 48 * 1024)),
                    getattr(schedule, "BACKWARD_SHARED_MEMORY_LIMIT", math.inf))
        if need > limit:
            raise ValueError(f"knobs: {chosen} need {need / 1024:.0f} KiB of shared memory, the "
                             f"{schedule_name} backward on {targets.describe(target)} has {limit / 1024:.0f} KiB; "
                             "try a smaller block_m or block_n")
    return Choice(schedule, "the target's", chosen, source, tuned)


# ----------------------------------------------------------------------------- decode
def decode_schedule(target, dtype: str, head_dim: int, name: str | None = None) -> ModuleType:
    """Decode's schedule: sm80's tensor cores on sm80+ GPUs (fp16/bf16), else SIMT threads, or the
    CPU's; name ("simt" or "sm80"; None: TVMFLASH_DECODE, else the default) asks for one
    (``schedules.decode_for_target``)."""
    return schedule_registry.decode_for_target(target, dtype, head_dim, name)


def resolve_decode(target, head_dim: int, dtype: str, page_size: int, knobs: dict | None,
                   schedule: str | None = None) -> Choice:
    """Decode's schedule (``decode_schedule``) and knobs: the caller's, else those `tvmflash tune
    --pass decode` stored for this device and cache layout, else the defaults; checked against the
    schedule's rules and the target's shared memory."""
    module = decode_schedule(target, dtype, head_dim, schedule)
    check_knob_names(module, knobs, module.DECODE_KNOBS, "decode ")
    tuned = None if knobs else database.lookup(target, schedule_registry.name_of(module),
                                               decode_workload(head_dim, dtype, page_size))
    chosen, source = take_knobs(module.DECODE_KNOBS, tuned, knobs)
    problem = getattr(module, "decode_knob_problem", lambda *a: None)(head_dim, dtype, chosen)
    if problem:
        raise ValueError(f"knobs: {problem}")
    limit = target.attrs.get("max_shared_memory_per_block") if targets.is_cuda(target) else None
    need = module.decode_shared_memory_bytes(head_dim, dtype, chosen) if limit else 0
    if limit and need > int(limit):
        raise ValueError(f"knobs: {chosen} need {need / 1024:.0f} KiB of shared memory, "
                         f"{targets.describe(target)} allows {int(limit) / 1024:.0f} KiB; try a smaller block_n")
    return Choice(module, "the target's", chosen, source, tuned)
