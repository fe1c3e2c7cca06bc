"""The driver of ``tvmflash tune``: ``tune`` searches a schedule's forward space with MetaSchedule and
stores the best knobs in tvmflash's database; the tuning request (its shape and the known
configurations) that the measured passes (``measured.tune_pass``) share."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import random
import statistics
import time
from pathlib import Path

import torch
import tvm
from tvm.s_tir import meta_schedule as ms

from tvmflash import bench, cache, choice, database, kernels, program
from tvmflash.kernels import checks
from tvmflash import target as targets
from tvmflash.schedules.contract import KnobSet, Schedule
from tvmflash.tune import decision
from tvmflash.tune.builder import PooledBuilder, ProgressBuilder, ms_build, usable_cores, workers_import_this_tvmflash
from tvmflash.tune.progress import Progress, Reporter
from tvmflash.tune.runner import ReportingRunner, gpu_timing_lock, timed_alone
from tvmflash.tune.space import configurations, searched_space, space_fn
from tvmflash.tune.task import make_tasks, seed_database
from tvmflash.tune.task_scheduler import PromisingTasksFirst


# Representative shapes when none is given: bench's grids (batch * seqlen tokens, heads * head_dim).
_DEFAULT_SHAPE = {"cuda": {"seqlen": 4096, "tokens": 16384, "hidden": 2048},
                  "cpu": {"seqlen": 512, "tokens": 2048, "hidden": 512}}


def known_configurations(target, knobset: KnobSet, workload: dict, defaults: dict, *, cold: bool,
                         seqlen_k: int | None = None) -> dict[str, dict]:
    """label -> knobs: ``defaults`` (``default``), then unless ``cold`` the best record of the user's
    database (``user``) and of the shipped one (``shipped``) for ``workload`` (with its ``pass``),
    where they differ: of ``seqlen_k``'s bucket where it has one (``database.known_records``), of
    the schedule and program of ``knobset``, and whose knobs it accepts."""
    known = {"default": defaults}
    if cold:
        return known
    for record in database.known_records(target, knobset.schedule, workload, seqlen_k, usable=knobset.accepts):
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
    # (the FP8 forward's e4m3, which the measured pass "fp8" tunes; the kernels' own dtypes else)
    dtype = program.FP8 if dtype in (program.FP8, getattr(torch, program.FP8)) else checks.dtype_name(dtype)
    causal = checks.check_flag("causal", causal)
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
    workload on this machine and store the best in the database, where it beats the incumbent (the
    knobs compile() takes now) by more than the noise of repeated timings (``decision.decide``; else
    the record keeps the incumbent's knobs).

    Tunes on a static (batch, seqlen, seqlen, heads, heads) shape; the record then serves every
    shape of the workload (head_dim, dtype, causal) through ``tvmflash.compile()``. ``space``
    (knob name -> candidates) overrides the space of the schedule's forward knobs (a subset, for a
    quick run). ``recheck``: how many of
    MetaSchedule's fastest configurations are timed again through ``tvmflash.compile``.

    Warm (the default), the search starts from what is known: the schedule's defaults and the
    best user and shipped records seed MetaSchedule's database, and all of them are timed again
    with the search's best, so the stored result is never slower than they are in this run, by
    more than the noise.
    ``cold`` hides them (no seeds, no records read; what a new GPU gets): the defaults are still
    timed, as the reference and the floor of what is stored.

    Progress goes to ``echo`` a line at a time, or with ``bar_stream`` (a terminal) as a progress
    bar redrawn there. Returns the new record (``default_ms``; ``tuned_ms`` for the fastest correct
    one of the search's; ``known_ms`` for each known configuration timed; ``incumbent``, ``kept``,
    ``decision`` and ``noise``: what it was compared with and why it holds its knobs) with ``path``,
    the database file.
    """
    dtype, resolved, shape = tuning_request(head_dim, dtype, causal, trials, target, batch, seqlen, heads)
    if dtype == program.FP8:  # its knob set is small, and its kernel not compile()'s: measured whole
        raise ValueError(f"dtype: the FP8 forward is tuned by tune_pass('fp8') (tvmflash tune --dtype {program.FP8})")
    # the schedule that tvmflash.compile would pick (on sm_90a the sm90 one unless TVMFLASH_SM90=0 or
    # this device's records favour sm80), not the target's first: a record of another would go unread
    workload = choice.workload({"head_dim": head_dim, "dtype": dtype, "causal": causal})
    schedule, why, _ = choice.choose_schedule("forward", resolved, workload)
    schedule_name = schedule.name
    space = searched_space(schedule, space, dtype)
    cuda = require_gpu(resolved)
    work_dir = _work_dir(work_dir, schedule_name, workload)
    start = time.perf_counter()
    echo(f"tvmflash tune: {schedule_name} schedule ({why}) on {targets.describe(resolved)}, d{head_dim} {dtype} "
         f"{'causal' if causal else 'full'}, shape b{shape['batch']} s{shape['seqlen']} h{shape['heads']}, "
         f"{trials} trials; work dir {work_dir}")
    if importlib.util.find_spec("xgboost") is None:  # else the first search round fails, after the first builds
        raise RuntimeError("tvmflash tune: MetaSchedule's cost model needs xgboost (pip install xgboost-cpu)")

    spec = program.AttentionSpec(head_dim, dtype, causal, shape["heads"], shape["heads"])
    known = known_configurations(resolved, schedule.forward.knobs, workload,
                                 schedule.forward.knobs.defaults(head_dim, dtype=dtype),
                                 cold=cold, seqlen_k=shape["seqlen"])
    stats: dict = {}  # PreCheck's count of candidates rejected before building
    tasks = make_tasks(schedule, spec, shape, space, resolved, work_dir, random.Random(seed), echo,
                       known=None if cold else known, stats=stats)
    contexts = _by_promise(tasks, known["default"])
    trials = _trials_within(tasks, trials, echo)
    db = _search_database(work_dir, contexts, tasks, known, cold, echo)
    progress = _search(schedule, tasks, contexts, db, resolved, work_dir, trials, trials_per_iter, cuda, echo,
                       bar_stream)
    echo(f"  {progress.failed} of {progress.done} measured candidates failed; the pre-check rejected "
         f"{stats.get('rejected', 0)} candidates before building")
    if progress.best_knobs is None:
        raise RuntimeError(f"tvmflash tune: none of {progress.done} candidates built and ran; see the logs in {work_dir}")

    candidates, search = _rechecked_candidates(known, progress, recheck)
    times, rounds, correct = _timed_through_compile(schedule, candidates, known, workload, resolved, shape, cuda,
                                                    repeat, echo)
    tuned_label, winner = _tuned_and_winner(known, search, correct, times)
    incumbent = decision.incumbent(known)
    verdict = decision.decide(rounds, incumbent, winner,
                              None if correct[incumbent] else "give wrong results at the tuning shape")
    tuned_knobs, knobs = candidates[tuned_label][1], candidates[verdict.kept][1]
    wall_s = time.perf_counter() - start
    record = database.new_record(
        resolved, schedule_name, workload, knobs, times[verdict.kept],
        shape={"batch": shape["batch"], "seqlen_q": shape["seqlen"], "seqlen_k": shape["seqlen"],
               "heads_q": shape["heads"], "heads_kv": shape["heads"]},
        trials=progress.done, failed_trials=progress.failed, wall_s=round(wall_s, 1),
        default_ms=times["default"], tuned_ms=times[tuned_label], tuned_knobs=tuned_knobs,
        known_ms={label: times[label] for label in known}, start="cold" if cold else "warm",
        metaschedule_ms=progress.best_ms, work_dir=str(work_dir), **verdict.record_fields())
    echo(f"best knobs: {tuned_knobs} (MetaSchedule's best: {progress.best_ms:.4f} ms)")
    echo(f"tvmflash.compile at b{shape['batch']} s{shape['seqlen']} h{shape['heads']}: default {times['default']:.4f} ms, "
         f"tuned {times[tuned_label]:.4f} ms ({times['default'] / times[tuned_label]:.2f}x)")
    path = store(record, verdict, cold, echo, f"{progress.done} trials, {progress.failed} failed, {wall_s:.0f} s")
    return {**record, "path": str(path)}


