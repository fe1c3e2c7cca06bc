"""``tvmflash tune``: MetaSchedule search over a schedule's ``SPACE``; the best knobs go to the database.

Design space (docs/design.md, "Tuning"). A MetaSchedule task is one TensorIR program: only the
knobs that change the program are tasks (``task_points``: ``block_m``, ``block_n``, which shape
its buffers and loops, and the schedule's ``PROGRAM_KNOBS``, such as sm90's ``min_blocks_per_sm``,
a function attribute). Inside a task, each valid combination of the schedule's ``STRUCTURE_KNOBS``
(plain Python values that change which schedule steps run: layouts, copies, stage counts) is a
design space of its own (``structures``), and every other knob with more than one candidate is a
``sch.sample_categorical`` decision handed to ``schedule(sch, **knobs)`` as the ExprRV itself
(split factors take ExprRVs). The trace then *refers* to the decision, so replaying it with
another decision gives another schedule; reading the value with ``sch.get(rv)`` would bake the
first sample into the trace as a constant. TVM's own mutators only mutate categorical decisions
that feed an unroll annotation or a thread binding, so :class:`MutateKnob` mutates ours and moves
candidates between structures. :class:`PreCheck` (a postprocessor) rejects candidates that cannot
build before they are built; :class:`PromisingTasksFirst` spends the trials on tasks that can win.

Tune static, run symbolic. Each task's program is specialised to a representative shape (batch,
sequence lengths, softmax_scale), tuned with the XGBoost cost model and the evolutionary search,
and built exactly as :class:`tvmflash.Kernel` builds (``lowering.build``: the schedule's
PassContext config and the TVM workarounds). MetaSchedule's few fastest configurations
(``recheck``) are then built as ``tvmflash.compile`` builds them (symbolic shapes, which may rank
tiles differently) and timed with the default knobs on real torch tensors in the same run; the
fastest whose output passes flash-attn's error rule there (``bench.error_vs_float32``) is written
to tvmflash's database, where ``tvmflash.compile()`` finds it.

A structure or task that ``candidate_problem`` rejects (shared memory over the target's limit, the
schedule's ``knobs_problem``) is left out with a message before anything is built; candidates
that still fail to schedule, build or run are recorded by MetaSchedule as failed measurements and
never picked.

Warm start (the default): the known configurations (the defaults, the best user and shipped
records) seed MetaSchedule's database, where the evolutionary search takes its initial population
from, and are timed again with the search's best, so the stored record is never slower than they
are. ``cold`` hides them. Progress (``Reporter``) is reported from the first build on, each build
batch and each measurement as it comes, through MetaSchedule's extension points: a builder, a runner
and a measure callback of our own.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import math
import os
import random
import time
from pathlib import Path

import torch
import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.ir.utils import derived_object

import tvmflash
from tvmflash import bench, cache, choice, database, lowering, program
from tvmflash.kernels import checks, compile, forget_kernels
from tvmflash import schedules as schedule_registry
from tvmflash import target as targets

# Representative shapes when none is given: bench's grids (batch * seqlen tokens, heads * head_dim).
_DEFAULT_SHAPE = {"cuda": {"seqlen": 4096, "tokens": 16384, "hidden": 2048},
                  "cpu": {"seqlen": 512, "tokens": 2048, "hidden": 512}}
_FAILED = 1e9  # MetaSchedule's run time for a failed candidate is 1e10 s


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


@derived_object
class MutateKnob(ms.mutator.PyMutator):
    """Mutate one knob: move a random sampled knob's SampleCategorical decision to another
    candidate, or (``retrace``, a task of several structures) move the candidate to another of the
    task's structures that differs in one structural knob, with the same sampled decisions. TVM's
    own mutators only mutate categorical decisions that feed an unroll annotation or a thread
    binding, and none changes a design space."""

    def __init__(self, seed: int = 0, structures_: list[dict] | None = None, retrace=None):
        self._rng = random.Random(seed)
        self.structures, self.retrace = structures_ or [{}], retrace

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, trace, _rand_state):
        choices = [inst for inst in trace.insts
                   if inst.kind.name == "SampleCategorical" and len(inst.attrs[0]) > 1]
        index = structure_index(trace, self.structures)
        current = self.structures[index]
        # the structure knobs some other structure of the task sets otherwise
        names = [n for n in current if any(s[n] != current[n] for s in self.structures)] if self.retrace else []
        # each knob equally likely: a structural one (names) or a sampled one (choices)
        pick = self._rng.randrange(len(names) + len(choices)) if names or choices else None
        if pick is None:
            return None
        if pick < len(names):
            # a structure with another value of this knob, and of the fewest others (a layout may
            # need another copy to go with it)
            name = names[pick]
            distance = {i: sum(s[n] != current[n] for n in current) for i, s in enumerate(self.structures)
                        if s[name] != current[name]}
            nearest = [i for i, d in distance.items() if d == min(distance.values())]
            return self.retrace(trace, self._rng.choice(nearest))
        inst = choices[pick - len(names)]
        old = int(trace.get_decision(inst))
        new = self._rng.choice([d for d in range(len(inst.attrs[0])) if d != old])
        return trace.with_decision(inst, new, remove_postproc=True)

    def clone(self):
        return MutateKnob(self._rng.randrange(2**31), self.structures, self.retrace)


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


def specialize(func, spec: program.AttentionSpec, *, batch: int, seqlen_q: int, seqlen_k: int,
               softmax_scale: float):
    """The program with a static shape and scale, its tensors compact: what MetaSchedule measures."""
    q, k, v, out, _lse, scale = func.params  # LSE shares Q's shape vars

    def compact(name, seqlen, heads):
        shape = (batch, seqlen, heads, spec.head_dim)
        strides = (seqlen * heads * spec.head_dim, heads * spec.head_dim, spec.head_dim, 1)
        return tvm.tirx.decl_buffer(shape, spec.dtype, name, strides=strides)

    return func.specialize({
        q: compact("Q", seqlen_q, spec.heads_q), k: compact("K", seqlen_k, spec.heads_kv),
        v: compact("V", seqlen_k, spec.heads_kv), out: compact("O", seqlen_q, spec.heads_q),
        scale: tvm.tirx.FloatImm("float32", softmax_scale),
    })


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity: ``taskset`` splits a machine between
    several ``tvmflash tune`` processes, whose thread pools would otherwise each take every core)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def gpu_timing_lock():
    """Held while timing on this process's GPU(s): several ``tvmflash tune`` processes on one GPU
    then build their candidates in parallel but time them one at a time (a file lock under the
    cache dir, one per ``CUDA_VISIBLE_DEVICES`` value)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "-") or "none"
    return database.locked(cache.cache_dir() / f"gpu-timing-{visible}")


