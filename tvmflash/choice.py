"""One place chooses: the schedule that maps each program (forward, backward, decode) for a target,
dtype and head_dim, and the knobs it runs with.

The schedule: the caller's ``schedule=``, else the environment (``settings``: TVMFLASH_SM90,
TVMFLASH_BACKWARD and TVMFLASH_DECODE are read here alone), else the target's: the first schedule of
``schedules.SCHEDULES`` that can serve the program, dtype and head_dim and prefers that head_dim
(sm90 on sm_90a, sm80 from sm80, SIMT on every GPU, the CPU's on the CPU). On sm_90a this GPU's
tuning records of sm80 and sm90, measured at one shape, decide the forward between the two.

Also where a flex backward makes a learned capture's gradient (``capture_gradients_in_kernel``:
TVMFLASH_FLEX_GRADIENT, read here alone).

The knobs: the caller's over a tuning record's (this GPU's, the user's or the shipped ones,
``database``) over the schedule's defaults for the head_dim, with what varlen requires; checked once
by the schedule's ``KnobSet.problem`` and against the target's shared memory.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from tvmflash import cache, database
from tvmflash import schedules as registry
from tvmflash import target as targets
from tvmflash.program import FP8, HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, SUPPORTED_HEAD_DIMS
from tvmflash.schedules.contract import DERIVED, KnobSet, Schedule

WORKLOAD_FIELDS = ("head_dim", "dtype", "causal")  # what tuning records are keyed by
SM90_SETTINGS = {"": "records", "0": "off", "1": "on"}


@dataclass(frozen=True)
class Settings:
    """The environment's say. sm90 (TVMFLASH_SM90): "records" (unset: sm90 on sm_90a unless this GPU's
    records favour sm80), "on" (1: sm90 wherever it can serve) or "off" (0: never). backward
    (TVMFLASH_BACKWARD) and decode (TVMFLASH_DECODE): the name of the schedule asked for, or None."""

    sm90: str = "records"
    backward: str | None = None
    decode: str | None = None


# 1: the schedules serve the head_dims whose kernels have not passed the GPU tests yet too
# (``ProgramSchedule.unchecked_head_dims``), for a GPU run of those tests.
GPU_UNCHECKED = "TVMFLASH_GPU_UNCHECKED"
# The variables that may change each program's schedule (``settings``, ``choose_schedule``).
# (backward's and decode's own variable last: ``settings``)
ENVIRONMENT = {"forward": ("TVMFLASH_SM90", GPU_UNCHECKED),
               "backward": ("TVMFLASH_SM90", GPU_UNCHECKED, "TVMFLASH_BACKWARD"),
               "decode": (GPU_UNCHECKED, "TVMFLASH_DECODE")}


# Where a flex backward makes a learned capture's gradient (a bias table that requires grad): "kernel" (dkdv,
# ``program_flex_gradient``), "torch" (``flex_gradient``, after the kernels' backward) or unset (the target's:
# ``capture_gradients_in_kernel``).
FLEX_GRADIENT = "TVMFLASH_FLEX_GRADIENT"


# dkdv's additions of a learned capture's gradient: True while its GPU tests (tests/test_flex_gradient.py) have not
# passed, so that a GPU takes torch's way unless asked for the kernel's. They have passed (H100).
GRADIENT_UNCHECKED = False


def capture_gradients_in_kernel(device_type: str, deterministic: bool) -> bool:
    """Does dkdv add the gradients of the captured tensors a score_mod learns (``program_flex_gradient``), or
    torch after the kernels' backward (``flex_gradient``)? The one place that chooses. Torch where
    deterministic algorithms are asked for (the kernel's atomic additions sum in an order that changes from
    run to run) and by default on the CPU: TVM's LLVM code generation has no atomic addition, so the CPU's
    dkdv runs its tiles in turn to add them (``schedules.cpu``), where torch's way keeps them parallel.
    On a GPU dkdv's additions are the default (while ``GRADIENT_UNCHECKED``, only where TVMFLASH_GPU_UNCHECKED=1
    asks).
    FLEX_GRADIENT "kernel" or "torch" overrides the default (a ValueError for another value)."""
    asked = os.environ.get(FLEX_GRADIENT, "")
    if asked not in ("", "kernel", "torch"):
        raise ValueError(f"{FLEX_GRADIENT}: expected 'kernel', 'torch' or unset, got {asked!r}")
    if deterministic:
        return False
    return asked == "kernel" if asked else device_type != "cpu" and not (
        GRADIENT_UNCHECKED and os.environ.get(GPU_UNCHECKED) != "1")


def environment(program: str) -> tuple[str, ...]:
    """The raw values of the variables that may change a program's schedule ("" where unset): what the
    caches of kernels are keyed by, cheap enough for every call of ``tvmflash.attention``. On POSIX read from
    ``os.environ``'s own bytes mapping (what ``os.environ.get`` reads, less its encoding of the key and the
    Mapping protocol: a microsecond a variable, several a call)."""
    if _ENVIRONMENT_BYTES is None:
        return tuple(os.environ.get(name, "") for name in ENVIRONMENT[program])
    get = _ENVIRONMENT_BYTES.get
    return tuple("" if value is None else os.fsdecode(value) for value in map(get, _ENCODED[program]))


# os.environ's mapping of bytes to bytes (CPython's os._Environ on POSIX; None elsewhere: os.environ.get), and
# each program's variables encoded as it encodes them
_ENVIRONMENT_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
if not isinstance(_ENVIRONMENT_BYTES, dict) or os.environ.encodekey("X") != b"X":
    _ENVIRONMENT_BYTES = None
_ENCODED = {program: tuple(os.fsencode(name) for name in names) for program, names in ENVIRONMENT.items()}


def settings() -> Settings:
    """The environment's settings; a ValueError for a value none takes."""
    sm90 = os.environ.get("TVMFLASH_SM90", "")
    if sm90 not in SM90_SETTINGS:
        raise ValueError(f"TVMFLASH_SM90: expected 1 (on), 0 (off) or unset (by the tuning records), got {sm90!r}")
    asked = {}
    for program in ("backward", "decode"):
        variable = ENVIRONMENT[program][-1]
        value = os.environ.get(variable, "")
        names = tuple(name for name, s in registry.SCHEDULES.items() if s.program(program) is not None)
        if value not in ("", *names):
            raise ValueError(f"{variable}: expected one of {names} or unset, got {value!r}")
        asked[program] = value or None
    return Settings(SM90_SETTINGS[sm90], **asked)