def store(record: dict, verdict: decision.Decision, cold: bool, echo, what: str) -> Path:
    """Write the run's record (the kept configuration's knobs, ``decision.decide``) and say why it holds
    them. Warm, it replaces the key's record whatever their times: that record's knobs were the
    incumbent, timed in this run, which compares them more fairly than two runs' times (perhaps at two
    shapes of the bucket). Cold, no record was read or timed: the faster by its own time stays."""
    echo(("stored: " if verdict.replaced else "not stored: ") + verdict.reason)
    path = database.add(record, replace=not cold)
    kernels.forget_kernels()  # compile() must see the new record
    kept = next((r for r in database.read(path) if database.same_key(r, record)), record)
    if kept != record:
        echo(f"kept the faster record already in {path} ({kept['mean_ms']:.4f} ms at {kept.get('shape')}): {kept['knobs']}")
    else:
        echo(f"the record in {path} holds {decision.describe(verdict.kept)} {record['knobs']} ({what})")
    return path


def _work_dir(work_dir, schedule_name: str, workload: dict) -> Path:
    """The run's MetaSchedule work dir, made: ``work_dir``, else a new one under the cache dir."""
    head_dim, dtype, causal = workload["head_dim"], workload["dtype"], workload["causal"]
    work_dir = Path(work_dir or cache.cache_dir() / "tuning-work" /
                    f"{schedule_name}-d{head_dim}-{dtype}-{'causal' if causal else 'full'}-{time.strftime('%Y%m%d-%H%M%S')}")
    work_dir.mkdir(parents=True, exist_ok=True)
    return work_dir