def _timed_alone(rt_mod, device, evaluator_config, repeated_args):
    """MetaSchedule's f_run_evaluator (in a runner worker): the default one, under gpu_timing_lock."""
    with gpu_timing_lock():
        return ms.runner.local_runner.default_run_evaluator(rt_mod, device, evaluator_config, repeated_args)


def _ms_build(mod, target, _params, **options):
    """MetaSchedule's f_build: the same build as Kernel's (runs in a builder worker process).

    Returns the runtime module: MetaSchedule's exporter takes that, not tvm.compile's Executable.
    """
    return lowering.build(mod, target, **options).mod


class Reporter:
    """The run's live status, from the first build on: each candidate built, each measurement as it
    comes (trials done of the total, failures, best so far, elapsed and estimated remaining time).

    With ``stream`` (a terminal) the status is one progress bar redrawn in place, and other lines
    (``note``) are printed above it; without, each trial is a plain line through ``echo``, which is
    what a log file or a pipe wants."""

    BAR_WIDTH = 24

    def __init__(self, trials: int, echo=print, stream=None):
        self.trials, self.echo, self.stream = trials, echo, stream
        self.done = self.failed = 0
        self.best_ms = math.inf
        self.start = time.perf_counter()

    def status(self) -> str:
        elapsed = time.perf_counter() - self.start
        # The remaining time assumes the trials left cost what the trials so far did on average.
        left = f", ~{elapsed / self.done * max(0, self.trials - self.done):.0f} s left" if self.done else ""
        best = f"{self.best_ms:.4f} ms" if self.best_ms < math.inf else "none yet"
        return f"{self.done}/{self.trials} trials, {self.failed} failed, best {best}, {elapsed:.0f} s{left}"

    def trial(self, run_ms: float | None, what: str) -> None:
        """One candidate measured (``run_ms``) or failed (None); ``what`` says which, for the log."""
        self.done += 1
        if run_ms is None:
            self.failed += 1
        else:
            self.best_ms = min(self.best_ms, run_ms)
        if self.stream is not None:
            self._draw()
        else:
            self.echo(f"  trial {self.done}: {what} ({self.status()})")

    def note(self, text: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if self.stream is None:
            self.echo(text)
            return
        self.stream.write(f"\r\x1b[K{text}\n")
        self._draw()

    def close(self) -> None:
        """Leave the last bar on its line, so what is printed next starts on a new one."""
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self) -> None:
        filled = round(self.BAR_WIDTH * min(self.done, self.trials) / max(1, self.trials))
        self.stream.write(f"\r\x1b[K[{'#' * filled}{'.' * (self.BAR_WIDTH - filled)}] {self.status()}")
        self.stream.flush()


def _last_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[-1] if lines else str(text)


@derived_object
class ReportedFuture(ms.runner.PyRunnerFuture):
    """A runner future that tells the Reporter about its measurement once, when MetaSchedule first
    sees it finished (it polls ``done`` between tasks) or asks for it."""

    def __init__(self, inner, reporter: Reporter):
        self.inner, self.reporter, self.reported = inner, reporter, None

    def done(self) -> bool:
        finished = self.inner.done()
        if finished:
            self.result()
        return finished

    def result(self):
        if self.reported is None:
            self.reported = result = self.inner.result()
            secs = [float(s) for s in (result.run_secs or [])]
            if result.error_msg or not secs or max(secs) >= _FAILED:
                self.reporter.trial(None, f"failed to run: {_last_line(result.error_msg or 'no run time')}")
            else:
                run_ms = 1e3 * sum(secs) / len(secs)
                self.reporter.trial(run_ms, f"{run_ms:.4f} ms")
        return self.reported


