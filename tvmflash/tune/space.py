"""The design space of a schedule's ``SPACE``: which knobs make a task, a structure or a sampled
decision, how a candidate's trace stands for its knobs, and which candidates cannot build.

A MetaSchedule task is one TensorIR program: only the knobs that change the program are tasks
(``task_points``). Inside a task, each valid combination of the schedule's ``STRUCTURE_KNOBS`` is a
design space of its own (``structures``), and every other knob with more than one candidate is a
``sch.sample_categorical`` decision handed to ``schedule(sch, **knobs)`` as the ExprRV itself
(``space_fn``). ``candidate_problem`` says what cannot build before anything is built.

Every read of a schedule module's attributes in the tuner is in this file: the functions below read
``KNOBS``, ``PROGRAM_KNOBS``, ``STRUCTURE_KNOBS``, ``valid_knobs``, ``schedule`` and ``knobs_problem``,
and those at its end ``SPACE``, ``min_kv_tiles``, a measured pass's space and ``DECODE_KNOBS``. (The
tuner also hands schedules to modules below it, which read their own: the kernel's ``default_knobs``,
``backward_default_knobs`` and ``build_options``, the target's ``shared_memory_over``, the registry's
``program_for``.)
"""

from __future__ import annotations

import contextlib
import itertools
import math

import tvm

from tvmflash import schedules as schedule_registry
from tvmflash import target as targets


def task_points(schedule, space: dict) -> list[dict]:
    """One dict per MetaSchedule task: a value for block_m, block_n and each of the schedule's
    ``PROGRAM_KNOBS`` found in ``space``: the knobs that change the TensorIR program itself (its
    tiles; sm90's ``min_blocks_per_sm``, a function attribute of the program). Every other knob is
    decided inside the task (``structures`` and the sampled knobs of ``task_knobs``)."""
    names = ["block_m", "block_n", *(n for n in getattr(schedule, "PROGRAM_KNOBS", ()) if n in space)]
    return [dict(zip(names, values)) for values in itertools.product(*(space[n] for n in names))]


def structures(schedule, space: dict, point: dict) -> list[dict]:
    """The combinations of the schedule's ``STRUCTURE_KNOBS`` in ``space`` that go with a task's
    ``point`` (the schedule's ``valid_knobs``): knobs the schedule needs as plain Python values,
    because they change which schedule steps run (a layout, who copies, the pipeline's stages).
    Each is a design space of its own inside the one task; [{}] where the schedule has none."""
    names = [n for n in getattr(schedule, "STRUCTURE_KNOBS", ()) if n in space and n not in point]
    valid = getattr(schedule, "valid_knobs", lambda knobs: True)
    combos = (dict(zip(names, values)) for values in itertools.product(*(space[n] for n in names)))
    return [combo for combo in combos if valid({**schedule.KNOBS, **point, **combo})]


def task_name(point: dict) -> str:
    short = {"block_m": "bm", "block_n": "bn", "num_stages": "ns", "min_blocks_per_sm": "mb", "kv_layout": "", "kv_copy": "",
             "producer": "", "q_layout": "q", "q_copy": "qc", "o_store": "o", "overlap": "ov"}
    return "_".join(f"{short.get(k, k)}{v}" for k, v in point.items())


def task_knobs(space: dict, block_m: int, block_n: int, **task) -> tuple[dict, dict]:
    """Split a task's knobs into fixed ones (one candidate) and sampled ones (name -> candidates).

    ``task`` holds the values of the task's other knobs (``PROGRAM_KNOBS``, or a structure's, which
    ``make_tasks`` passes as ``structure_names``' values are skipped here). A value in ``space`` is a
    list of candidates, or a callable that takes the knobs resolved so far (block_m, block_n, the
    task's knobs and the fixed knobs before it) and returns the list.
    """
    skip = set(task.pop("structure_names", ()))
    fixed, sampled = {"block_m": block_m, "block_n": block_n, **task}, {}
    for name, values in space.items():
        if name in fixed or name in skip:
            continue
        values = list(values(fixed) if callable(values) else values)
        if not values:
            raise ValueError(f"space: knob {name!r} has no candidates")
        if len(values) == 1:
            fixed[name] = values[0]
        else:
            sampled[name] = values
    return fixed, sampled