def _by_promise(tasks: list[dict], defaults_point: dict) -> list:
    """Sort the tasks in order of promise, for PromisingTasksFirst, and take their TuneContexts out of
    them (returned, in that order). First those holding the user's best record, the shipped one and
    the defaults (records were kept only where faster than the defaults), then the programs that
    differ from the defaults' in the fewest knobs."""
    rank = {"user": 0, "shipped": 1, "default": 2}
    tasks.sort(key=lambda task: (min((rank[label] for label, _ in task["seeds"]), default=len(rank)),
                                 sum(value != defaults_point.get(name) for name, value in task["point"].items())))
    return [task.pop("context") for task in tasks]


def _trials_within(tasks: list[dict], trials: int, echo) -> int:
    """``trials``, at most the configurations the tasks hold."""
    total = sum(configurations(task) for task in tasks)
    if trials > total:  # MetaSchedule would measure some of them again
        echo(f"  the space has {total} configurations: {total} trials measure each once")
        trials = total
    return trials


def _search_database(work_dir: Path, contexts: list, tasks: list[dict], known: dict, cold: bool, echo):
    """MetaSchedule's database in the work dir; warm, the known configurations are seeded into it."""
    db = ms.database.JSONDatabase(work_dir=str(work_dir))
    if cold:
        echo("  cold start: no defaults or records seed the search")
    else:
        seeded = set(seed_database(db, contexts, tasks))
        outside = [label for label in known if label not in seeded]
        seeded = [label for label in known if label in seeded]
        echo(f"  warm start: seeded the search with the {', '.join(seeded) or 'no'} knobs"
             + (f" (the {', '.join(outside)} knobs are outside the space)" if outside else ""))
    return db