@derived_object
class ReportingRunner(ms.runner.PyRunner):
    """MetaSchedule's runner, each measurement reported as it comes (``ReportedFuture``): its
    measure callbacks see a whole batch at once, and only once it is joined."""

    def __init__(self, inner, reporter: Reporter):
        self.inner, self.reporter = inner, reporter

    def run(self, runner_inputs):
        return [ReportedFuture(future, self.reporter) for future in self.inner.run(runner_inputs)]


@derived_object
class Progress(ms.measure_callback.PyMeasureCallback):
    """Prints trials done and the best time so far; remembers the best candidate's knobs."""

    def __init__(self, tasks: list[dict], trials: int, echo):
        self.tasks, self.trials, self.echo = tasks, trials, echo
        self.done = self.failed = 0
        self.best_ms, self.best_knobs = math.inf, None
        self.measured: dict[str, tuple[float, dict]] = {}  # each configuration's fastest run
        self.task_best: dict[int, float] = {}  # task id -> its fastest run (ms), for PromisingTasksFirst
        # task id -> the configurations measured (failed ones too); a task is exhausted once it has
        # measured them all or a search round of it found nothing new (PromisingTasksFirst skips it)
        self.task_measured: dict[int, set] = {}
        self.exhausted: set[int] = set()
        self.on_join: list = []  # called with the task id each time a task's batch comes back
        self.start = time.perf_counter()

    def ranked(self, n: int) -> list[tuple[float, dict]]:
        """The n fastest configurations measured: (ms, knobs), fastest first."""
        return sorted(self.measured.values(), key=lambda entry: entry[0])[:n]

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        task = self.tasks[task_id]
        for hook in self.on_join:
            hook(task_id)
        if not measure_candidates:
            self.exhausted.add(task_id)
            return
        for cand, built, ran in zip(measure_candidates, builder_results, runner_results):
            self.done += 1
            knobs = decided_knobs(cand.sch.trace, task["fixed"], task["sampled"], task.get("structures"))
            key = repr(sorted(knobs.items()))
            self.task_measured.setdefault(task_id, set()).add(key)
            secs = [float(s) for s in (ran.run_secs or [])]
            error = built.error_msg or ran.error_msg
            if error or not secs or max(secs) >= _FAILED:
                self.failed += 1
                if self.failed <= 3:  # say why, briefly; the full message is in the work dir's logs
                    lines = [line for line in str(error or "no run time").splitlines() if line.strip()]
                    self.echo(f"  candidate failed ({task['name']}): {lines[-1] if lines else error}")
                continue
            ms_ = 1e3 * sum(secs) / len(secs)
            if key not in self.measured or ms_ < self.measured[key][0]:
                self.measured[key] = (ms_, knobs)
            self.task_best[task_id] = min(ms_, self.task_best.get(task_id, math.inf))
            if ms_ < self.best_ms:
                self.best_ms, self.best_knobs = ms_, knobs
        if len(self.task_measured[task_id]) >= configurations(task):
            self.exhausted.add(task_id)
        best = f"{self.best_ms:.4f} ms {self.best_knobs}" if self.best_knobs else "none yet"
        self.echo(f"[{self.done}/{self.trials} trials, {self.failed} failed, {time.perf_counter() - self.start:.0f} s] "
                  f"task {task['name']}: best so far {best}")


@derived_object
class PromisingTasksFirst(ms.task_scheduler.PyTaskScheduler):
    """MetaSchedule task scheduler for tasks that are *alternatives* (each task one program of the
    same kernel, and only the fastest matters). TVM's "gradient" scheduler minimises the weighted
    *sum* of the tasks' latencies (a network's operators) and starts with a round of every task;
    round-robin spreads trials evenly. Here the tasks come in order of promise (``tune``: the ones
    holding the known configurations first, then the programs nearest to the defaults), at most
    ``explore`` of the batches go to tasks not tried yet, one batch each in that order, and the
    others to the tasks whose best is within ``near`` of the best so far (the fewest batches
    first); a task that measured slower than that gets no more trials."""

    def __init__(self, progress, batches: int, explore: float = 0.5, near: float = 1.1):
        super().__init__()
        self.progress, self.near = progress, near
        self.explore_batches = max(1, math.ceil(batches * explore))
        self.given: list[int] = []
        self.in_flight: set[int] = set()
        progress.on_join.append(self.in_flight.discard)

    def choose(self, alive: list[int]) -> int:
        best = self.progress.task_best
        unexplored = [i for i in alive if not self.given[i]]
        explored_batches = sum(1 for g in self.given if g)
        if unexplored and (explored_batches < self.explore_batches or not best):
            return unexplored[0]
        top = min(best.values(), default=math.inf)
        contenders = [i for i in alive if best.get(i, math.inf) <= self.near * top]
        if contenders:
            return min(contenders, key=lambda i: (self.given[i], i))
        return unexplored[0] if unexplored else min(alive, key=lambda i: (self.given[i], i))

    def next_task_id(self) -> int:
        scheduler = self._outer()
        records = scheduler.tasks_
        if not self.given:
            self.given = [0] * len(records)
        for i in range(len(records)):
            scheduler.touch_task(i)  # joins a task whose measurements have all come back
        while True:  # a task joined here may turn out exhausted: then choose again
            alive = [i for i in range(len(records)) if not records[i].is_terminated and i not in self.progress.exhausted]
            if not alive:
                return -1  # MetaSchedule joins the tasks still in flight
            task_id = self.choose(alive)
            if task_id not in self.in_flight:
                break
            scheduler.join_running_task(task_id)
            self.in_flight.discard(task_id)
            if task_id not in self.progress.exhausted:
                break
        self.in_flight.add(task_id)
        self.given[task_id] += 1
        # said before the search round, which takes seconds to a minute on a GPU task's space
        self.progress.echo(f"  searching task {self.progress.tasks[task_id]['name']} "
                           f"({time.perf_counter() - self.progress.start:.0f} s)")
        return task_id