def workload(spec_args: dict, program: str = "forward", page_size: int = 0, cache_dtype: str | None = None) -> dict:
    """What a program's tuning records are keyed by: head_dim, dtype and causal; the backward's and
    decode's name their program, and decode's its cache layout (causal is an argument of its calls) and,
    over a cache of another dtype than q's (FP8), ``cache_dtype`` (a field only then: the records of a
    cache in q's dtype keep their key); a flex kernel's its mods (``flex_digest``). The FP8 forward's
    are the forward's with the dtype float8_e4m3fn (``fp8_forward``)."""
    found = {name: spec_args[name] for name in WORKLOAD_FIELDS}
    if spec_args.get("flex") is not None:
        found["flex"] = flex_digest(spec_args["flex"])
    if program == "decode":
        cache = {"cache_dtype": cache_dtype} if cache_dtype not in (None, spec_args["dtype"]) else {}
        return {**found, "causal": False, "pass": "decode", "page_size": page_size, **cache}
    return found if program == "forward" else {**found, "pass": program}


def flex_digest(flex) -> str:
    """The key of traced mods (``program_flex.FlexMods``: their trees, captures' dtypes and dims, and
    BlockMask block size) in a tuning record's workload: of the trace, never of the Python functions,
    as the modules' keys are."""
    return cache.digest(repr(flex))[:16]


# ----------------------------------------------------------------------------------------- schedule
def target_problem(schedule: Schedule, target) -> str | None:
    """None if ``schedule`` runs on ``target`` (its kind, compute capability and CPU features), else why not."""
    if target.kind.name != schedule.target_kind:
        return f"the {schedule.name} schedule runs on {schedule.target_kind}, not {target.kind.name}"
    cc = targets.compute_capability(target) or 0
    if (schedule.compute_capabilities is not None and cc not in schedule.compute_capabilities) or \
            (schedule.min_compute_capability is not None and cc < schedule.min_compute_capability):
        return f"the {schedule.name} schedule does not run on {targets.describe(target)}"
    if schedule.cpu_features and not targets.llvm_has_features(target, schedule.cpu_features):
        return f"the {schedule.name} schedule needs a CPU with {', '.join(schedule.cpu_features)}"
    return None