def _search(schedule: Schedule, tasks: list[dict], contexts: list, db, target, work_dir: Path, trials: int,
            trials_per_iter: int | None, cuda: bool, echo, bar_stream) -> Progress:
    """MetaSchedule's search over the tasks, reported from the first build on (a bar on
    ``bar_stream``, else a line a trial). Returns the measure callback, which holds what it measured."""
    num_cores = usable_cores()
    reporter = Reporter(trials, echo, bar_stream)
    echo = reporter.note  # every line from here on goes above the progress bar
    progress = Progress(tasks, trials, echo)
    config = ms.runner.EvaluatorConfig(number=3, repeat=3 if cuda else 1, min_repeat_ms=50 if cuda else 20,
                                       enable_cpu_cache_flush=False)
    f_build = functools.partial(ms_build, **schedule.build_options("forward"))
    pool = PooledBuilder(max_workers=num_cores, timeout_sec=120, f_build=f_build)
    builder = ProgressBuilder(pool, reporter)
    runner = ReportingRunner(ms.runner.LocalRunner(timeout_sec=120, evaluator_config=config,
                                                   f_run_evaluator=timed_alone if cuda else None), reporter)
    with workers_import_this_tvmflash(), contextlib.closing(pool):
        # A task of one configuration has one candidate, its design space itself: build those first,
        # all at once (the builder's workers in parallel).
        single = [(task, context) for task, context in zip(tasks, contexts)
                  if not task["sampled"] and len(task["structures"]) == 1]
        if len(single) > 1 and trials >= len(contexts):
            echo(f"  building the {len(single)} one-configuration tasks at once, {num_cores} at a time")
            builder.build_ahead([_design_space(schedule, task, context) for task, context in single], target)
        per_iter = trials_per_iter or max(2, min(16, trials // 4))
        # (until the first batch is out, MetaSchedule starts its builder's processes and draws the first
        # population: some seconds with nothing else to show)
        echo(f"  searching: {trials} trials over {len(contexts)} tasks, {per_iter} a batch, {num_cores} build "
             f"processes")
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
    return progress


def _design_space(schedule: Schedule, task: dict, context) -> tvm.IRModule:
    """The module of a task's design space (its one candidate when it samples no knob)."""
    sch = tvm.s_tir.Schedule(context.mod)
    space_fn(schedule, task["fixed"], task["sampled"], task.get("structures"))(sch)
    return sch.mod


def _rechecked_candidates(known: dict, progress: Progress, recheck: int) -> tuple[dict, list[str]]:
    """label -> (MetaSchedule's ms or None, knobs): the known configurations (the defaults; warm, the
    records too) and MetaSchedule's ``recheck`` fastest, to be timed as tvmflash.compile builds them
    (symbolic shapes). Static shapes can rank configurations differently (on sm90 they did), so the
    best few are timed again rather than the best alone. Also the labels of MetaSchedule's fastest:
    "#rank", or a known one's where it found that."""
    defaults = known["default"]
    candidates = {label: (None, knobs) for label, knobs in known.items()}
    search = []
    for rank, (ms_, knobs) in enumerate(progress.ranked(recheck), 1):
        knobs = {**defaults, **knobs}
        label = next((label for label, known_knobs in known.items() if known_knobs == knobs), f"#{rank}")
        candidates[label] = (ms_, knobs)
        search.append(label)
    return candidates, search


def _timed_through_compile(schedule: Schedule, candidates: dict, known: dict, workload: dict, target, shape: dict,
                           cuda: bool, repeat: int, echo) -> tuple[dict, dict, dict]:
    """The candidates on real tensors through tvmflash.compile, in this run, on the schedule tuned (named:
    knobs alone do not say whose they are): each built (or loaded) and checked before taking the GPU,
    then timed ``decision.ROUNDS`` times in turns (``decision.timed_rounds``), so that the spread of
    each one's timings shows the noise a new record must beat. Returns label -> median ms, label ->
    ms of each round and label -> correct."""
    head_dim, dtype, causal = workload["head_dim"], workload["dtype"], workload["causal"]
    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape["batch"], shape["seqlen"], shape["heads"], head_dim, generator=gen)
               .to(device=device, dtype=checks.TORCH_DTYPES[dtype]) for _ in range(3))
    out = torch.empty_like(q)
    built, correct = {}, {}
    for label, (_ms, knobs) in candidates.items():
        built[label] = kern = kernels.compile(head_dim=head_dim, dtype=dtype, causal=causal, target=target,
                                               knobs=knobs, schedule=schedule.name)
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
        calls = {label: lambda kern=kern: kern(q, k, v, out=out) for label, kern in built.items()}
        rounds = decision.timed_rounds(calls, lambda call: bench.time_ms(call, device, repeat=repeat))
    times = {label: statistics.median(ms) for label, ms in rounds.items()}
    defaults = known["default"]
    for label, (ms_, knobs) in candidates.items():
        static = f"MetaSchedule {ms_:.4f} ms, " if ms_ is not None else ""
        spread = decision.spread(rounds[label])
        echo(f"  {label:<8} {static}tvmflash.compile {times[label]:.4f} ms (spread {spread:.1%})"
             f"{'' if correct[label] else ' (wrong)'}: "
             f"{ {n: knobs[n] for n in knobs if knobs[n] != defaults.get(n)} or 'the defaults'}")
    return times, rounds, correct


def _tuned_and_winner(known: dict, search: list[str], correct: dict, times: dict) -> tuple[str, str]:
    """"tuned": the fastest correct one of MetaSchedule's (else its first, to report); the winner,
    which the record keeps: the fastest correct one of it and the known."""
    tuned = search or ["default"]  # (recheck 0: the defaults stand for it)
    tuned_label = min((label for label in tuned if correct[label]), key=times.get, default=tuned[0])
    winner = min((label for label in (*known, tuned_label) if correct[label]), key=times.get)
    return tuned_label, winner