# A design space's structure is a SampleCategorical of one candidate (the structure's index in the
# task's list), kept in the trace by an annotation of the root block (a decision nothing reads would be
# dead code). One candidate: MetaSchedule re-samples decisions when it replays a design space, and the
# structure must stay the one the trace's steps were made for; ``MutateKnob`` moves a candidate to
# another structure by scheduling it again.
_STRUCTURE_ANNOTATION = "tvmflash.structure"


def _apply_structure(schedule_module, sch, fixed: dict, sampled: dict, structures_: list[dict], index: int,
                     schedule_fn=None):
    knobs = {**fixed, **structures_[index]}
    if structures_[index]:
        rv = sch.sample_categorical(candidates=[index], probs=[1.0], decision=0)
        func_name = sch.mod.get_global_vars()[0].name_hint
        sch.annotate(sch.get_sblock("root", func_name=func_name), _STRUCTURE_ANNOTATION, rv)
    for name, values in sampled.items():
        # The design space itself takes the default (else the first) candidate, so generating it
        # cannot fail on an invalid sample; the search re-samples every decision anyway.
        default = schedule_module.KNOBS.get(name)
        knobs[name] = sch.sample_categorical(candidates=values, probs=[1.0 / len(values)] * len(values),
                                             decision=values.index(default) if default in values else 0)
    return (schedule_fn or schedule_module.schedule)(sch, **knobs)


def space_fn(schedule_module, fixed: dict, sampled: dict, structures_: list[dict] | None = None, schedule_fn=None,
             only: int | None = None):
    """The ScheduleFn body: one design space per structure (``structures``; ``only``: that one
    alone), each sampling the sampled knobs, then running the schedule (``schedule_fn``, default the
    module's forward ``schedule``) with their ExprRVs and the structure's plain values."""
    structures_ = structures_ or [{}]

    def apply(sch: tvm.s_tir.Schedule):
        if only is not None or len(structures_) == 1:
            return _apply_structure(schedule_module, sch, fixed, sampled, structures_, only or 0, schedule_fn)
        # A fresh schedule of the unscheduled module each, made once the one before is done (two
        # schedules made at once of one module, or Schedule.copy, share state that scheduling changes).
        # A structure the schedule rejects is left out (``candidate_problem`` should have caught it).
        unscheduled, spaces = sch.mod, []
        for index in range(len(structures_)):
            each = sch if index == 0 else tvm.s_tir.Schedule(unscheduled)
            with contextlib.suppress(Exception):
                spaces.append(_apply_structure(schedule_module, each, fixed, sampled, structures_, index, schedule_fn))
        return spaces

    return apply


def structure_index(trace, structures_: list[dict] | None) -> int:
    """Which of the task's structures a candidate's trace was made for."""
    if not structures_ or not structures_[0]:
        return 0
    first = next(inst for inst in trace.insts if inst.kind.name == "SampleCategorical")
    return int(first.attrs[0][0])


def decided_knobs(trace, fixed: dict, sampled: dict, structures_: list[dict] | None = None) -> dict:
    """The knob values one candidate's trace stands for: its structure (``structure_index``) and
    its sampled knobs' SampleCategorical decisions, in order."""
    insts = [inst for inst in trace.insts if inst.kind.name == "SampleCategorical"]
    structure = {}
    if structures_ and structures_[0]:
        structure, insts = structures_[structure_index(trace, structures_)], insts[1:]
    if len(insts) != len(sampled):
        raise RuntimeError(f"expected {len(sampled)} sampled knobs in the trace, found {len(insts)}")
    chosen = {name: values[int(trace.get_decision(inst))] for (name, values), inst in zip(sampled.items(), insts)}
    return {**fixed, **structure, **chosen}


def configurations(task: dict) -> int:
    """How many configurations a task (``make_tasks``) holds: its structures times its sampled knobs' values."""
    return len(task.get("structures") or [{}]) * math.prod(len(values) for values in task.get("sampled", {}).values())