@derived_object
class ProgressBuilder(ms.builder.PyBuilder):
    """MetaSchedule's builder, saying how many candidates are built as it goes. MetaSchedule runs
    the measure callbacks (``Progress``) only once every task's first batch is built and run, which
    with one configuration a task is most of a tuning run: without this it would be silent.

    MetaSchedule asks for one task's candidates at a time, so with one configuration a task the
    builds ran one after the other. ``build_ahead`` builds such tasks' modules all at once, on the
    inner builder's parallel workers, and ``build`` then hands each over when it is asked for."""

    def __init__(self, inner, reporter: Reporter):
        self.inner, self.reporter = inner, reporter
        self.built = self.failed = 0
        self.ahead: dict[int, list] = {}  # structural hash -> [(module, BuilderResult)]

    def build_ahead(self, mods: list, target) -> None:
        results = self._build([ms.builder.BuilderInput(mod, target) for mod in mods])
        for mod, result in zip(mods, results):
            self.ahead.setdefault(tvm_ffi.structural_hash(mod), []).append((mod, result))

    def build(self, build_inputs):
        results = [self._take_ahead(b.mod) for b in build_inputs]
        rest = iter(self._build([b for b, r in zip(build_inputs, results) if r is None]))
        results = [r if r is not None else next(rest) for r in results]
        for result in results:  # a candidate that failed to build never reaches the runner: its trial ends here
            if result.error_msg:
                self.reporter.trial(None, f"failed to build: {_last_line(result.error_msg)}")
        return results

    def _take_ahead(self, mod):
        entries = self.ahead.get(tvm_ffi.structural_hash(mod), [])
        for i, (built_mod, result) in enumerate(entries):
            if tvm_ffi.structural_equal(built_mod, mod):
                return entries.pop(i)[1]
        return None

    def _build(self, inputs):
        if not inputs:
            return []
        # Said before the batch starts too: a GPU build takes seconds a candidate, on every core.
        self.reporter.note(f"  building {len(inputs)} candidates, {time.perf_counter() - self.reporter.start:.0f} s")
        results = self.inner.build(inputs)
        self.built += len(results)
        self.failed += sum(1 for r in results if r.error_msg)
        failed = f", {self.failed} failed to build" if self.failed else ""
        self.reporter.note(f"  built {self.built}/{self.reporter.trials} candidates{failed}, "
                           f"{time.perf_counter() - self.reporter.start:.0f} s")
        return results


def configurations(task: dict) -> int:
    """How many configurations a task (``make_tasks``) holds: its structures times its sampled knobs' values."""
    return len(task.get("structures") or [{}]) * math.prod(len(values) for values in task.get("sampled", {}).values())


def _design_space(schedule, task: dict, context) -> tvm.IRModule:
    """The module of a task's design space (its one candidate when it samples no knob)."""
    sch = tvm.s_tir.Schedule(context.mod)
    space_fn(schedule, task["fixed"], task["sampled"], task.get("structures"))(sch)
    return sch.mod


@contextlib.contextmanager
def _workers_import_this_tvmflash():
    """Builder workers are fresh processes that unpickle ``_ms_build`` by reference: make them
    import this tvmflash (a source checkout may not be the installed one)."""
    root = str(Path(tvmflash.__file__).resolve().parent.parent)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([root] + ([old] if old else []))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _loggers(work_dir: Path, task_names: list[str]):
    """MetaSchedule's per-task loggers, writing to ``work_dir/logs``; only warnings reach the console
    (our progress lines say the rest)."""
    log_dir = str(work_dir / "logs")
    os.makedirs(log_dir, exist_ok=True)
    names = [f"tvm.s_tir.meta_schedule.logging.task_{i}_{name}" for i, name in enumerate(task_names)]
    console = {"class": "logging.StreamHandler", "stream": "ext://sys.stdout", "level": "WARNING",
               "formatter": "tvm.s_tir.meta_schedule.standard_formatter"}
    # Name the global logger's handlers ourselves: TVM's default lists the handlers it already has,
    # which breaks (an unnamed handler) the second time a process tunes.
    root = {"level": "DEBUG", "propagate": False,
            "handlers": ["tvm.s_tir.meta_schedule.console", "tvm.s_tir.meta_schedule.file"]}
    ms.logging.create_loggers(log_dir=log_dir, params=[{"log_dir": log_dir, "logger_name": n} for n in names],
                              logger_config={"loggers": {"tvm.s_tir.meta_schedule": root},
                                             "handlers": {"tvm.s_tir.meta_schedule.console": console}})
    return [ms.logging.get_logger(n) for n in names]


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