def serve_problem(schedule: Schedule, program: str, target, dtype: str, head_dim: int) -> str | None:
    """None if ``schedule`` can map ``program`` for this target, dtype and head_dim, else why not."""
    mapped = schedule.program(program)
    if mapped is None:
        return f"the {schedule.name} schedule has no {program}"
    problem = target_problem(schedule, target)
    if problem is not None:
        return problem
    if dtype not in schedule.dtypes:
        return f"the {schedule.name} schedule takes {list(schedule.dtypes)}, got {dtype}"
    if not mapped.serves(head_dim):
        return f"the {schedule.name} {program} serves head_dim {describe_head_dims(mapped.head_dims)}, got {head_dim}"
    return unchecked_problem(f"the {schedule.name} {program}", head_dim, mapped.unchecked_head_dims)


def unchecked_problem(what: str, head_dim: int, unchecked_head_dims: tuple) -> str | None:
    """Why ``what`` (a schedule's program) is not served at ``head_dim``, whose kernels have not passed the GPU
    tests yet (``ProgramSchedule.unchecked_head_dims``), unless TVMFLASH_GPU_UNCHECKED=1 asks; or None."""
    if head_dim in unchecked_head_dims and os.environ.get(GPU_UNCHECKED) != "1":
        return f"{what} at head_dim {head_dim} has not passed the GPU tests yet ({GPU_UNCHECKED}=1 serves it, to run them)"
    return None


def _pick(program: str, target, dtype: str, head_dim: int,
          schedule: str | None = None) -> tuple[Schedule | None, str, list[str] | None]:
    """(the schedule for a program before any tuning record is read, why, the names of the schedules
    able to serve it): the caller's ``schedule``, else the environment's, else the target's first able
    schedule that prefers the head_dim. Where none serves: (None, why not, []); where the one asked for
    does not: (None, why not, None)."""
    env = settings()
    asked, why = schedule, "given"
    if asked is None and program in ("backward", "decode"):
        asked, why = env.backward if program == "backward" else env.decode, f"TVMFLASH_{program.upper()}"
    if asked is None and env.sm90 == "on" and \
            serve_problem(registry.SCHEDULES["sm90"], program, target, dtype, head_dim) is None:
        asked, why = "sm90", "TVMFLASH_SM90=1"
    if asked is not None:
        if asked not in registry.SCHEDULES:
            raise ValueError(f"schedule: expected one of {sorted(registry.SCHEDULES)}, got {asked!r}")
        problem = serve_problem(registry.SCHEDULES[asked], program, target, dtype, head_dim)
        if problem:
            return None, f"schedule {asked!r} ({why}): {problem}", None
        return registry.SCHEDULES[asked], why, [asked]
    able = [s for s in registry.SCHEDULES.values() if serve_problem(s, program, target, dtype, head_dim) is None
            and not (s.name == "sm90" and env.sm90 == "off")]
    if not able:
        return None, (f"target: no tvmflash schedule maps the {program} on {targets.describe(target)} for {dtype} at "
                      f"head_dim {head_dim}"), []
    first = next((s for s in able if s.program(program).prefers(head_dim)), able[0])
    return first, "the target's" + newer_gpu_note(target, first), [s.name for s in able]