class Retracer:
    """The design-space trace of a task's structure with given sampled decisions (``MutateKnob``
    and the seeds): the schedule is run again on the task's module, once a structure (cached)."""

    def __init__(self, schedule_module, mod: tvm.IRModule, fixed: dict, sampled: dict, structures_: list[dict],
                 schedule_fn=None):
        self.args = (schedule_module, fixed, sampled, structures_ or [{}], schedule_fn)
        self.mod, self.traces = mod, {}

    def trace(self, index: int):
        if index not in self.traces:
            schedule_module, fixed, sampled, structures_, schedule_fn = self.args
            sch = tvm.s_tir.Schedule(self.mod)
            space_fn(schedule_module, fixed, sampled, structures_, schedule_fn, only=index)(sch)
            self.traces[index] = sch.trace
        return self.traces[index]

    def with_decisions(self, index: int, decisions: list[int]):
        trace = self.trace(index)
        insts = [inst for inst in trace.insts if inst.kind.name == "SampleCategorical" and len(inst.attrs[0]) > 1]
        for inst, decision in zip(insts, decisions):
            trace = trace.with_decision(inst, decision, remove_postproc=True)
        return trace

    def __call__(self, trace, index: int):
        """``trace``'s sampled decisions on structure ``index`` (None if the schedule rejects it)."""
        insts = [inst for inst in trace.insts if inst.kind.name == "SampleCategorical" and len(inst.attrs[0]) > 1]
        try:
            return self.with_decisions(index, [int(trace.get_decision(inst)) for inst in insts])
        except Exception:  # noqa: BLE001 - a structure the schedule rejects: no mutation
            return None


def seed_trace(schedule_module, mod: tvm.IRModule, fixed: dict, sampled: dict, knobs: dict,
               structures_: list[dict] | None = None, schedule_fn=None, retracer: Retracer | None = None,
               defaults: dict | None = None):
    """The design-space trace of a task with its structure and decisions set to ``knobs``, or None
    where the task cannot make those knobs (another tile pair or program knob, or a value outside
    the space). ``defaults``: the knobs a knob outside the space takes (the module's ``KNOBS``)."""
    structures_ = structures_ or [{}]
    plain = {**(defaults or schedule_module.KNOBS), **fixed}  # what the task builds for a knob outside the space
    names = set(structures_[0])
    if any(knobs.get(name, value) != value for name, value in plain.items() if name not in sampled and name not in names):
        return None
    if any(knobs.get(name) not in values for name, values in sampled.items()):
        return None
    index = next((i for i, s in enumerate(structures_) if all(knobs.get(n, plain.get(n)) == v for n, v in s.items())),
                 None)
    if index is None:
        return None
    retracer = retracer or Retracer(schedule_module, mod, fixed, sampled, structures_, schedule_fn)
    return retracer.with_decisions(index, [values.index(knobs[name]) for name, values in sampled.items()])


def candidate_problem(schedule, target, head_dim: int, dtype: str, knobs: dict) -> str | None:
    """Why a candidate with these knobs cannot build or run on ``target``, or None: checked before
    anything is built (``PreCheck``, ``make_tasks``). Shared memory over the target's limit, then
    the schedule's own ``knobs_problem`` (sm90: registers, TMA and swizzle alignment, knobs that do
    not go together)."""
    knobs = {**schedule.KNOBS, **knobs}
    over = targets.shared_memory_over(target, schedule, head_dim, dtype, knobs)
    if over is not None:
        return f"it needs {over}"
    check = getattr(schedule, "knobs_problem", None)
    return check(head_dim, dtype, knobs) if check is not None and targets.is_cuda(target) else None


# ---- what the tuner reads of a schedule module beyond the functions above
def searched_space(schedule, space: dict | None) -> dict:
    """The space a run searches: ``space`` (a subset, for a quick run), else the schedule's ``SPACE``;
    a ValueError for a knob the schedule does not have."""
    space = dict(space or schedule.SPACE)
    unknown = set(space) - set(schedule.KNOBS)
    if unknown:
        raise ValueError(f"space: {sorted(unknown)} are not knobs of the {schedule_registry.name_of(schedule)} schedule")
    return space


def with_defaults(schedule, knobs: dict) -> dict:
    """``knobs`` over the schedule's defaults (``KNOBS``)."""
    return {**schedule.KNOBS, **knobs}


def structures_share_a_program(schedule, plain: dict, kept: list[dict]) -> bool:
    """Whether a task's structures (``kept``, over the task's knobs ``plain``) make one program: the
    schedule's ``min_kv_tiles``, where it has one, shapes the program, which a task's structures share."""
    return not (getattr(schedule, "min_kv_tiles", None)
                and len({schedule.min_kv_tiles({**plain, **s}) for s in kept}) > 1)


def measured_space(schedule, space_name: str) -> dict:
    """A measured pass's space in its schedule (``space_name``: ``BACKWARD_SPACE``, ``DECODE_SPACE``)."""
    return getattr(schedule, space_name)


def decode_defaults(schedule) -> dict:
    """The decode schedule's default knobs (``DECODE_KNOBS``)."""
    return dict(schedule.DECODE_KNOBS)