@derived_object
class PreCheck(ms.postproc.PyPostproc):
    """MetaSchedule postprocessor: rejects (returns False for) a candidate whose knobs
    ``candidate_problem`` says cannot build or run, so that the search samples another before
    anything is built or measured. ``stats["rejected"]`` counts them (shared by the clones)."""

    def __init__(self, check, fixed: dict, sampled: dict, structures_: list[dict], stats: dict):
        self.check, self.fixed, self.sampled, self.structures, self.stats = check, fixed, sampled, structures_, stats

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch) -> bool:
        problem = self.check(decided_knobs(sch.trace, self.fixed, self.sampled, self.structures))
        if problem is not None:
            self.stats["rejected"] = self.stats.get("rejected", 0) + 1
        return problem is None

    def clone(self):
        return PreCheck(self.check, self.fixed, self.sampled, self.structures, self.stats)


def make_tasks(schedule, spec: program.AttentionSpec, shape: dict, space: dict, target, work_dir: Path,
               rng: random.Random, echo, known: dict | None = None, stats: dict | None = None) -> list[dict]:
    """One MetaSchedule task per point of ``task_points`` (the knobs that change the program), on
    the static ``shape``. Inside it, one design space per structure (``structures``) that
    ``candidate_problem`` and the schedule accept, the other knobs sampled; ``PreCheck`` rejects
    the sampled candidates that cannot build. A structure or point rejected outright is left out
    with a message. Returns dicts with ``name``, ``fixed``, ``sampled``, ``structures``,
    ``context`` (a TuneContext) and ``seeds``: the traces of the ``known`` configurations (label
    -> knobs) that the task makes, [(label, trace)], for ``seed_database``."""
    schedule_name = schedule_registry.name_of(schedule)
    points = task_points(schedule, space)
    loggers = _loggers(work_dir, [task_name(p) for p in points])
    stats = {} if stats is None else stats

    def check(knobs):
        return candidate_problem(schedule, target, spec.head_dim, spec.dtype, knobs)

    tasks = []
    for point, logger in zip(points, loggers):
        name = task_name(point)
        options = structures(schedule, space, point)
        fixed, sampled = task_knobs(space, **point, structure_names=list(options[0]) if options else ())
        plain = {**schedule.KNOBS, **fixed}  # the task's knobs; the defaults fill in the sampled ones
        func = specialize(schedule_registry.program_for(spec, schedule, plain), spec, batch=shape["batch"],
                          seqlen_q=shape["seqlen"], seqlen_k=shape["seqlen"], softmax_scale=1.0 / math.sqrt(spec.head_dim))
        mod = tvm.IRModule({"main": func})
        kept, reasons = [], []
        for structure in options:
            problem = check({**plain, **structure})
            if problem is None:
                kept.append(structure)
            else:
                reasons.append(f"{task_name(structure)}: {problem}" if structure else problem)
        if kept:  # the schedule runs on the first (the others are tried as the design spaces are made)
            try:
                space_fn(schedule, fixed, sampled, kept[:1])(tvm.s_tir.Schedule(mod))
            except Exception as err:  # noqa: BLE001 - any schedule error means "not this program"
                lines = [line for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
                reasons, kept = [f"the {schedule_name} schedule rejects it: {lines[-1].strip()}"], []
        if not kept:
            echo(f"  skipping {name}: {reasons[0]}" + (f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""))
            continue
        for reason in reasons:
            echo(f"  {name}: leaving out {reason}")
        if getattr(schedule, "min_kv_tiles", None) and len({schedule.min_kv_tiles({**plain, **s}) for s in kept}) > 1:
            raise ValueError(f"space: the structures of {name} need programs with different min_kv_tiles")
        retracer = Retracer(schedule, mod, fixed, sampled, kept)
        # Every structure's trace now, on this thread: MutateKnob runs on the search's threads, and
        # the schedule run there, beside the threads replaying traces of the same module, crashed
        # the process on the H200 (a segfault in Tensorize, a double free).
        for index in range(len(kept)):
            retracer.trace(index)
        fn = space_fn(schedule, fixed, sampled, kept)
        seeds = [(label, trace) for label, knobs in (known or {}).items()
                 if (trace := seed_trace(schedule, mod, fixed, sampled, knobs, kept, retracer=retracer)) is not None]
        combos = configurations({"structures": kept, "sampled": sampled})
        mutators = {MutateKnob(rng.randrange(2**31), kept, retracer): 1.0} if combos > 1 else {}
        generator = ms.space_generator.ScheduleFn(fn, sch_rules=[], postprocs=[PreCheck(check, fixed, sampled, kept, stats)],
                                                  mutator_probs=mutators)
        # Small spaces: a small population, and give up early once every combination is measured.
        population = max(8, 4 * combos)
        # Each generation starts from the database's fastest records: the seeds, and as many of
        # this run's measurements again (MetaSchedule's default share, a fifth, holds 1 or 2).
        strategy = ms.search_strategy.EvolutionarySearch(
            population_size=population, init_measured_ratio=min(1.0, max(0.2, 2 * len(seeds) / population)),
            init_min_unmeasured=max(2, combos), genetic_num_iters=2, max_fail_count=3, genetic_max_fail_count=3)
        context = ms.TuneContext(mod=mod, target=target, space_generator=generator, search_strategy=strategy,
                                 task_name=name, rand_state=rng.randrange(2**31), num_threads=usable_cores(),
                                 logger=logger).clone()
        tasks.append({"name": name, "fixed": fixed, "sampled": sampled, "structures": kept, "context": context,
                      "seeds": seeds, "point": point})
    if not tasks:
        raise ValueError(f"space: the {schedule_name} schedule rejects every task of {space}")
    return tasks


# A seed's run time in MetaSchedule's database: ahead of every measurement, so that each generation's
# initial population holds the known configurations (their own times were taken at other shapes).
_SEED_SECS = 1e-9


def seed_database(db, contexts, tasks: list[dict]) -> list[str]:
    """Commit each task's seeds (``make_tasks``) into MetaSchedule's database as measured records of
    its workload: the evolutionary search picks its initial population from there. Returns the
    labels seeded."""
    labels = []
    for context, task in zip(contexts, tasks):
        if not task["seeds"]:
            continue
        workload = db.commit_workload(context.mod)
        args_info = ms.arg_info.ArgInfo.from_entry_func(context.mod, remove_preproc=True)
        for label, trace in task["seeds"]:
            db.commit_tuning_record(ms.database.TuningRecord(trace, workload, run_secs=[_SEED_SECS],
                                                             target=context.target, args_info=args_info))
            labels.append(label)
    return labels


def known_configurations(target, schedule_name: str, workload: dict, defaults: dict, *, cold: bool,
                         seqlen_k: int | None = None) -> dict[str, dict]:
    """label -> knobs: ``defaults`` (``default``), then unless ``cold`` the best record of the user's
    database (``user``) and of the shipped one (``shipped``) for ``workload`` (with its ``pass``),
    where they differ: of ``seqlen_k``'s bucket where it has one (``database.known_records``)."""
    known = {"default": defaults}
    if cold:
        return known
    for record in database.known_records(target, schedule_name, workload, seqlen_k):
        knobs = {**defaults, **record["knobs"]}
        if knobs not in known.values():
            known["user" if Path(record["source"]).parent == database.user_dir() else "shipped"] = knobs
    return known


def default_shape(target, head_dim: int, seqlen: int | None = None) -> dict:
    """bench's grid at ``seqlen`` (none given: the grid's default): its tokens in batches of it."""
    grid = _DEFAULT_SHAPE["cuda" if targets.is_cuda(target) else "cpu"]
    seqlen = seqlen or grid["seqlen"]
    return {"seqlen": seqlen, "batch": max(1, grid["tokens"] // seqlen), "heads": max(1, grid["hidden"] // head_dim)}


def tuning_request(head_dim: int, dtype, causal: bool, trials: int, target, batch: int | None, seqlen: int | None,
                   heads: int | None, shape_for=None) -> tuple[str, tvm.target.Target, dict]:
    """A tuning run's arguments, checked: the dtype's name, the resolved target and the tuning shape
    (``shape_for(target, head_dim)``, by default ``default_shape``, with the batch, seqlen and heads given)."""
    dtype = checks.dtype_name(dtype)
    checks.check_flag("causal", causal)
    program.AttentionSpec(head_dim, dtype, causal)  # validates head_dim and dtype
    if trials < 1:
        raise ValueError(f"trials: expected a positive number, got {trials}")
    resolved = targets.resolve(target)
    shape = dict(shape_for(resolved, head_dim) if shape_for else default_shape(resolved, head_dim, seqlen))
    shape.update({k: v for k, v in {"batch": batch, "seqlen": seqlen, "heads": heads}.items() if v is not None})
    if min(shape.values()) < 1:
        raise ValueError(f"shape: expected positive batch, seqlen and heads, got {shape}")
    return dtype, resolved, shape


def require_gpu(target) -> bool:
    """Whether ``target`` is a GPU; a ValueError if it is one and torch sees none to run on."""
    cuda = targets.is_cuda(target)
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"target: tuning {targets.describe(target)} needs a CUDA GPU to run on; none is visible")
    return cuda


def tune(*, head_dim: int, dtype, causal: bool, target=None, trials: int = 64, batch: int | None = None,
         seqlen: int | None = None, heads: int | None = None, work_dir=None, space: dict | None = None,
         trials_per_iter: int | None = None, seed: int | None = None, repeat: int = 20, recheck: int = 3,
         cold: bool = False, echo=print, bar_stream=None) -> dict:
    """Tune the knobs of the schedule that ``tvmflash.compile`` picks (``choice.choose_schedule``) for one
    workload on this machine and store the best in the database.

    Tunes on a static (batch, seqlen, seqlen, heads, heads) shape; the record then serves every
    shape of the workload (head_dim, dtype, causal) through ``tvmflash.compile()``. ``space``
    overrides the schedule's ``SPACE`` (a subset, for a quick run). ``recheck``: how many of
    MetaSchedule's fastest configurations are timed again through ``tvmflash.compile``.

    Warm (the default), the search starts from what is known: the schedule's defaults and the
    best user and shipped records seed MetaSchedule's database, and all of them are timed again
    with the search's best, so the stored result is never slower than they are in this run.
    ``cold`` hides them (no seeds, no records read; what a new GPU gets): the defaults are still
    timed, as the reference and the floor of what is stored.

    Progress goes to ``echo`` a line at a time, or with ``bar_stream`` (a terminal) as a progress
    bar redrawn there. Returns the new record (``default_ms``; ``tuned_ms`` for the fastest correct
    one of the search's; ``known_ms`` for each known configuration timed) with ``path``, the
    database file.
    """
    dtype, resolved, shape = tuning_request(head_dim, dtype, causal, trials, target, batch, seqlen, heads)
    # the schedule that tvmflash.compile would pick (on sm_90a the sm90 one unless TVMFLASH_SM90=0 or
    # this device's records favour sm80), not the target's first: a record of another would go unread
    schedule, why, _ = choice.choose_schedule(resolved, {"head_dim": head_dim, "dtype": dtype, "causal": causal}, None)
    schedule_name = schedule_registry.name_of(schedule)
    space = dict(space or schedule.SPACE)
    unknown = set(space) - set(schedule.KNOBS)
    if unknown:
        raise ValueError(f"space: {sorted(unknown)} are not knobs of the {schedule_name} schedule")
    cuda = require_gpu(resolved)
    workload = {"head_dim": head_dim, "dtype": dtype, "causal": causal}
    work_dir = Path(work_dir or cache.cache_dir() / "tuning-work" /
                    f"{schedule_name}-d{head_dim}-{dtype}-{'causal' if causal else 'full'}-{time.strftime('%Y%m%d-%H%M%S')}")
    work_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    echo(f"tvmflash tune: {schedule_name} schedule ({why}) on {targets.describe(resolved)}, d{head_dim} {dtype} "
         f"{'causal' if causal else 'full'}, shape b{shape['batch']} s{shape['seqlen']} h{shape['heads']}, "
         f"{trials} trials; work dir {work_dir}")
    if importlib.util.find_spec("xgboost") is None:  # else the first search round fails, after the first builds
        raise RuntimeError("tvmflash tune: MetaSchedule's cost model needs xgboost (pip install xgboost-cpu)")

    rng = random.Random(seed)
    spec = program.AttentionSpec(head_dim, dtype, causal, shape["heads"], shape["heads"])
    known = known_configurations(resolved, schedule_name, workload, choice.default_knobs(schedule, head_dim), cold=cold,
                                 seqlen_k=shape["seqlen"])
    stats: dict = {}  # PreCheck's count of candidates rejected before building
    tasks = make_tasks(schedule, spec, shape, space, resolved, work_dir, rng, echo, known=None if cold else known,
                       stats=stats)
    echo(f"  {len(tasks)} tasks (programs), {sum(len(t['structures']) for t in tasks)} design spaces")
    # The tasks in order of promise, for PromisingTasksFirst: those holding the user's best record,
    # the shipped one and the defaults (records were kept only where faster than the defaults), then
    # the programs that differ from the defaults' in the fewest knobs.
    rank = {"user": 0, "shipped": 1, "default": 2}
    defaults_point = known["default"]
    tasks.sort(key=lambda task: (min((rank[label] for label, _ in task["seeds"]), default=len(rank)),
                                 sum(value != defaults_point.get(name) for name, value in task["point"].items())))
    contexts = [task.pop("context") for task in tasks]
    total = sum(configurations(task) for task in tasks)
    if trials > total:  # MetaSchedule would measure some of them again
        echo(f"  the space has {total} configurations: {total} trials measure each once")
        trials = total
    num_cores = usable_cores()

    db = ms.database.JSONDatabase(work_dir=str(work_dir))
    if cold:
        echo("  cold start: no defaults or records seed the search")
    else:
        seeded = set(seed_database(db, contexts, tasks))
        outside = [label for label in known if label not in seeded]
        seeded = [label for label in known if label in seeded]
        echo(f"  warm start: seeded the search with the {', '.join(seeded) or 'no'} knobs"
             + (f" (the {', '.join(outside)} knobs are outside the space)" if outside else ""))

    reporter = Reporter(trials, echo, bar_stream)
    echo = reporter.note  # every line from here on goes above the progress bar
    progress = Progress(tasks, trials, echo)
    config = ms.runner.EvaluatorConfig(number=3, repeat=3 if cuda else 1, min_repeat_ms=50 if cuda else 20,
                                       enable_cpu_cache_flush=False)
    builder = ProgressBuilder(ms.builder.LocalBuilder(
        max_workers=num_cores, timeout_sec=120, f_build=functools.partial(_ms_build, **choice.build_options(schedule))),
        reporter)
    runner = ReportingRunner(ms.runner.LocalRunner(timeout_sec=120, evaluator_config=config,
                                                   f_run_evaluator=_timed_alone if cuda else None), reporter)
    with _workers_import_this_tvmflash():
        # A task of one configuration has one candidate, its design space itself: build those first,
        # all at once (the builder's workers in parallel).
        single = [(task, context) for task, context in zip(tasks, contexts)
                  if not task["sampled"] and len(task["structures"]) == 1]
        if len(single) > 1 and trials >= len(contexts):
            echo(f"  building the {len(single)} one-configuration tasks at once, {num_cores} at a time")
            builder.build_ahead([_design_space(schedule, task, context) for task, context in single], resolved)
        per_iter = trials_per_iter or max(2, min(16, trials // 4))
        ms.tune_tasks(
            tasks=contexts,
            task_weights=[1.0] * len(contexts),
            work_dir=str(work_dir),
            max_trials_global=trials,
            num_trials_per_iter=per_iter,
            builder=builder,
            runner=runner,
            database=db,
            cost_model=ms.cost_model.CostModel.create("xgb", num_tuning_cores=num_cores),
            measure_callbacks=[*ms.measure_callback.MeasureCallback.create("default"), progress],
            task_scheduler=PromisingTasksFirst(progress, batches=math.ceil(trials / per_iter)),
        )
    reporter.close()
    echo = reporter.echo
    echo(f"  {progress.failed} of {progress.done} measured candidates failed; the pre-check rejected "
         f"{stats.get('rejected', 0)} candidates before building")
    if progress.best_knobs is None:
        raise RuntimeError(f"tvmflash tune: none of {progress.done} candidates built and ran; see the logs in {work_dir}")
    defaults = known["default"]
    # MetaSchedule's fastest configurations, as tvmflash.compile builds them (symbolic shapes), and
    # the known ones (the defaults; warm, the records too). Static shapes can rank configurations
    # differently (on sm90 they did), so the best few are timed again rather than the best alone.
    candidates = {label: (None, knobs) for label, knobs in known.items()}
    search = []  # the labels of MetaSchedule's fastest: "#rank", or a known one's where it found that
    for rank, (ms_, knobs) in enumerate(progress.ranked(recheck), 1):
        knobs = {**defaults, **knobs}
        label = next((label for label, known_knobs in known.items() if known_knobs == knobs), f"#{rank}")
        candidates[label] = (ms_, knobs)
        search.append(label)

    # ---- the candidates on real tensors through tvmflash.compile, in this run ------------------
    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape["batch"], shape["seqlen"], shape["heads"], head_dim, generator=gen)
               .to(device=device, dtype=checks.TORCH_DTYPES[dtype]) for _ in range(3))
    out = torch.empty_like(q)
    kernels, correct, times = {}, {}, {}
    for label, (_ms, knobs) in candidates.items():  # builds (or loads) before taking the GPU, and checks
        kernels[label] = kern = compile(head_dim=head_dim, dtype=dtype, causal=causal, target=resolved,
                                               knobs=knobs)
        out.fill_(float("nan"))
        kern(q, k, v, out=out)
        error, tolerance = bench.error_vs_float32(out, q, k, v, causal)
        correct[label] = error <= tolerance  # flash-attn's rule, as tvmflash bench applies it
        if not correct[label]:
            echo(f"  the {label + ' knobs' if label in known else 'tuned knobs ' + label} give wrong results at the "
                 f"tuning shape (max error {error:.3e} > {tolerance:.3e}): never stored")
    if not any(correct.values()):
        raise RuntimeError("tvmflash tune: neither the tuned nor the known knobs give correct results")
    with gpu_timing_lock() if cuda else contextlib.nullcontext():
        for label, kern in kernels.items():
            times[label] = bench.time_ms(lambda kern=kern: kern(q, k, v, out=out), device, repeat=repeat)
    for label, (ms_, knobs) in candidates.items():
        static = f"MetaSchedule {ms_:.4f} ms, " if ms_ is not None else ""
        echo(f"  {label:<8} {static}tvmflash.compile {times[label]:.4f} ms{'' if correct[label] else ' (wrong)'}: "
             f"{ {n: knobs[n] for n in knobs if knobs[n] != defaults.get(n)} or 'the defaults'}")
    # "tuned": the fastest correct one of MetaSchedule's (else its first, to report); the record
    # keeps the fastest correct one of it and the known.
    tuned = search or ["default"]  # (recheck 0: the defaults stand for it)
    tuned_label = min((label for label in tuned if correct[label]), key=times.get, default=tuned[0])
    winner = min((label for label in (*known, tuned_label) if correct[label]), key=times.get)
    tuned_knobs, knobs = candidates[tuned_label][1], candidates[winner][1]
    wall_s = time.perf_counter() - start
    record = database.new_record(
        resolved, schedule_name, workload, knobs, times[winner],
        shape={"batch": shape["batch"], "seqlen_q": shape["seqlen"], "seqlen_k": shape["seqlen"],
               "heads_q": shape["heads"], "heads_kv": shape["heads"]},
        trials=progress.done, failed_trials=progress.failed, wall_s=round(wall_s, 1),
        default_ms=times["default"], tuned_ms=times[tuned_label], tuned_knobs=tuned_knobs,
        known_ms={label: times[label] for label in known}, start="cold" if cold else "warm",
        metaschedule_ms=progress.best_ms, work_dir=str(work_dir))
    path = database.add(record)
    forget_kernels()  # compile() must see the new record
    echo(f"best knobs: {tuned_knobs} (MetaSchedule's best: {progress.best_ms:.4f} ms)")
    echo(f"tvmflash.compile at b{shape['batch']} s{shape['seqlen']} h{shape['heads']}: default {times['default']:.4f} ms, "
         f"tuned {times[tuned_label]:.4f} ms ({times['default'] / times[tuned_label]:.2f}x)")
    # The database keeps the faster record of a key (its own time, at its own shape).
    kept = next((r for r in database.read(path) if database.same_key(r, record)), record)
    if kept != record:
        echo(f"kept the faster record already in {path} ({kept['mean_ms']:.4f} ms at {kept.get('shape')}): {kept['knobs']}")
    else:
        echo(f"stored the {winner if winner in known else 'tuned'} knobs {knobs} in {path} ({progress.done} trials, "
             f"{progress.failed} failed, {wall_s:.0f} s)")
    return {**record, "path": str(path)}