def choose_schedule(program: str, target, spec_args: dict, *, schedule: str | None = None,
                    knobs_given: bool = False) -> tuple[Schedule, str, dict]:
    """The schedule for a program, why, and the tuning records read to decide ({name: record}, which
    the knobs' lookup then reuses). ``schedule``: the caller's name for one (``schedules.SCHEDULES``).
    Given knobs keep the target's schedule (no records decide). Where none serves the head_dim, a
    ValueError names the head_dims that are served (``native_head_dims``)."""
    dtype, head_dim = spec_args["dtype"], spec_args["head_dim"]
    chosen, why, names = _pick(program, target, dtype, head_dim, schedule)
    if chosen is None and names is None:  # the schedule asked for: its problem names what it serves
        raise ValueError(why)
    if chosen is None:
        served = native_head_dims(program, target, dtype)
        pads = served and program != "decode"
        raise ValueError(f"{why}; head_dims served there: {describe_head_dims(served)}"
                         + (" (tvmflash.attention and the flash_attn functions pad a head_dim to one of them)"
                            if pads else ""))
    if program != "forward" or knobs_given or names[:2] != ["sm90", "sm80"]:
        return chosen, why, {}
    return by_records(target, spec_args, chosen)


# ----------------------------------------------------------------------------------------- head_dim
def native_head_dims(program: str, target, dtype: str, schedule: str | None = None) -> tuple[int, ...]:
    """The head_dims (of ``tvmflash.program.SUPPORTED_HEAD_DIMS``) at which a schedule maps ``program``
    for this target and dtype (``schedule``: the caller's; else the environment's or the target's): what
    ``tvmflash.compile`` and its like take."""
    return tuple(d for d in SUPPORTED_HEAD_DIMS if _pick(program, target, dtype, d, schedule)[0] is not None)


def describe_head_dims(head_dims: tuple[int, ...]) -> str:
    """Head_dims in words: "the multiples of 16 up to 256" for such a run, else "32, 64, 96"."""
    if not head_dims:
        return "none"
    steps = {b - a for a, b in zip(head_dims, head_dims[1:])}
    if len(head_dims) > 2 and steps == {head_dims[0]}:
        return f"the multiples of {head_dims[0]} up to {head_dims[-1]}"
    return ", ".join(map(str, head_dims))


