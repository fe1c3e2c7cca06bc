"""The tasks of a run: one MetaSchedule TuneContext per program of the space (``make_tasks``), on a
static shape (``specialize``), with the space's mutator and postprocessor and an evolutionary search
each, and the known configurations committed as seeds (``seed_database``)."""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from tvmflash import program
from tvmflash import schedules as schedule_registry
from tvmflash.schedules.contract import Schedule
from tvmflash.tune.builder import usable_cores
from tvmflash.tune.mutator import MutateKnob
from tvmflash.tune.postproc import PreCheck
from tvmflash.tune.progress import left_out_line
from tvmflash.tune.space import (Retracer, candidate_problem, configurations, seed_trace, space_fn, structures,
                                 structures_share_a_program, task_knobs, task_name, task_points, with_defaults)


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


def tune_context(mod, target, space_generator, search_strategy, name: str, rand_state: int, num_threads: int,
                 logger) -> ms.TuneContext:
    """MetaSchedule's TuneContext, made as its constructor makes it but without importing TVM's tensor
    intrinsic library (``tvm.s_tir.tensor_intrin``: some 500 TVMScript functions of every target, parsed
    in 16-38 s on 2 CPU cores, once a process). Our schedules tensorize only with their own intrinsics
    (``schedules.common.register_intrin``), and the tasks' space generator has no schedule rules or
    postprocessors of TVM's that would look TVM's up. The arguments are objects already, as
    ``TuneContext.__init__`` would make them."""
    context = ms.TuneContext.__new__(ms.TuneContext)
    context.__init_handle_by_constructor__(tvm_ffi.get_global_func("s_tir.meta_schedule.TuneContext"), mod, target,
                                           space_generator, search_strategy, name, num_threads, rand_state,
                                           ms.logging.get_logging_func(logger))
    tvm_ffi.get_global_func("s_tir.meta_schedule.TuneContextInitialize")(context)
    return context.clone()


def make_tasks(schedule: Schedule, spec: program.AttentionSpec, shape: dict, space: dict, target, work_dir: Path,
               rng: random.Random, echo, known: dict | None = None, stats: dict | None = None) -> list[dict]:
    """One MetaSchedule task per point of ``task_points`` (the knobs that change the program), on
    the static ``shape``. Inside it, one design space per structure (``structures``) that
    ``candidate_problem`` and the schedule accept, the other knobs sampled; ``PreCheck`` rejects
    the sampled candidates that cannot build. A structure or point rejected outright is left out:
    one line (``echo``) counts them by reason, and ``work_dir/left_out.txt`` names each with why
    (a line each on the console, before the first trial, buried it on a GPU). Returns dicts with
    ``name``, ``fixed``, ``sampled``, ``structures``, ``context`` (a TuneContext) and ``seeds``: the
    traces of the ``known`` configurations (label -> knobs) that the task makes, [(label, trace)],
    for ``seed_database``."""
    schedule_name = schedule.name
    points = task_points(schedule, space)
    options_of = [structures(schedule, space, point) for point in points]
    total = sum(len(options) for options in options_of)
    echo(f"  building the design space: {len(points)} tasks (programs), pre-checking their {total} configurations "
         f"(structures), each task's schedule traced")
    start = time.perf_counter()
    loggers = _loggers(work_dir, [task_name(p) for p in points])
    stats = {} if stats is None else stats
    left_out = []  # "task structure: why", a line each configuration left out

    def check(knobs):
        return candidate_problem(schedule.forward.knobs, target, spec.head_dim, spec.dtype, knobs)

    tasks = []
    for point, options, logger in zip(points, options_of, loggers):
        name = task_name(point)
        fixed, sampled = task_knobs(space, **point, structure_names=list(options[0]) if options else ())
        plain = with_defaults(schedule, fixed)  # the task's knobs; the defaults fill in the sampled ones
        func = specialize(schedule_registry.program_for(spec, schedule, plain), spec, batch=shape["batch"],
                          seqlen_q=shape["seqlen"], seqlen_k=shape["seqlen"], softmax_scale=1.0 / math.sqrt(spec.head_dim))
        mod = tvm.IRModule({"main": func})
        kept = []
        for structure in options:
            problem = check({**plain, **structure})
            if problem is None:
                kept.append(structure)
            else:
                left_out.append((f"{name} {task_name(structure)}".strip(), problem))
        if kept:  # the schedule runs on the first (the others are tried as the design spaces are made)
            try:
                space_fn(schedule, fixed, sampled, kept[:1])(tvm.s_tir.Schedule(mod))
            except Exception as err:  # noqa: BLE001 - any schedule error means "not this program"
                lines = [line for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
                left_out += [(f"{name} {task_name(structure)}".strip(),
                              f"the {schedule_name} schedule rejects it: {lines[-1].strip()}") for structure in kept]
                kept = []
        if not kept:
            continue
        if not structures_share_a_program(schedule, plain, kept):
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
        context = tune_context(mod, target, generator, strategy, name, rng.randrange(2**31), usable_cores(), logger)
        tasks.append({"name": name, "fixed": fixed, "sampled": sampled, "structures": kept, "context": context,
                      "seeds": seeds, "point": point})
    details = None
    if left_out:
        details = work_dir / "left_out.txt"
        details.write_text("".join(f"{where}: {problem}\n" for where, problem in left_out))
    echo(f"  {len(tasks)} tasks (programs), {sum(len(t['structures']) for t in tasks)} design spaces, in "
         f"{time.perf_counter() - start:.0f} s; {left_out_line([p for _, p in left_out], total, details)}")
    if not tasks:
        raise ValueError(f"space: the {schedule_name} schedule rejects every task of {space}"
                         + (f"; first, {left_out[0][0]}: {left_out[0][1]}" if left_out else ""))
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
