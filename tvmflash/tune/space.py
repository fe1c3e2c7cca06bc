"""The design space of a schedule's forward, read from its contract (``schedules.contract``): which
knobs make a task, a structure or a sampled decision, how a candidate's trace stands for its knobs,
and which candidates cannot build.

A MetaSchedule task is one TensorIR program: only the knobs that change the program are tasks
(``task_points``: the knob set's ``TILE`` and ``PROGRAM`` knobs). Inside a task, each combination of
its ``STRUCTURE`` knobs that the knob set's ``rules`` accept is a design space of its own
(``structures``), and every other knob with more than one candidate is a ``sch.sample_categorical``
decision handed to the schedule's ``apply(sch, **knobs)`` as the ExprRV itself (``space_fn``).
``candidate_problem`` says what cannot build before anything is built: the knob set's one
validation (``KnobSet.problem``) and the target's shared memory (``choice.shared_memory_over``).

The tuner reads a schedule through its ``Schedule`` alone: the forward's ``KnobSet`` (roles,
defaults, space, rules), its ``apply``, ``min_kv_tiles`` and ``build_options``; measured programs
(backward, decode) read their own ``KnobSet`` the same way (``measured.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import math

import tvm

from tvmflash import choice
from tvmflash import target as targets
from tvmflash.schedules.contract import PROGRAM, STRUCTURE, TILE, KnobSet, Schedule


def task_points(schedule: Schedule, space: dict) -> list[dict]:
    """One dict per MetaSchedule task: a value for each of the forward's ``TILE`` and ``PROGRAM``
    knobs found in ``space``: the knobs that change the TensorIR program itself (its tiles; sm90's
    ``min_blocks_per_sm``, a function attribute of the program). Every other knob is decided inside
    the task (``structures`` and the sampled knobs of ``task_knobs``)."""
    names = [n for n in schedule.forward.knobs.names_of(TILE, PROGRAM) if n in space]
    return [dict(zip(names, values)) for values in itertools.product(*(space[n] for n in names))]


def structures(schedule: Schedule, space: dict, point: dict) -> list[dict]:
    """The combinations of the forward's ``STRUCTURE`` knobs in ``space`` that go with a task's
    ``point`` (the knob set's ``rules``, over the task's knobs and the defaults): knobs the schedule
    needs as plain Python values, because they change which schedule steps run (a layout, who
    copies, the pipeline's stages). Each is a design space of its own inside the one task; [{}]
    where the schedule has none."""
    knobset = schedule.forward.knobs
    names = [n for n in knobset.names_of(STRUCTURE) if n in space and n not in point]
    fixed, _ = task_knobs(space, **point, structure_names=names)  # the task's, derived knobs resolved
    plain = {**knobset.defaults(), **fixed}
    combos = (dict(zip(names, values)) for values in itertools.product(*(space[n] for n in names)))
    return [combo for combo in combos if knobset.rules is None or knobset.rules({**plain, **combo}) is None]


def task_name(point: dict) -> str:
    short = {"block_m": "bm", "block_n": "bn", "num_stages": "ns", "min_blocks_per_sm": "mb", "kv_layout": "", "kv_copy": "",
             "producer": "", "q_layout": "q", "q_copy": "qc", "o_store": "o", "overlap": "ov"}
    return "_".join(f"{short.get(k, k)}{v}" for k, v in point.items())


def task_knobs(space: dict, block_m: int, block_n: int, **task) -> tuple[dict, dict]:
    """Split a task's knobs into fixed ones (one candidate) and sampled ones (name -> candidates).

    ``task`` holds the values of the task's other knobs (its ``PROGRAM`` knobs; the ``STRUCTURE``
    knobs named in ``structure_names`` are skipped here, as each structure sets them). A value in
    ``space`` is a list of candidates, or a callable that takes the knobs resolved so far (block_m,
    block_n, the task's knobs and the fixed knobs before it) and returns the list.
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


def _apply_structure(schedule: Schedule, sch, fixed: dict, sampled: dict, structures_: list[dict], index: int):
    knobs, defaults = {**fixed, **structures_[index]}, schedule.forward.knobs.defaults()
    if structures_[index]:
        rv = sch.sample_categorical(candidates=[index], probs=[1.0], decision=0)
        func_name = sch.mod.get_global_vars()[0].name_hint
        sch.annotate(sch.get_sblock("root", func_name=func_name), _STRUCTURE_ANNOTATION, rv)
    for name, values in sampled.items():
        # The design space itself takes the default (else the first) candidate, so generating it
        # cannot fail on an invalid sample; the search re-samples every decision anyway.
        default = defaults.get(name)
        knobs[name] = sch.sample_categorical(candidates=values, probs=[1.0 / len(values)] * len(values),
                                             decision=values.index(default) if default in values else 0)
    return schedule.forward.apply(sch, **knobs)


def space_fn(schedule: Schedule, fixed: dict, sampled: dict, structures_: list[dict] | None = None,
             only: int | None = None):
    """The ScheduleFn body: one design space per structure (``structures``; ``only``: that one
    alone), each sampling the sampled knobs, then running the schedule's forward (its ``apply``)
    with their ExprRVs and the structure's plain values."""
    structures_ = structures_ or [{}]

    def apply(sch: tvm.s_tir.Schedule):
        if only is not None or len(structures_) == 1:
            return _apply_structure(schedule, sch, fixed, sampled, structures_, only or 0)
        # A fresh schedule of the unscheduled module each, made once the one before is done (two
        # schedules made at once of one module, or Schedule.copy, share state that scheduling changes).
        # A structure the schedule rejects is left out (``candidate_problem`` should have caught it).
        unscheduled, spaces = sch.mod, []
        for index in range(len(structures_)):
            each = sch if index == 0 else tvm.s_tir.Schedule(unscheduled)
            with contextlib.suppress(Exception):
                spaces.append(_apply_structure(schedule, each, fixed, sampled, structures_, index))
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

    def __init__(self, schedule: Schedule, mod: tvm.IRModule, fixed: dict, sampled: dict, structures_: list[dict]):
        self.args = (schedule, fixed, sampled, structures_ or [{}])
        self.mod, self.traces = mod, {}

    def trace(self, index: int):
        if index not in self.traces:
            schedule, fixed, sampled, structures_ = self.args
            sch = tvm.s_tir.Schedule(self.mod)
            space_fn(schedule, fixed, sampled, structures_, only=index)(sch)
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


def seed_trace(schedule: Schedule, mod: tvm.IRModule, fixed: dict, sampled: dict, knobs: dict,
               structures_: list[dict] | None = None, retracer: Retracer | None = None):
    """The design-space trace of a task with its structure and decisions set to ``knobs``, or None
    where the task cannot make those knobs (another tile pair or program knob, or a value outside
    the space). A knob outside the space takes its default."""
    structures_ = structures_ or [{}]
    plain = with_defaults(schedule, fixed)  # what the task builds for a knob outside the space
    names = set(structures_[0])
    if any(knobs.get(name, value) != value for name, value in plain.items() if name not in sampled and name not in names):
        return None
    if any(knobs.get(name) not in values for name, values in sampled.items()):
        return None
    index = next((i for i, s in enumerate(structures_) if all(knobs.get(n, plain.get(n)) == v for n, v in s.items())),
                 None)
    if index is None:
        return None
    retracer = retracer or Retracer(schedule, mod, fixed, sampled, structures_)
    return retracer.with_decisions(index, [values.index(knobs[name]) for name, values in sampled.items()])




def candidate_problem(knobset: KnobSet, target, head_dim: int, dtype: str, knobs: dict) -> str | None:
    """Why a candidate with these knobs (of a program's ``knobset``, its defaults filling in the rest)
    cannot build or run on ``target``, or None: checked before anything is built (``PreCheck``,
    ``make_tasks``, ``measured.candidates``). The knob set's one validation, ``KnobSet.problem``
    (names, values, the rules between knobs and, on a GPU, the build's limits with the tuner's
    ``precheck``: sm90's registers and swizzle alignment), then shared memory over the target's limit."""
    knobs = {**knobset.defaults(), **knobs}
    problem = knobset.problem(knobs, head_dim if targets.is_cuda(target) else None, dtype, tuning=True)
    if problem is not None:
        return problem
    over = choice.shared_memory_over(target, knobset, head_dim, dtype, knobs)
    return None if over is None else f"it needs {over}"


def searched_space(schedule: Schedule, space: dict | None, dtype: str | None = None) -> dict:
    """The space a run searches: ``space`` (a subset, for a quick run), else the forward's
    ``KnobSet.space()``; a ValueError for a knob the schedule does not have. A tile knob that
    ``space`` leaves out keeps its default at ``dtype`` (each task is a pair of tiles)."""
    knobset = schedule.forward.knobs
    if not space:
        return knobset.space()
    unknown = set(space) - set(knobset.names)
    if unknown:
        raise ValueError(f"space: {sorted(unknown)} are not forward knobs of the {schedule.name} schedule")
    defaults = knobset.defaults(dtype=dtype)
    return {**{name: [defaults[name]] for name in knobset.names_of(TILE) if name not in space}, **space}


def with_defaults(schedule: Schedule, knobs: dict) -> dict:
    """``knobs`` over the forward's defaults."""
    return {**schedule.forward.knobs.defaults(), **knobs}


def structures_share_a_program(schedule: Schedule, plain: dict, kept: list[dict]) -> bool:
    """Whether a task's structures (``kept``, over the task's knobs ``plain``) make one program: the
    schedule's ``min_kv_tiles`` shapes the program, which a task's structures share."""
    return len({schedule.min_kv_tiles({**plain, **s}) for s in kept}) <= 1