def head_dim_to_run(programs: tuple[str, ...], target, dtype: str, head_dim: int) -> int:
    """The head_dim at which the torch API runs ``programs`` ("forward", and "backward" where autograd
    records the call) for q's last dim ``head_dim`` (1 to ``MAX_HEAD_DIM``), zero-padding q, k and v to
    it and slicing the output back: zero columns change no score q·k, and the output's are zeros.

    The smallest multiple of 8 at or above ``head_dim`` at which every program has a schedule
    (``_pick``, as ``choose_schedule`` decides without the tuning records, which choose between
    tensor-core schedules only) and the most of them have one that is no ``fallback``: on a GPU, padding
    to a head_dim that a tensor-core schedule serves (the sm80 backward at 96 for 80, say, if it did not
    serve 80) is faster than the SIMT fallback at the exact head_dim, which runs the products on CUDA cores
    (an H100's peak at 67 TFLOP/s in float32, below what sm90's wgmma backward at 256 gives at 136's share of
    its work, BENCHMARKS.md: 136 pads to 256). Where no larger head_dim has more tensor-core programs (the
    backward above 128 off sm_90a), the fallback runs at the head_dim rounded up to 8. On the CPU every multiple of 8 is served: that rounding alone."""
    first = -(-head_dim // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE
    best, most = first, -1
    for candidate in range(first, MAX_HEAD_DIM + 1, HEAD_DIM_MULTIPLE):
        chosen = [_pick(program, target, dtype, candidate)[0] for program in programs]
        if None in chosen:
            continue
        fast = sum(not s.fallback for s in chosen)
        if fast > most:
            best, most = candidate, fast
        if most == len(programs):
            break
    return _padded_to_a_better_schedule(programs, target, dtype, best) if targets.is_cuda(target) else best


# How far a GPU pads a served head_dim to run its programs on a schedule before the one it would run (sm90's
# wgmma for sm80's mma.sync on sm_90a). Forward + backward on an H100 (BENCHMARKS.md, "head_dims the kernels
# do not serve"): padding 48 to 64 (4/3), 80 to 96 and 112 to 128 is 8-14% faster than sm80 at the head_dim
# itself; 32 to 64 (2x) is as fast as sm80 at 32, so 32 stays.
BETTER_SCHEDULE_PADDING = 4 / 3


def _padded_to_a_better_schedule(programs, target, dtype: str, served: int) -> int:
    """``served`` or a larger head_dim, at most ``BETTER_SCHEDULE_PADDING`` times ``served``, at which the
    programs run on schedules earlier in ``schedules.SCHEDULES`` (the order of preference), none of them a
    ``fallback``: the one with the earliest, and of those the smallest. Where a program is a fallback (SIMT's
    backward above 128) its time rules, and padding only adds to it: ``served`` stays."""
    order = list(registry.SCHEDULES)

    def rank(candidate):  # the places of its schedules in the order, or None where one is unserved or a fallback
        chosen = [_pick(program, target, dtype, candidate)[0] for program in programs]
        if None in chosen or any(s.fallback for s in chosen):
            return None
        return sum(order.index(s.name) for s in chosen)

    best, best_rank = served, rank(served)
    if best_rank is None:
        return served
    limit = min(MAX_HEAD_DIM, int(served * BETTER_SCHEDULE_PADDING))
    for candidate in range(served + HEAD_DIM_MULTIPLE, limit + 1, HEAD_DIM_MULTIPLE):
        found = rank(candidate)
        if found is not None and found < best_rank:
            best, best_rank = candidate, found
    return best


_NOTED: set = set()


def newer_gpu_note(target, schedule: Schedule) -> str:
    """On a GPU newer than any schedule is written for (sm100, sm120, ...), a note that it runs the sm80
    schedule built for its own arch, logged once an arch; else ""."""
    cc = targets.compute_capability(target)
    if schedule.name != "sm80" or cc is None or cc <= 90:
        return ""
    note = f" (no schedule is written for sm_{cc} yet: the sm80 mma.sync schedule, built for sm_{cc})"
    if cc not in _NOTED:
        _NOTED.add(cc)
        logging.getLogger("tvmflash").warning("tvmflash: %s", note.strip(" ()"))
    return note


def by_records(target, spec_args: dict, preferred: Schedule) -> tuple[Schedule, str, dict]:
    """sm90 or sm80 for the forward on sm_90a: the faster by this GPU's records of both, measured at one
    shape; without them ``preferred``, the one that prefers the head_dim."""
    records = {name: lookup(target, registry.SCHEDULES[name], "forward", workload(spec_args))
               for name in ("sm80", "sm90")}
    r80, r90 = records["sm80"], records["sm90"]
    if not (r80 and r90 and r80.get("shape") == r90.get("shape")):
        return preferred, (f"{preferred.name} at head_dim {spec_args['head_dim']} on sm_90a (no tuning records of both "
                           "schedules to compare)"), records
    times = f"sm90 {r90['mean_ms']:.3f} ms, sm80 {r80['mean_ms']:.3f} ms at {r90.get('shape')}"
    if r90["mean_ms"] <= r80["mean_ms"]:
        return registry.SCHEDULES["sm90"], f"tuned records: {times}", records
    return registry.SCHEDULES["sm80"], f"tuned records favour sm80: {times}", records


# -------------------------------------------------------------------------------------------- knobs
def check_knobs(knobset: KnobSet, knobs: dict, head_dim: int | None = None, dtype: str | None = None) -> None:
    """``KnobSet.problem`` as a ValueError."""
    problem = knobset.problem(knobs, head_dim, dtype)
    if problem:
        raise ValueError(problem)


def given_knobs_problem(schedule: Schedule, program: str, knobs: dict | None, varlen: bool) -> dict:
    """Check the caller's knobs of a program (``KnobSet.problem``, and with varlen what it requires);
    return what varlen requires ({} without)."""
    knobset = schedule.program(program).knobs
    check_knobs(knobset, knobs or {})
    required = knobset.varlen_required() if varlen else {}
    wrong = {name: value for name, value in (knobs or {}).items() if name in required and value != required[name]}
    if wrong:
        which = "schedule" if program == "forward" else program
        raise ValueError(f"knobs: varlen on the {schedule.name} {which} takes {required}, got {wrong}")
    return required


def record_source(record: dict) -> str:
    return f"{record['source']}, {record['mean_ms']:.3f} ms at {record.get('shape')}"


def take_knobs(knobset: KnobSet, defaults: dict, record: dict | None, given: dict | None,
               required: dict | None = None) -> tuple[dict, str]:
    """The caller's knobs over a tuning record's over the defaults (with ``required`` over the record's),
    and where they came from."""
    given = given or {}
    knobs = {**defaults, **(record["knobs"] if record else {}), **(required or {}), **given}
    if given:
        return _derived_from_given(knobset, knobs, {**(required or {}), **given}), "given"
    if record is None:
        return knobs, "defaults"
    if knobs == defaults:  # tuning stores the defaults where none of its candidates beat them
        return knobs, f"defaults (tuning found none faster: {record_source(record)})"
    return knobs, f"tuned ({record_source(record)})"


def _derived_from_given(knobset: KnobSet, knobs: dict, fixed: dict) -> dict:
    """``knobs`` with each derived knob that was not given taking its first candidate where its default
    does not go with the given knobs before it (dkdv_copy "cp.async" given at d128 leaves the default
    dq_reduce "tma", which needs TMA copies, for "atomic")."""
    knobs = dict(knobs)
    for knob in knobset.knobs:
        if knob.role == DERIVED and knob.name not in fixed:
            candidates = knob.candidates(knobs)
            if knobs[knob.name] not in candidates:
                knobs[knob.name] = candidates[0]
    return knobs


def lookup(target, schedule: Schedule, program: str, workload_: dict, seqlen_k: int | None = None) -> dict | None:
    """The best tuning record of this device for the schedule's program and workload, or None. A flex
    workload (mods: ``flex_digest``) that was never tuned takes the record of the same workload without
    mods: the knobs tuned for plain attention serve its kernels, as they did before mods could be tuned."""
    usable = schedule.program(program).knobs.accepts
    found = database.lookup(target, schedule.name, workload_, seqlen_k, usable=usable)
    if found is None and "flex" in workload_:
        plain = {name: value for name, value in workload_.items() if name != "flex"}
        found = database.lookup(target, schedule.name, plain, seqlen_k, usable=usable)
    return found


def shared_memory_needed(target, knobset: KnobSet, head_dim: int, dtype: str, knobs: dict) -> tuple[int, int] | None:
    """(bytes needed, bytes allowed) where the tiles of these knobs need more shared memory a block than
    the target allows (or the knob set's own cap, a schedule's static shared memory), else None."""
    limit = target.attrs.get("max_shared_memory_per_block") if targets.is_cuda(target) else None
    if limit is None or knobset.shared_memory is None:
        return None
    limit = min(int(limit), knobset.shared_memory_limit or math.inf)
    need = knobset.shared_memory(head_dim, dtype, knobs)
    return None if need <= limit else (need, limit)


def shared_memory_over(target, knobset: KnobSet, head_dim: int, dtype: str, knobs: dict) -> str | None:
    """None if the tiles of these knobs fit the target's shared memory per block, else what they need
    against what it allows, as a message."""
    over = shared_memory_needed(target, knobset, head_dim, dtype, knobs)
    if over is None:
        return None
    return f"{over[0] / 1024:.0f} KiB of shared memory, {targets.describe(target)} allows {over[1] / 1024:.0f} KiB"


def fit_shared_memory(target, knobset: KnobSet, head_dim: int, dtype: str, knobs: dict, source: str,
                      given: bool) -> tuple[dict, str]:
    """Knobs whose tiles need more shared memory than the target allows: an error for the caller's own,
    else the defaults (or tuned knobs) shrunk along the space, fewer pipeline stages first, then
    smaller K/V tiles, then smaller Q blocks."""
    problem = shared_memory_over(target, knobset, head_dim, dtype, knobs)
    if problem is None:
        return knobs, source
    if given:
        raise ValueError(f"knobs: {knobs} need {problem}; try a smaller block_n or num_stages")
    space, shrunk = knobset.space(), dict(knobs)
    for name in ("num_stages", "block_n", "block_m"):
        values = space.get(name)
        for value in sorted(v for v in (values if isinstance(values, list) else []) if v < shrunk.get(name, 0))[::-1]:
            shrunk[name] = value
            for dependent, rule in space.items():  # e.g. num_warps follows block_m
                if callable(rule):
                    shrunk[dependent] = rule(shrunk)[0]
            if shared_memory_over(target, knobset, head_dim, dtype, shrunk) is None:
                return shrunk, f"{source}, shrunk to fit shared memory (they needed {problem})"
    raise ValueError(f"no knobs of the {knobset.schedule} schedule fit the shared memory at head_dim {head_dim}: "
                     f"the {source} knobs need {problem}")


@dataclass(frozen=True)
class Choice:
    """A program's schedule and knobs, and why. record: the tuning record the knobs came from."""

    schedule: Schedule
    schedule_source: str
    knobs: dict
    knobs_source: str
    record: dict | None = None


def forward(target, spec_args: dict, knobs: dict | None, schedule: str | None = None) -> Choice:
    """The forward's (or varlen's) schedule and knobs."""
    chosen, why, records = choose_schedule("forward", target, spec_args, schedule=schedule, knobs_given=bool(knobs))
    knobset, head_dim, dtype = chosen.forward.knobs, spec_args["head_dim"], spec_args["dtype"]
    varlen = spec_args.get("varlen", False)
    required = given_knobs_problem(chosen, "forward", knobs, varlen)
    record = None if knobs else records.get(chosen.name) if chosen.name in records else \
        lookup(target, chosen, "forward", workload(spec_args))
    resolved, source = take_knobs(knobset, knobset.defaults(head_dim, varlen, dtype), record, knobs, required)
    check_knobs(knobset, resolved, head_dim if targets.is_cuda(target) else None, dtype)
    resolved, source = fit_shared_memory(target, knobset, head_dim, dtype, resolved, source, given=bool(knobs))
    return Choice(chosen, why, resolved, source, record)


def forward_for_bucket(target, choice: Choice, spec_args: dict, index: int) -> Choice | None:
    """The forward's knobs tuned for another seqlen bucket (``database.SEQLEN_BUCKETS``), where its record
    has knobs other than ``choice``'s; else None."""
    seqlen = database.bucket_seqlens()[index]
    record = lookup(target, choice.schedule, "forward", workload(spec_args), seqlen)
    if record is None or database.bucket(record) != index:
        return None
    knobset = choice.schedule.forward.knobs
    knobs = {**knobset.defaults(spec_args["head_dim"], dtype=spec_args["dtype"]), **record["knobs"]}
    if knobs == choice.knobs:
        return None
    knobs, source = fit_shared_memory(target, knobset, spec_args["head_dim"], spec_args["dtype"], knobs,
                                      f"tuned for {database.bucket_label(index)} ({record_source(record)})", False)
    return Choice(choice.schedule, choice.schedule_source, knobs, source, record)


def backward(target, spec_args: dict, knobs: dict | None, deterministic: bool = False,
             schedule: str | None = None) -> Choice:
    """The backward's schedule and knobs. deterministic: dq by a pass of its own (the knob dq_atomic off)."""
    chosen, why, _ = choose_schedule("backward", target, spec_args, schedule=schedule, knobs_given=bool(knobs))
    knobset, head_dim, dtype = chosen.backward.knobs, spec_args["head_dim"], spec_args["dtype"]
    varlen = spec_args.get("varlen", False)
    required = given_knobs_problem(chosen, "backward", knobs, varlen)
    # varlen keeps the defaults: the records are the dense kernels'
    record = None if knobs or varlen else lookup(target, chosen, "backward", workload(spec_args, "backward"))
    resolved, source = take_knobs(knobset, knobset.defaults(head_dim, varlen, dtype), record, knobs, required)
    # the dq pass instead: one sum a dq element, in a fixed order (a schedule whose dq_atomic sums in one keeps it)
    if deterministic and resolved.get("dq_atomic") and not chosen.ordered_dq_accumulation:
        if (knobs or {}).get("dq_atomic"):
            raise ValueError("knobs: dq_atomic sums dq by fp32 atomics, in an order that changes from run to run, "
                             "and deterministic=True asks for bitwise-equal gradients: leave one out")
        resolved["dq_atomic"] = False
        resolved.update({name: value for name, value in knobset.dq_pass_by_head_dim.get(head_dim, {}).items()
                         if name not in (knobs or {})})
    if targets.is_cuda(target):
        check_knobs(knobset, resolved, head_dim, dtype)
        if not knobs:  # the defaults or a record's, shrunk to fit as the forward's (the SIMT's float32 from d192)
            resolved, source = fit_shared_memory(target, knobset, head_dim, dtype, resolved, source, given=False)
        over = shared_memory_needed(target, knobset, head_dim, dtype, resolved)
        if over:
            raise ValueError(f"knobs: {resolved} need {over[0] / 1024:.0f} KiB of shared memory, the {chosen.name} "
                             f"backward on {targets.describe(target)} has {over[1] / 1024:.0f} KiB; try a smaller "
                             "block_m or block_n")
    return Choice(chosen, why, resolved, source, record)


def decode(target, spec_args: dict, page_size: int, knobs: dict | None, schedule: str | None = None,
           cache_dtype: str | None = None) -> Choice:
    """Decode's schedule and knobs; over an FP8 cache (``cache_dtype``) the records tuned over one."""
    chosen, why, _ = choose_schedule("decode", target, spec_args, schedule=schedule, knobs_given=bool(knobs))
    knobset, head_dim, dtype = chosen.decode.knobs, spec_args["head_dim"], spec_args["dtype"]
    check_knobs(knobset, knobs or {})
    record = None if knobs else lookup(target, chosen, "decode",
                                       workload(spec_args, "decode", page_size, cache_dtype))
    resolved, source = take_knobs(knobset, decode_defaults(chosen, head_dim, dtype, cache_dtype), record, knobs)
    check_knobs(knobset, resolved, head_dim, dtype)
    # an FP8 cache's tiles are the schedule's to size (bytes, fewer converted tiles): "fp8_cache", as the kernel's
    # split count passes it (``DecodeKernel.num_splits``), else the sizes of a cache in q's dtype, far larger
    fp8_cache = {"fp8_cache": True} if cache_dtype not in (None, dtype) else {}
    problem = shared_memory_over(target, knobset, head_dim, dtype, {**resolved, **fp8_cache})
    if problem:
        raise ValueError(f"knobs: {resolved} need {problem}; try a smaller block_n")
    return Choice(chosen, why, resolved, source, record)


def decode_defaults(schedule: Schedule, head_dim: int, dtype: str, cache_dtype: str | None = None) -> dict:
    """Decode's default knobs on ``schedule``: its knob set's, and over an FP8 cache (``cache_dtype``) the
    schedule's own for one (``DecodeTasks.fp8_cache_defaults``) over them."""
    defaults = schedule.decode.knobs.defaults(head_dim, dtype=dtype)
    if cache_dtype and cache_dtype != dtype:
        defaults.update(schedule.decode.tasks.fp8_cache_defaults)
    return defaults


def fp8_workload(head_dim: int, causal: bool) -> dict:
    """The FP8 forward's tuning workload: the forward's with the dtype float8_e4m3fn, which no other kernel
    looks up (the bf16 and fp16 forwards' records keep their keys)."""
    return workload({"head_dim": head_dim, "dtype": FP8, "causal": causal})


def record_knob_set(schedule: Schedule, workload_: dict) -> KnobSet:
    """The knob set whose knobs a tuning record of ``workload_`` on ``schedule`` holds: the FP8 forward's for
    its dtype (``fp8_workload``), else its pass's (forward without one)."""
    if workload_["dtype"] == FP8 and workload_.get("pass", "forward") == "forward":
        return schedule.fp8_forward.knobs
    return schedule.program(workload_.get("pass", "forward")).knobs


def fp8_forward(target, schedule: Schedule, head_dim: int, causal: bool, knobs: dict | None) -> Choice:
    """The FP8 forward's knobs on ``schedule`` (``Schedule.fp8_forward``): the caller's over this GPU's tuning
    record of ``fp8_workload`` (that of the longest seqlen bucket: one kernel serves every length) over its
    knob set's defaults at the head_dim; the caller's checked by its ``KnobSet.problem`` (names and values;
    the build checks the rest)."""
    knobset = schedule.fp8_forward.knobs
    check_knobs(knobset, knobs or {})
    record = None if knobs else database.lookup(target, schedule.name, fp8_workload(head_dim, causal),
                                                usable=knobset.accepts)
    resolved, source = take_knobs(knobset, knobset.defaults(head_dim), record, knobs)
    return Choice(schedule, "the FP8 forward's", resolved, source, record)
