"""Tuning (issue 5): design spaces, a real short llvm tuning run, the tuning database and the CLI."""

import json
import random
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import tvm

import tvmflash
from tvmflash import choice, database, kernels, program, tune
from tvmflash import target as targets
from tvmflash.schedules import cpu, cuda, sm80, sm90

CPU = targets.cpu_target()
WORKLOAD = {"head_dim": 32, "dtype": "float32", "causal": False}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache dir (modules and tuning records) and no in-memory kernels."""
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    kernels.forget_kernels()
    yield tmp_path
    kernels.forget_kernels()


def vector_widths(sch):
    return sorted({int(n) for n in re.findall(r"T.vectorized\((\d+)\)", sch.mod.script())})


# ----------------------------------------------------------------------------- design spaces
def test_spaces_hold_knobs_of_their_schedules():
    for module in (cpu, cuda, sm80):
        assert set(module.SPACE) <= set(module.KNOBS)
        assert module.KNOBS["block_m"] in module.SPACE["block_m"] and module.KNOBS["block_n"] in module.SPACE["block_n"]
    # sm80 needs block_m == 32 * num_warps: num_warps is derived, never sampled.
    for block_m in sm80.SPACE["block_m"]:
        fixed, sampled = tune.task_knobs(sm80.SPACE, block_m, 64, num_stages=2)
        assert fixed["num_warps"] * 32 == block_m and fixed["num_stages"] == 2 and not sampled
    fixed, sampled = tune.task_knobs(cpu.SPACE, 32, 64)
    assert fixed == {"block_m": 32, "block_n": 64} and sampled == {"vector": [8, 16]}
    assert len(tune.task_points(cuda, cuda.SPACE)) == 9
    # Only the program's tiles are tasks; sm80's num_stages sets pipeline annotations (a plain int):
    # each value is a design space (structure) inside the task.
    points = tune.task_points(sm80, sm80.SPACE)
    assert len(points) == 2 * 3 and tune.task_name(points[-1]) == "bm128_bn128"
    assert tune.structures(sm80, sm80.SPACE, points[-1]) == [{"num_stages": 1}, {"num_stages": 2}]
    # sm90: the tiles and min_blocks_per_sm (a function attribute) are the program; the rest structures.
    points = tune.task_points(sm90, sm90.SPACE)
    assert len(points) == 3 * 2 * 2 and set(points[0]) == {"block_m", "block_n", "min_blocks_per_sm"}
    options = tune.structures(sm90, sm90.SPACE, {"block_m": 128, "block_n": 64, "min_blocks_per_sm": 1})
    assert all(sm90.valid_knobs({**sm90.KNOBS, "min_blocks_per_sm": 1, **o}) for o in options) and len(options) == 12


def test_sampled_knob_is_replayed_and_mutated():
    """The evidence that the search explores the sampled knob: the trace refers to the decision
    (ExprRV), so replaying it with another decision, or MutateKnob's mutation, changes the schedule."""
    spec = program.AttentionSpec(32, "float32", False, 1, 1)
    func = tune.specialize(program.attention_forward(spec, 16, 32), spec, batch=1, seqlen_q=64, seqlen_k=64,
                           softmax_scale=0.2)
    mod = tvm.IRModule({"main": func})
    fixed, sampled = tune.task_knobs({"block_m": [16], "block_n": [32], "vector": [4, 8, 16]}, 16, 32)
    sch = tvm.s_tir.Schedule(mod)
    tune.space_fn(cpu, fixed, sampled)(sch)
    trace = sch.trace
    (inst,) = [i for i in trace.insts if i.kind.name == "SampleCategorical"]
    seen = {}
    for decision in range(3):
        replayed = tvm.s_tir.Schedule(mod)
        trace.with_decision(inst, decision, remove_postproc=True).apply_to_schedule(replayed, remove_postproc=True)
        seen[decision] = vector_widths(replayed)
        assert tune.decided_knobs(replayed.trace, fixed, sampled)["vector"] == sampled["vector"][decision]
    assert seen == {0: [4], 1: [8], 2: [16]}

    mutated = tune.MutateKnob(seed=1).apply(trace)
    (new_inst,) = [i for i in mutated.insts if i.kind.name == "SampleCategorical"]
    assert int(mutated.get_decision(new_inst)) != int(trace.get_decision(inst))
    again = tvm.s_tir.Schedule(mod)
    mutated.apply_to_schedule(again, remove_postproc=True)
    assert vector_widths(again) != vector_widths(sch)


def test_builds_use_the_schedules_pass_config():
    """The tuner's builder is Kernel's build (PassContext config + workarounds), returning a runtime module."""
    spec = program.AttentionSpec(32, "float32", False, 1, 1)
    func = tune.specialize(program.attention_forward(spec, 16, 32), spec, batch=1, seqlen_q=40, seqlen_k=40,
                           softmax_scale=0.2)
    sch = cpu.schedule(tvm.s_tir.Schedule(tvm.IRModule({"main": func})), block_m=16, block_n=32, vector=8)
    built = tune._ms_build(sch.mod, CPU, None, pass_config={})
    assert isinstance(built, tvm.runtime.Module) and built.implements_function("main")


def test_cuda_spaces_cross_compile():
    """Every sampled vector width of the SIMT space, and the sm80 tasks, build through the tuner's
    builder for their GPU (source only: no GPU here). The GPU runs are tuned on the GPU itself."""
    spec = program.AttentionSpec(128, "bfloat16", True, 2, 1)

    def static(block_m, block_n):
        func = program.attention_forward(spec, block_m, block_n)
        return tvm.IRModule({"main": tune.specialize(func, spec, batch=2, seqlen_q=1000, seqlen_k=1000,
                                                     softmax_scale=0.1)})

    mod = static(64, 32)
    fixed, sampled = tune.task_knobs(cuda.SPACE, 64, 32)
    sch = tvm.s_tir.Schedule(mod)
    tune.space_fn(cuda, fixed, sampled)(sch)
    (inst,) = [i for i in sch.trace.insts if i.kind.name == "SampleCategorical"]
    sources = set()
    for decision in range(len(sampled["vector_bytes"])):
        replayed = tvm.s_tir.Schedule(mod)
        sch.trace.with_decision(inst, decision, remove_postproc=True).apply_to_schedule(replayed, remove_postproc=True)
        built = tune._ms_build(replayed.mod, targets.cuda_target("sm80"), None, pass_config={})
        sources.add(built.imports[0].inspect_source())
    assert len(sources) == len(sampled["vector_bytes"])  # each width is its own kernel

    for block_m, block_n, num_stages in ((64, 32, 1), (128, 64, 2)):
        fixed, sampled = tune.task_knobs(sm80.SPACE, block_m, block_n, num_stages=num_stages)
        sch = tvm.s_tir.Schedule(static(block_m, block_n))
        tune.space_fn(sm80, fixed, sampled)(sch)
        built = tune._ms_build(sch.mod, targets.cuda_target("sm80"), None, pass_config=sm80.PASS_CONFIG)
        assert "mma.sync" in built.imports[0].inspect_source()


def test_sm80_design_space_replays():
    """MetaSchedule's search replays each design-space trace on a fresh schedule: the sm80 space
    with its default knobs must replay to the same IR (a schedule step outside the trace, such as a
    block replaced in the schedule state, breaks this and leaves the search without candidates)."""
    spec = program.AttentionSpec(64, "bfloat16", True, 2, 1)
    mod = tvm.IRModule({"main": tune.specialize(program.attention_forward(spec, 128, 64), spec, batch=1,
                                                seqlen_q=300, seqlen_k=300, softmax_scale=0.1)})
    fixed, sampled = tune.task_knobs(sm80.SPACE, 128, 64, num_stages=sm80.KNOBS["num_stages"])
    sch = tvm.s_tir.Schedule(mod)
    tune.space_fn(sm80, fixed, sampled)(sch)
    replayed = tvm.s_tir.Schedule(mod)
    sch.trace.apply_to_schedule(replayed, remove_postproc=True)
    tvm.ir.assert_structural_equal(replayed.mod, sch.mod)


def test_structures_are_design_spaces_of_one_task(tmp_path):
    """sm90's structure knobs (layouts, copies, stages) are not tasks: one task per program (tiles and
    min_blocks_per_sm) holds a design space per valid structure, so one evolutionary search and one
    cost model see them all. A candidate's trace names its structure; MutateKnob moves it to another
    (scheduled again); the defaults seed their task."""
    import random

    spec = program.AttentionSpec(128, "bfloat16", False, 2, 2)
    lines = []
    space = {**sm90.SPACE, "block_m": [128], "block_n": [64]}
    defaults = choice.default_knobs(sm90, 128)
    tasks = tune.make_tasks(sm90, spec, {"batch": 1, "seqlen": 512, "heads": 2}, space, targets.cuda_target("sm90"),
                            tmp_path, random.Random(0), lines.append, known={"default": defaults})
    assert [t["name"] for t in tasks] == ["bm128_bn64_mb1", "bm128_bn64_mb2"] and not lines
    task = tasks[1]
    fixed, sampled, options = task["fixed"], task["sampled"], task["structures"]
    assert len(options) == 10 and not sampled  # mb2: no producer warpgroup
    ((label, seed),) = task["seeds"]
    assert label == "default" and tune.decided_knobs(seed, fixed, sampled, options) == {**defaults, **fixed}
    spaces = task["context"].generate_design_space()
    assert [tune.decided_knobs(s.trace, fixed, sampled, options) for s in spaces] == [{**fixed, **o} for o in options]
    retracer = tune.Retracer(sm90, task["context"].mod, fixed, sampled, options)
    mutator = tune.MutateKnob(3, options, retracer)
    seen = set()
    for _ in range(4):
        mutated = mutator.apply(seed)
        again = tvm.s_tir.Schedule(task["context"].mod)
        mutated.apply_to_schedule(again, remove_postproc=True)  # replays: the trace is the new structure's
        knobs = tune.decided_knobs(again.trace, fixed, sampled, options)
        changed = {n for n in sm90.STRUCTURE_KNOBS if knobs[n] != defaults[n]}
        # one knob moved, with the fewest others that must go with it (kv_layout "core_matrices"
        # needs kv_copy "cp.async"; num_stages 1 too), to a structure of the task
        assert changed in ({"q_layout"}, {"kv_copy"}, {"kv_layout", "kv_copy"}, {"num_stages", "kv_copy"}), changed
        seen.add(frozenset(changed))
    assert len(seen) > 1


def test_pre_check_postprocessor_rejects_before_building():
    """PreCheck (a MetaSchedule postprocessor) returns False for a candidate whose knobs
    candidate_problem rejects, so the search samples another instead of building it."""
    from tvm.s_tir import meta_schedule as ms

    spec = program.AttentionSpec(32, "float32", False, 1, 1)
    mod = tvm.IRModule({"main": tune.specialize(program.attention_forward(spec, 16, 32), spec, batch=1,
                                                seqlen_q=32, seqlen_k=32, softmax_scale=0.2)})
    fixed, sampled = tune.task_knobs({"block_m": [16], "block_n": [32], "vector": [4, 8]}, 16, 32)
    stats = {}
    check = tune.PreCheck(lambda knobs: "too wide" if knobs["vector"] == 8 else None, fixed, sampled, [{}], stats)
    assert isinstance(check, ms.postproc.Postproc)
    sch = tvm.s_tir.Schedule(mod)
    tune.space_fn(cpu, fixed, sampled)(sch)
    (inst,) = [i for i in sch.trace.insts if i.kind.name == "SampleCategorical"]
    verdicts = []
    for decision in (0, 1):
        replayed = tvm.s_tir.Schedule(mod)
        sch.trace.with_decision(inst, decision, remove_postproc=True).apply_to_schedule(replayed, remove_postproc=True)
        verdicts.append(check.apply(replayed))
    assert verdicts == [True, False] and stats == {"rejected": 1}
    # sm90: what fails to build is a problem before building
    sm90_target = targets.cuda_target("sm90")
    assert "64 registers" in tune.candidate_problem(sm90, sm90_target, 128, "bfloat16",
                                                    {"block_m": 256, "num_warpgroups": 4, "min_blocks_per_sm": 2})
    assert "1024-byte" in tune.candidate_problem(sm90, sm90_target, 128, "bfloat16", {
        "block_m": 64, "num_warpgroups": 1, "kv_copy": "cp.async", "num_stages": 2})
    assert "shared memory" in tune.candidate_problem(sm80, targets.cuda_target("sm80"), 128, "bfloat16", {
        "block_m": 128, "num_warps": 4, "block_n": 128, "num_stages": 2})
    assert tune.candidate_problem(sm90, sm90_target, 128, "bfloat16", {}) is None  # the defaults


@pytest.mark.parametrize("schedule,head_dim,block_m,block_n", [
    (sm90, 128, 64, 64), (sm90, 128, 128, 64), (sm90, 64, 64, 128), (sm80, 128, 128, 64)],
    ids=["sm90-d128-bm64", "sm90-d128-bm128", "sm90-d64-bm64", "sm80-d128-bm128"])
def test_pre_check_accepts_exactly_the_candidates_that_build(schedule, head_dim, block_m, block_n):
    """Every structure of a task of the space, built for its GPU (cross-compiled: no GPU here): the
    pre-check (tune.candidate_problem) accepts exactly the ones that build. (MisalignedTiles was most
    of the failed candidates on the H200: swizzled tiles without TMA off the 1024-byte boundary.)"""
    target = targets.cuda_target(schedule.__name__.rsplit(".", 1)[-1])
    spec = program.AttentionSpec(head_dim, "bfloat16", True, 2, 2)
    point = {"block_m": block_m, "block_n": block_n, **({"min_blocks_per_sm": 2} if schedule is sm90 else {})}
    options = tune.structures(schedule, schedule.SPACE, point)
    fixed, sampled = tune.task_knobs(schedule.SPACE, **point, structure_names=list(options[0]))
    plain = {**schedule.KNOBS, **fixed}
    from tvmflash import schedules as registry
    mod = tvm.IRModule({"main": tune.specialize(registry.program_for(spec, schedule, plain), spec, batch=1,
                                                seqlen_q=512, seqlen_k=512, softmax_scale=0.1)})
    outcomes = []
    for structure in options:
        problem = tune.candidate_problem(schedule, target, head_dim, "bfloat16", {**plain, **structure})
        sch = tvm.s_tir.Schedule(mod)
        try:
            tune.space_fn(schedule, fixed, sampled, [structure])(sch)
            tune._ms_build(sch.mod, target, None, **choice.build_options(schedule))
            error = None
        except Exception as err:  # noqa: BLE001 - any failure to schedule or build
            error = f"{type(err).__name__}: {str(err).splitlines()[-1] if str(err) else ''}"
        outcomes.append((problem is None, error is None))
        assert (problem is None) == (error is None), (structure, problem, error)
    assert any(built for _, built in outcomes)
    if (schedule, block_m) == (sm90, 64):
        assert not all(built for _, built in outcomes)  # the check has failures to predict here


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("schedule,block_m,causal,kv_copy", [
    (sm80, 128, False, None), (sm80, 64, True, None), (sm90, 64, False, "cp.async"), (sm90, 64, True, "tma")],
    ids=["sm80-bm128-full", "sm80-bm64-causal", "sm90-bm64-full", "sm90-bm64-causal-tma"])
def test_pipelined_candidates_build_with_static_shapes(schedule, block_m, causal, kv_copy):
    """The tuner builds static shapes. TVM bugs made every num_stages 2 candidate fail there:
    InjectSoftwarePipeline guards each statement of the K/V step apart, which split a local
    buffer's allocation in an intrinsic (a row reduction's scratch, a wgmma descriptor) from its
    uses; and a cp.async.wait_group count was left as ``if_then_else(True & True, 1, 0)`` (causal,
    block_m 64). The TMA lowering (tvmflash.lowering.tma) must take the static-shape pipeline too; there, at
    block_m 64, shared-memory merging put the K/V tiles off the swizzle's 1024-byte boundary until the
    build learned to grow the barriers (``annotations.TMA_BARRIER_PADDINGS``)."""
    spec = program.AttentionSpec(64, "bfloat16", causal, 2, 2)
    mod = tvm.IRModule({"main": tune.specialize(program.attention_forward(spec, block_m, 64), spec, batch=1,
                                                seqlen_q=512, seqlen_k=512, softmax_scale=0.125)})
    # cp.async copies into the swizzled layout have no barriers to pad, and at block_m 64 merging
    # puts those tiles off the 1024-byte boundary: that build fails loudly (below), so here cp.async
    # copies into core matrices.
    layout = "swizzled" if kv_copy == "tma" else "core_matrices"
    task = {"num_stages": 2, **({"min_blocks_per_sm": 2, "kv_layout": layout, "kv_copy": kv_copy, "producer": "thread",
                                 "q_layout": "core_matrices", "q_copy": "threads", "o_store": "staged", "overlap": 0}
                                if schedule is sm90 else {})}  # the task knobs

    def build(task):
        fixed, sampled = tune.task_knobs(schedule.SPACE, block_m, 64, **task)
        sch = tvm.s_tir.Schedule(mod)
        tune.space_fn(schedule, fixed, sampled)(sch)
        target = targets.cuda_target("sm90" if schedule is sm90 else "sm80")
        return tune._ms_build(sch.mod, target, None, **options)

    options = choice.build_options(schedule)
    if kv_copy == "cp.async":
        from tvmflash.lowering import tma
        with pytest.raises(tma.MisalignedTiles, match="swizzled wgmma operand"):
            build({**task, "kv_layout": "swizzled"})
    built = build(task)
    source = built.imports[0].inspect_source()
    if kv_copy == "tma":
        assert "cp.async.bulk.tensor.5d" in source and "cp.async.wait_group" not in source
        return
    wait = "cp.async.wait_group 0;" + ("\\n\\tfence.proxy.async" if options["async_proxy_operands"] else "")
    assert wait in source


def test_rejected_tile_pairs_are_skipped(tmp_path):
    """sm80 needs block_n % 16 == 0: that pair is skipped with a message; the others become tasks."""
    import random

    spec = program.AttentionSpec(64, "float16", False, 2, 2)
    lines = []
    space = {**sm80.SPACE, "block_m": [64], "block_n": [40, 64], "num_stages": [1]}
    tasks = tune.make_tasks(sm80, spec, {"batch": 1, "seqlen": 256, "heads": 2}, space, targets.cuda_target("sm80"),
                            tmp_path, random.Random(0), lines.append)
    assert [t["name"] for t in tasks] == ["bm64_bn64"] and tasks[0]["fixed"]["num_warps"] == 2
    assert len(lines) == 1 and lines[0].startswith("  skipping bm64_bn40: the sm80 schedule rejects it")
    with pytest.raises(ValueError, match="rejects every"):
        tune.make_tasks(sm80, spec, {"batch": 1, "seqlen": 256, "heads": 2}, {**space, "block_n": [40]},
                        targets.cuda_target("sm80"), tmp_path, random.Random(0), lines.append)


def test_tasks_over_the_shared_memory_limit_are_skipped(tmp_path):
    """A task whose tiles need more shared memory than the target allows is skipped with a message
    before anything is built (sm80's 163 KiB: 128x128 tiles at d128 fit with one K/V stage, not two)."""
    import random

    spec = program.AttentionSpec(128, "bfloat16", False, 2, 2)
    lines = []
    space = {**sm80.SPACE, "block_m": [128], "block_n": [128], "num_stages": [1, 2]}
    tasks = tune.make_tasks(sm80, spec, {"batch": 1, "seqlen": 256, "heads": 2}, space, targets.cuda_target("sm80"),
                            tmp_path, random.Random(0), lines.append)
    assert [t["name"] for t in tasks] == ["bm128_bn128"] and tasks[0]["structures"] == [{"num_stages": 1}]
    assert lines == ["  bm128_bn128: leaving out ns2: it needs 174 KiB of shared memory, cuda sm_80 allows 163 KiB"], lines


def test_failed_candidates_are_never_picked():
    """Failed builds and runs (MetaSchedule gives them 1e10 s) are counted, reported, never best."""
    from tvm.s_tir import meta_schedule as ms

    spec = program.AttentionSpec(32, "float32", False, 1, 1)
    mod = tvm.IRModule({"main": tune.specialize(program.attention_forward(spec, 16, 32), spec, batch=1,
                                                seqlen_q=32, seqlen_k=32, softmax_scale=0.2)})
    fixed, sampled = tune.task_knobs({"block_m": [16], "block_n": [32], "vector": [4, 8]}, 16, 32)
    candidates = []
    for decision in (0, 1, 0, 1):
        sch = tvm.s_tir.Schedule(mod)
        tune.space_fn(cpu, fixed, sampled)(sch)
        (inst,) = [i for i in sch.trace.insts if i.kind.name == "SampleCategorical"]
        replayed = tvm.s_tir.Schedule(mod)
        sch.trace.with_decision(inst, decision, remove_postproc=True).apply_to_schedule(replayed, remove_postproc=False)
        candidates.append(ms.MeasureCandidate(replayed, []))
    built = [ms.builder.BuilderResult("a.tar", None), ms.builder.BuilderResult(None, "error: too much shared memory"),
             ms.builder.BuilderResult("c.tar", None), ms.builder.BuilderResult("d.tar", None)]
    ran = [ms.runner.RunnerResult([2e-3], None), ms.runner.RunnerResult(None, None),
           ms.runner.RunnerResult(None, "CUDA launch failed"), ms.runner.RunnerResult([1e10], None)]
    lines = []
    progress = tune.Progress([{"name": "bm16_bn32", "fixed": fixed, "sampled": sampled}], 4, lines.append)
    progress.apply(ms.task_scheduler.TaskScheduler.create("round-robin"), 0, candidates, built, ran)
    assert progress.done == 4 and progress.failed == 3
    assert progress.best_knobs == {"block_m": 16, "block_n": 32, "vector": 4} and progress.best_ms == pytest.approx(2.0)
    assert any("too much shared memory" in line for line in lines) and "3 failed" in lines[-1]


def test_a_task_is_exhausted_once_its_configurations_are_measured():
    """A task whose every configuration is measured, or whose search round found nothing new, gets
    no more search rounds (on the H200 each such round cost 6 s and found nothing)."""
    from tvm.s_tir import meta_schedule as ms

    progress = tune.Progress([{"name": "a", "fixed": {}, "structures": [{}], "sampled": {}}, {"name": "b"}], 4,
                             lambda line: None)
    scheduler = ms.task_scheduler.TaskScheduler.create("round-robin")
    assert tune.configurations({"structures": [{}, {}], "sampled": {"vec": [4, 8], "unroll": [0, 1, 2]}}) == 12
    progress.apply(scheduler, 1, [], [], [])
    assert progress.exhausted == {1}
    a = tvm.te.placeholder((4,), name="a")
    sch = tvm.s_tir.Schedule(tvm.te.create_prim_func([a, tvm.te.compute((4,), lambda i: a[i] + 1.0)]))
    progress.apply(scheduler, 0, [ms.MeasureCandidate(sch, [])], [ms.builder.BuilderResult("a.tar", None)],
                   [ms.runner.RunnerResult([1e-3], None)])
    assert progress.exhausted == {0, 1} and progress.best_ms == pytest.approx(1.0)


def test_trials_go_to_the_tasks_that_can_win():
    """PromisingTasksFirst: tasks are alternatives, so after the exploring share of the batches (one
    each, in order of promise) the trials go to the tasks within 10% of the best, never round-robin
    to one that measured slower or was not tried."""
    progress = tune.Progress([{"name": str(i)} for i in range(4)], 24, lambda line: None)
    scheduler = tune.PromisingTasksFirst(progress, batches=6)  # 3 batches to explore
    scheduler.given = [0, 0, 0, 0]
    picks = []
    for best in ({}, {0: 1.0}, {0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0, 2: 1.05}, None, None, None):
        progress.task_best.update(best or {})
        task_id = scheduler.choose([0, 1, 2, 3])
        scheduler.given[task_id] += 1
        picks.append(task_id)
    assert picks == [0, 1, 2, 0, 2, 0, 2]
    assert scheduler.choose([1, 3]) == 3  # the near-best tasks are done: the untried one next


def test_progress_bar_on_a_terminal():
    """On a terminal the status is one bar redrawn in place (carriage return, erase line), and other
    lines go above it; the last bar stays on its line when the run ends."""
    import io

    stream, lines = io.StringIO(), []
    reporter = tune.Reporter(4, lines.append, stream)
    reporter.trial(2.0, "2.0000 ms")
    reporter.note("  built 2/4 candidates")
    reporter.trial(None, "failed to build: too much shared memory")
    reporter.close()
    text = stream.getvalue()
    assert lines == [] and text.endswith("\n") and text.count("\n") == 2, text
    draws = text.split("\r\x1b[K")[1:]
    assert draws[0].startswith("[######" + "." * 18 + "] 1/4 trials, 0 failed, best 2.0000 ms, 0 s, ~0 s left"), draws
    assert draws[1] == "  built 2/4 candidates\n" and draws[2].startswith("[######")
    assert draws[3].startswith("[############" + "." * 12 + "] 2/4 trials, 1 failed, best 2.0000 ms"), draws


# ----------------------------------------------------------------------------- a real tuning run
def test_short_tuning_run_is_used_by_compile(cache_dir, monkeypatch):
    mutations = []
    apply = tune.MutateKnob._cls.apply  # the class behind @derived_object

    def counting(self, trace, rand_state):
        mutated = apply(self, trace, rand_state)
        mutations.append(mutated is not None)
        return mutated

    monkeypatch.setattr(tune.MutateKnob._cls, "apply", counting)
    lines = []
    record = tune.tune(head_dim=32, dtype="float32", causal=False, target="cpu", trials=6, batch=1, seqlen=96,
                       heads=2, space={"block_m": [16, 32], "block_n": [32], "vector": [4, 8, 16]}, seed=0,
                       repeat=5, echo=lines.append)
    text = "\n".join(lines)
    assert re.search(r"\[\d+/6 trials, \d+ failed", text) and "best so far" in text, text
    assert re.search(r"built \d+/6 candidates", text), text  # progress while MetaSchedule builds
    assert "default" in text and "tuned" in text and record["default_ms"] > 0 and record["tuned_ms"] > 0
    assert record["shape"] == {"batch": 1, "seqlen_q": 96, "seqlen_k": 96, "heads_q": 2, "heads_kv": 2}
    assert 1 <= record["trials"] <= 6 and record["wall_s"] > 0 and record["workload"] == WORKLOAD
    assert record["tuned_knobs"]["block_m"] in (16, 32) and record["tuned_knobs"]["vector"] in (4, 8, 16)

    # MetaSchedule measured more than one value of the sampled knob.
    decisions = set()
    with open(f"{record['work_dir']}/database_tuning_record.json") as f:
        for line in f:
            trace = json.loads(line)[1][0]
            decisions |= {tuple(d[1]) if isinstance(d[1], list) else d[1] for d in trace[1]}
    assert len(decisions) >= 2, decisions
    assert any(mutations), "the evolutionary search never mutated a sampled knob"

    # A new compile() (symbolic shapes) picks the record up, and runs at another shape.
    kern = tvmflash.compile(head_dim=32, dtype="float32", causal=False, target="cpu")
    # (the defaults may win at this shape: the record then keeps them, and they are not called tuned)
    won = "defaults" if record["knobs"] == choice.default_knobs(cpu, 32) else "tuned"
    assert kern.info()["knobs_source"].startswith(won), kern.info()
    assert kern.knobs == record["knobs"]
    import torch

    q, k, v = torch.randn(2, 37, 2, 32), torch.randn(2, 53, 2, 32), torch.randn(2, 53, 2, 32)
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert torch.allclose(kern(q, k, v), ref, atol=1e-4)


# ----------------------------------------------------------------------------- the database
def test_database_round_trip(cache_dir):
    rec = database.new_record(CPU, "cpu", WORKLOAD, {"block_m": 16, "block_n": 32, "vector": 8}, 2.0, trials=4)
    path = database.add(rec)
    assert database.read(path) == [rec]
    found = database.lookup(CPU, "cpu", WORKLOAD)
    assert found["knobs"] == rec["knobs"] and found["source"] == str(path) and found["trials"] == 4
    slower = {**rec, "knobs": {"block_m": 64}, "mean_ms": 3.0}
    database.add(slower)  # a slower record for the same key does not replace the faster one
    faster = {**rec, "knobs": {"block_m": 32}, "mean_ms": 1.0}
    database.add(faster)
    assert database.read(path) == [faster]
    assert database.lookup(CPU, "cpu", {**WORKLOAD, "causal": True}) is None


def test_records_of_other_sequence_lengths_never_compete(cache_dir, tmp_path):
    """A record tuned at 512 keys is always faster than one tuned at 4096: each seqlen bucket keeps
    its own best (in the database and in an export), and a lookup takes the record of the length's
    bucket, else the longest bucket's."""
    knobs = {name: dict(cpu.KNOBS, block_m=value) for name, value in (("long", 64), ("short", 16))}
    long_ = database.new_record(CPU, "cpu", WORKLOAD, knobs["long"], 2.0, shape={"seqlen_k": 4096})
    short = database.new_record(CPU, "cpu", WORKLOAD, knobs["short"], 0.2, shape={"seqlen_k": 512})
    path = database.add(long_)
    database.add(short)
    assert database.read(path) == [long_, short]
    assert database.record_id(long_) != database.record_id(short)
    assert database.lookup(CPU, "cpu", WORKLOAD)["knobs"] == knobs["long"]
    assert database.lookup(CPU, "cpu", WORKLOAD, seqlen_k=300)["knobs"] == knobs["short"]
    assert database.lookup(CPU, "cpu", WORKLOAD, seqlen_k=2048)["knobs"] == knobs["long"]
    database.add({**long_, "knobs": knobs["short"], "mean_ms": 1.5, "shape": {"seqlen_k": 8192}})  # same bucket, faster
    assert database.lookup(CPU, "cpu", WORKLOAD)["mean_ms"] == 1.5 and len(database.read(path)) == 2
    assert len(database.read(database.export_best(tmp_path / "export")[0])) == 2


def test_a_call_runs_the_knobs_tuned_for_its_key_lengths(cache_dir):
    """With records of two seqlen buckets, a kernel runs the longest bucket's knobs, and a call whose
    keys fall in the other bucket that bucket's, in a module of its own; no length builds twice."""
    knobs = {"long": dict(cpu.KNOBS, block_m=32, block_n=32), "short": dict(cpu.KNOBS, block_m=16, block_n=32)}
    database.add(database.new_record(CPU, "cpu", WORKLOAD, knobs["long"], 2.0, shape={"seqlen_k": 4096}))
    database.add(database.new_record(CPU, "cpu", WORKLOAD, knobs["short"], 0.2, shape={"seqlen_k": 512}))
    kern = tvmflash.compile(head_dim=32, dtype="float32", causal=False, target="cpu")
    info = kern.info()
    assert info["knobs"] == knobs["long"], info
    assert info["seqlen_buckets"]["seqlen_k <= 1024"]["knobs"] == knobs["short"], info
    short = kern.by_bucket[0]
    for seqlen_k, runs in ((53, short), (1100, kern), (700, short)):
        q, k, v = torch.randn(1, 37, 2, 32), torch.randn(1, seqlen_k, 2, 32), torch.randn(1, seqlen_k, 2, 32)
        ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        assert torch.allclose(kern(q, k, v), ref, atol=1e-4)
        assert list(runs.build.modules) == [(2, 2)]
    assert kern.build.modules[(2, 2)] is not short.build.modules[(2, 2)]


def test_records_never_cross_devices_or_targets(cache_dir):
    mine = database.device_key(CPU)
    # Another CPU's target, whatever this host is (on a znver4 host "llvm znver4" is the host's own).
    another_target = next(t for t in ("llvm znver4", "llvm sapphirerapids") if t != mine["target"])
    other = [
        {"target": another_target},  # same device file, other target
        {"device": mine["device"].replace("cores", "cores-other")},  # other CPU
        {"tvm": "0.26.0"},  # other TVM
        {"tvmflash": "0.0.1"},
        {"compute_capability": "9.0"},
    ]
    base = database.new_record(CPU, "cpu", WORKLOAD, {**cpu.KNOBS, "block_m": 16}, 1.0)
    path = database.user_dir() / f"{database.slug(mine['device'])}.json"
    database.write(path, [{**base, **o} for o in other])
    assert database.lookup(CPU, "cpu", WORKLOAD) is None
    assert database.lookup(CPU, "cuda", WORKLOAD) is None
    # A record made for a GPU is never used for another GPU or for the CPU.
    h200 = {**base, "device": "NVIDIA H200", "compute_capability": "9.0", "target": "cuda sm_90a"}
    database.write(database.user_dir() / "nvidia-h200.json", [h200])
    sm90 = targets.cuda_target("sm90")
    assert database.lookup(sm90, "cpu", WORKLOAD) is None  # no GPU here: device "unknown-gpu"
    assert database.lookup(targets.cuda_target("sm80"), "cpu", WORKLOAD) is None
    # ...while the matching record is found.
    database.add(base)
    assert database.lookup(CPU, "cpu", WORKLOAD)["knobs"] == {**cpu.KNOBS, "block_m": 16}
    # A record without one of the schedule's knobs is from before the schedule had it: passed over
    # (this faster one also replaces the record above in the file, which keeps the best per key).
    database.add(database.new_record(CPU, "cpu", WORKLOAD, {"block_m": 32}, 0.5))
    assert database.lookup(CPU, "cpu", WORKLOAD) is None


def test_corrupt_database_is_skipped_with_a_warning(cache_dir):
    rec = database.new_record(CPU, "cpu", WORKLOAD, {"block_m": 16}, 1.0)
    path = database.add(rec)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # truncated
    with pytest.warns(UserWarning, match="skipping unreadable tuning database"):
        assert database.lookup(CPU, "cpu", WORKLOAD) is None
    with pytest.warns(UserWarning):
        kern = tvmflash.compile(head_dim=32, dtype="float32", target="cpu")
    assert kern.knobs_source == "defaults"
    path.write_text('{"format": 1, "records": "nope"}')
    with pytest.warns(UserWarning):
        assert database.read(path) == []


def test_records_with_wrong_fields_are_skipped_with_a_warning(cache_dir):
    """Valid JSON with wrong fields was listed, silently, as 'None None dNone ... nan ms'."""
    good = database.new_record(CPU, "cpu", WORKLOAD, {"block_m": 16}, 1.0)
    bad = [{"hello": 1}, {**good, "knobs": "fast"}, {**good, "mean_ms": "1 ms"}, {**good, "workload": {"head_dim": 32}}, 7]
    path = database.user_dir() / "records.json"
    database.write(path, [good, *bad])
    with pytest.warns(UserWarning, match=r"skipping record \d of tuning database") as caught:
        assert database.read(path) == [good]
    assert len(caught) == len(bad)
    for shipped in database.SHIPPED_DIR.glob("*.json"):  # the shipped records are all well formed
        data = json.loads(shipped.read_text())
        assert all(database.record_problem(r) is None for r in data["records"])
    done = cli("cache", "ls", env_dir=cache_dir)
    assert done.returncode == 0 and "None" not in done.stdout and "nan ms" not in done.stdout, done.stdout
    assert done.stderr.count("skipping record") == len(bad), done.stderr


def test_stored_defaults_are_not_called_tuned(cache_dir):
    """Where no candidate beat the defaults, tuning stores them: bench and info() called them tuned."""
    from tvmflash import bench

    database.add(database.new_record(CPU, "cpu", WORKLOAD, choice.default_knobs(cpu, 32), 1.0))
    info = tvmflash.compile(head_dim=32, dtype="float32", target="cpu").info()
    assert info["knobs_source"].startswith("defaults (tuning found none faster: "), info
    lines = []
    bench.run(device="cpu", dtype="float32", head_dims=(32,), causal=(False,), seqlens=[32], tokens=32, hidden=64,
              repeat=1, echo=lines.append)
    assert lines[-1].startswith("kernel d32 full: cpu schedule, default knobs {"), lines


def test_concurrent_writers_keep_both_records(cache_dir):
    script = textwrap.dedent("""
        import sys
        from tvmflash import database, target
        cpu, writer = target.cpu_target(), sys.argv[1]
        for i in range(15):
            wl = {"head_dim": 32, "dtype": "float32", "causal": False, "writer": writer, "i": i}
            database.add(database.new_record(cpu, "cpu", wl, {"block_m": 16}, 1.0))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, name]) for name in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    (path,) = database.user_dir().glob("*.json")
    records = json.loads(path.read_text())["records"]  # valid JSON
    assert sorted((r["workload"]["writer"], r["workload"]["i"]) for r in records) == \
        sorted((w, i) for w in "ab" for i in range(15))


# ----------------------------------------------------------------------------- the CLI
def cli(*args, env_dir):
    import os

    env = dict(os.environ, TVMFLASH_CACHE_DIR=str(env_dir))
    return subprocess.run([sys.executable, "-m", "tvmflash.cli", *args], capture_output=True, text=True, env=env)


def test_cache_commands(cache_dir, tmp_path):
    rec = database.new_record(CPU, "cpu", WORKLOAD, {"block_m": 16, "block_n": 32, "vector": 8}, 1.5)
    database.add(rec)
    slow = {**rec, "knobs": {"block_m": 64}, "mean_ms": 9.0, "workload": {**WORKLOAD, "causal": True}}
    database.add(slow)
    rid = database.record_id(rec)

    done = cli("cache", "ls", env_dir=cache_dir)
    assert done.returncode == 0, done.stderr
    shipped = sum(len(database.read(f)) for f in database.SHIPPED_DIR.glob("*.json"))  # e.g. the H200's
    assert f"tuning records: {2 + shipped}" in done.stdout and rid in done.stdout and "cached modules: 0" in done.stdout

    done = cli("cache", "show", rid[:8], env_dir=cache_dir)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["knobs"] == rec["knobs"]

    out = tmp_path / "exported"
    existing = {**rec, "device": rec["device"], "tvm": "0.26.0"}  # another key, already shipped: kept
    database.write(out / f"{database.slug(rec['device'])}.json", [existing])
    done = cli("cache", "export", "--out", str(out), env_dir=cache_dir)
    assert done.returncode == 0, done.stderr
    (written,) = out.glob("*.json")
    assert len(database.read(written)) == 3

    done = cli("cache", "clear", env_dir=cache_dir)
    assert done.returncode == 0 and "deleting 0 cached modules" in done.stdout and "2 tuning records" in done.stdout
    assert not database.user_dir().exists()


def test_tuned_knobs_with_wrong_results_are_never_stored(cache_dir, monkeypatch):
    """The tuned knobs must also give correct output (flash-attn's rule) at the tuning shape: a
    faster but wrong kernel is reported and the default is kept."""
    from tvmflash import bench

    checked = []

    def wrong_when_tuned(out, q, k, v, causal):
        checked.append(len(checked))
        return (1.0, 1e-3) if len(checked) > 1 else (0.0, 1e-3)  # the default first, then the tuned ones

    monkeypatch.setattr(bench, "error_vs_float32", wrong_when_tuned)
    lines = []
    record = tune.tune(head_dim=32, dtype="float32", causal=False, target="cpu", trials=2, batch=1, seqlen=64,
                       heads=1, space={"block_m": [16], "block_n": [32], "vector": [4, 8]}, seed=0, repeat=3,
                       echo=lines.append)
    assert len(checked) == 3 and any("the tuned knobs #" in line and "give wrong results" in line for line in lines), lines
    assert record["knobs"] == choice.default_knobs(cpu, 32)


def test_the_fastest_few_are_timed_again_as_compile_builds_them(cache_dir, monkeypatch):
    """MetaSchedule times static shapes; tvmflash.compile builds symbolic ones, which can rank
    configurations differently (sm90 on the H200). The fastest few are timed again through
    tvmflash.compile, and the fastest there is kept, not MetaSchedule's first."""
    from tvmflash import bench

    timings = iter([5.0, 4.0, 3.0])  # default, MetaSchedule's #1, #2
    monkeypatch.setattr(bench, "time_ms", lambda fn, device, repeat: next(timings))
    lines = []
    record = tune.tune(head_dim=32, dtype="float32", causal=False, target="cpu", trials=2, batch=1, seqlen=64,
                       heads=1, space={"block_m": [16], "block_n": [32], "vector": [4, 8]}, seed=0, repeat=3,
                       echo=lines.append)
    rechecked = [line.split() for line in lines if line.startswith("  #")]
    assert [line[0] for line in rechecked] == ["#1", "#2"], lines
    assert record["tuned_ms"] == 3.0 and record["default_ms"] == 5.0 and record["mean_ms"] == 3.0
    assert record["knobs"] == record["tuned_knobs"] and record["knobs"]["vector"] == int(rechecked[1][-1].rstrip("}"))


# A user record for the full workload, slower than anything measured (so the run replaces it), with
# knobs of its own: a warm run must seed the search with it and time it again.
USER_KNOBS = {"block_m": 16, "block_n": 32, "vector": 8}


@pytest.fixture(scope="module")
def cli_tuning_run(tmp_path_factory):
    """One ``tvmflash tune`` command over two workloads, warm, its output captured (not a terminal),
    with USER_KNOBS in the user's database: several tests read it. In this process (its ``main``):
    a new one would import TVM's intrinsic library again for MetaSchedule, a minute of CI."""
    import contextlib
    import io

    from tvmflash import cli as tvmflash_cli

    env_dir = tmp_path_factory.mktemp("cli-tuning")
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.setenv("TVMFLASH_CACHE_DIR", str(env_dir))
        # (at the run's shape: records of another seqlen bucket would be kept apart from its own)
        database.add(database.new_record(CPU, "cpu", WORKLOAD, USER_KNOBS, 1e3, shape={"seqlen_k": 64}))
        code = tvmflash_cli.main(["tune", "--head-dim", "32", "--dtype", "float32", "--causal", "both", "--trials", "2",
                                  "--target", "cpu", "--seqlen", "64", "--batch", "1", "--heads", "1"])
        assert code == 0, err.getvalue()
        full = database.lookup(CPU, "cpu", WORKLOAD)
    kernels.forget_kernels()  # kernels made while the run's cache dir was set read its records
    return out.getvalue(), full


def test_tune_several_workloads_in_one_command(cli_tuning_run):
    """One command tunes each (head_dim, dtype, causal) in turn and ends with a summary table: a row
    each, with trials, the failed share, the search's best, the kept and the defaults' times, the
    speedup and the wall time."""
    stdout, _ = cli_tuning_run
    assert "== workload 1/2: d32 float32 full" in stdout and "== workload 2/2: d32 float32 causal" in stdout
    header, *rows = stdout.split("== summary")[1].strip().splitlines()[1:]
    assert header.split()[:8] == ["workload", "start", "trials", "failed", "search", "ms", "kept", "ms"], header
    assert [row.split()[:4] for row in rows] == [["d32", "float32", "full", "warm"], ["d32", "float32", "causal", "warm"]]
    for row in rows:
        trials, failed, _search_ms, kept_ms, default_ms, speedup, wall_s = row.split()[4:11]
        assert 1 <= int(trials) <= 2 and failed.endswith("%") and float(wall_s) > 0, row
        assert float(kept_ms) <= float(default_ms) and speedup.endswith("x") and float(speedup[:-1]) >= 1.0, row


def test_progress_is_reported_a_line_a_trial_when_not_a_terminal(cli_tuning_run):
    """Not a terminal (a pipe here): no progress bar, a plain line for each build batch and each
    trial as it ends, with the trials done of the total, failures, best so far, elapsed and
    remaining time."""
    stdout, _ = cli_tuning_run
    assert "\r" not in stdout and "\x1b[" not in stdout
    trials = re.findall(r"^  trial (\d+): .*\((\d+)/2 trials, (\d+) failed, best ([\d.]+ ms|none yet), \d+ s"
                        r"(, ~\d+ s left)?\)$", stdout, flags=re.MULTILINE)
    assert [(n, done) for n, done, *_ in trials] == [("1", "1"), ("2", "2")] * 2, stdout
    assert all(left for *_, left in trials), stdout  # the remaining time, once a trial has ended
    assert re.search(r"^  built \d+/2 candidates", stdout, flags=re.MULTILINE), stdout


def is_seed(line: str) -> bool:
    """Whether a line of MetaSchedule's JSON database is one of the tuner's seeds (by its run time)."""
    return json.loads(line)[1][1] == pytest.approx([tune._SEED_SECS])


def test_a_warm_run_starts_from_the_known_and_never_ends_below_them(cli_tuning_run):
    """Warm (the default), the user's record seeds MetaSchedule's database and is timed again with
    the defaults and the search's best, in the same run: the stored record is the fastest of them."""
    stdout, full = cli_tuning_run
    assert "warm start: seeded the search with the default, user knobs" in stdout, stdout
    # (with MetaSchedule's time too where the search measured them)
    assert re.search(r"^  user +(MetaSchedule [\d.]+ ms, )?tvmflash.compile [\d.]+ ms: " + re.escape(str(USER_KNOBS)),
                     stdout, flags=re.MULTILINE), stdout
    assert full["start"] == "warm" and set(full["known_ms"]) == {"default", "user"}
    assert full["mean_ms"] <= full["default_ms"] == full["known_ms"]["default"]
    assert full["mean_ms"] == min(full["tuned_ms"], *full["known_ms"].values())
    with open(f"{full['work_dir']}/database_tuning_record.json") as f:
        seeds = [line for line in f if is_seed(line)]
    assert len(seeds) == 2, seeds  # the defaults and the user's knobs, each in its task
    # The task that holds the user's record is handed the first trials (PromisingTasksFirst: the user's
    # record, then the shipped one, then the defaults), here both of them.
    full_run = stdout.split("== workload 2/2")[0]
    assert re.findall(r"^\[\d+/2 trials, .*\] task (\w+):", full_run, flags=re.MULTILINE)[0] == "bm16_bn32"


def test_a_cold_run_reads_no_record(cache_dir, monkeypatch):
    """--cold: nothing known seeds the search and no record is read (a user record is there, and
    would be timed warm); the defaults are still timed, as the reference."""
    database.add(database.new_record(CPU, "cpu", WORKLOAD, USER_KNOBS, 1e3))
    read = []
    monkeypatch.setattr(database, "known_records", lambda *args: read.append(args) or [])
    lines = []
    # One configuration, the defaults: what is timed again is the defaults alone.
    record = tune.tune(head_dim=32, dtype="float32", causal=False, target="cpu", trials=1, batch=1, seqlen=64,
                       heads=1, space={"block_m": [64], "block_n": [64], "vector": [16]}, seed=0, repeat=3,
                       cold=True, echo=lines.append)
    assert read == [] and "  cold start: no defaults or records seed the search" in lines, lines
    assert not any(line.startswith("  user ") or "seeded" in line for line in lines), lines
    assert record["start"] == "cold" and list(record["known_ms"]) == ["default"]
    with open(f"{record['work_dir']}/database_tuning_record.json") as f:
        assert [is_seed(line) for line in f] == [False], "a seed in a cold run"


def test_bad_cli_input_is_one_line(cache_dir):
    for args in (("tune", "--head-dim", "80"), ("tune", "--head-dim", "64", "--trials", "0", "--target", "cpu"),
                 ("tune", "--head-dim", "64", "80", "--target", "cpu"),  # refused before 64 is tuned
                 ("cache", "show", "no-such-key")):
        done = cli(*args, env_dir=cache_dir)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_sm90_tasks_that_leave_too_few_registers_are_skipped(tmp_path, monkeypatch):
    """block_m 256 is four warpgroups (512 threads): two such blocks an SM would leave 64 registers
    a thread. The schedule rejects that with a clear error, and the tuner skips the task."""
    import random

    monkeypatch.setenv("TVMFLASH_SM90", "1")
    with pytest.raises(ValueError, match="leave 64 registers a thread"):
        tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90",
                         knobs={"block_m": 256, "num_warpgroups": 4, "min_blocks_per_sm": 2}).module(2, 2)
    spec = program.AttentionSpec(128, "bfloat16", False, 2, 2)
    lines = []
    space = {**sm90.SPACE, "block_m": [256], "block_n": [64], "num_stages": [2], "kv_layout": ["swizzled"],
             "q_layout": ["core_matrices"]}
    tasks = tune.make_tasks(sm90, spec, {"batch": 1, "seqlen": 512, "heads": 2}, space, targets.cuda_target("sm90"),
                            tmp_path, random.Random(0), lines.append)
    # (a producer warpgroup needs block_m 128: those structures are never made)
    assert [t["name"] for t in tasks] == ["bm256_bn64_mb1"]
    assert [s["kv_copy"] for s in tasks[0]["structures"]] == ["tma", "cp.async"]
    assert len(lines) == 1 and lines[0].startswith("  skipping bm256_bn64_mb2: ns2_swizzled") and "64 registers" in lines[0]


def test_sm90_register_floor_follows_the_widest_wgmma():
    """One wgmma of m64nN holds N/2 fp32 accumulators a thread: at d256 ptxas wanted 158 registers
    for P V and aborted the build at 128 (2 blocks of 256 threads, or one of 512). The pre-check
    rejects those before building; d128 at 128 registers still builds."""
    base = {**sm90.KNOBS, **sm90.KNOBS_FOR_HEAD_DIM[256]}
    for knobs in ({"min_blocks_per_sm": 2}, {"block_m": 256, "num_warpgroups": 4}):
        problem = sm90.knobs_problem(256, "bfloat16", {**base, **knobs})
        assert problem is not None and "leave 128 registers" in problem and "need 158" in problem, problem
    assert sm90.knobs_problem(256, "bfloat16", base) is None
    assert sm90.knobs_problem(128, "bfloat16", {**sm90.KNOBS, "min_blocks_per_sm": 2}) is None
    with pytest.raises(ValueError, match="need 158"):
        tvmflash.compile(head_dim=256, dtype="bfloat16", target="sm90", knobs={"min_blocks_per_sm": 2}).module(2, 2)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("head_dim,builds", [(256, False), (128, True)], ids=["d256-aborts", "d128-builds"])
def test_sm90_register_floor_agrees_with_ptxas(head_dim, builds, monkeypatch):
    """Two blocks of 256 threads an SM (128 registers a thread), compiled by nvcc for sm_90a: ptxas
    aborts at d256 (P V's m64n256 wgmma) and builds d128, as ``sm90.register_problem`` says."""
    from tvm.support import nvcc

    knobs = {**sm90.KNOBS, **sm90.KNOBS_FOR_HEAD_DIM.get(head_dim, {}), "min_blocks_per_sm": 2}
    assert (sm90.register_problem(head_dim, knobs["block_n"], 256, 2) is None) == builds
    monkeypatch.setattr(sm90, "register_problem", lambda *_: None)  # schedule it anyway, for ptxas to judge
    spec = program.AttentionSpec(head_dim, "bfloat16", False, 2, 2)
    from tvmflash import schedules as registry
    func = tune.specialize(registry.program_for(spec, sm90, knobs), spec, batch=1, seqlen_q=512, seqlen_k=512,
                           softmax_scale=0.1)
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    sm90.schedule(sch, **knobs)
    target = targets.cuda_target("sm90")
    source = tune._ms_build(sch.mod, target, None, **choice.build_options(sm90)).imports[0].inspect_source()
    if builds:
        with target:
            nvcc.compile_cuda(source, target_format="cubin", arch="sm_90a", compiler="nvcc")
        return
    with target, pytest.raises(Exception, match=r"Insufficient registers \(128\)"):
        nvcc.compile_cuda(source, target_format="cubin", arch="sm_90a", compiler="nvcc")


def test_sm90a_serves_head_dim_32_with_sm80(cache_dir, monkeypatch):
    """At head_dim 32 the sm80 schedule measured faster on the H200, so sm_90a uses it unless
    TVMFLASH_SM90=1, knobs or this device's records of both schedules say otherwise; other
    head_dims stay on sm90."""
    monkeypatch.delenv("TVMFLASH_SM90", raising=False)
    kernels.forget_kernels()
    info = tvmflash.compile(head_dim=32, dtype="bfloat16", target="sm90").info()
    assert info["schedule"] == "sm80" and "head_dim 32" in info["schedule_source"]
    assert tvmflash.compile(head_dim=64, dtype="bfloat16", target="sm90").info()["schedule"] == "sm90"
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    assert tvmflash.compile(head_dim=32, dtype="bfloat16", target="sm90").info()["schedule"] == "sm90"
    # records of both schedules at the same shape decide, as at every head_dim
    monkeypatch.delenv("TVMFLASH_SM90")
    target, workload = targets.cuda_target("sm90"), {"head_dim": 32, "dtype": "bfloat16", "causal": False}
    shape = {"batch": 4, "seqlen_q": 4096, "seqlen_k": 4096, "heads_q": 64, "heads_kv": 64}
    database.add(database.new_record(target, "sm80", workload, dict(sm80.KNOBS), 1.8, shape=shape))
    knobs90 = {**sm90.KNOBS, "kv_layout": "core_matrices", "num_stages": 1, "kv_copy": "cp.async"}
    database.add(database.new_record(target, "sm90", workload, knobs90, 1.7, shape=shape))
    kernels.forget_kernels()
    assert tvmflash.compile(head_dim=32, dtype="bfloat16", target="sm90").info()["schedule"] == "sm90"


def test_sm90_serves_a_workload_unless_records_favour_sm80(cache_dir, monkeypatch):
    """With TVMFLASH_SM90 unset, an sm_90a kernel uses the sm90 schedule unless this device's tuned
    records for the workload, at the same shape, say the sm80 schedule is faster; 0 keeps sm80, and
    given knobs keep the target's schedule unless some are sm90's alone."""
    monkeypatch.delenv("TVMFLASH_SM90", raising=False)
    target = targets.cuda_target("sm90")
    workload = {"head_dim": 128, "dtype": "bfloat16", "causal": False}
    shape = {"batch": 4, "seqlen_q": 4096, "seqlen_k": 4096, "heads_q": 16, "heads_kv": 16}
    knobs90 = {**sm90.KNOBS, "block_m": 256, "num_warpgroups": 4, "min_blocks_per_sm": 1}

    def chosen(**kwargs):
        kernels.forget_kernels()
        kern = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90", **kwargs)
        return kern.info()["schedule"], kern.info()["schedule_source"], kern.knobs

    assert chosen()[:2] == ("sm90", "sm_90a's (no tuning records of both schedules to compare)")
    database.add(database.new_record(target, "sm80", workload, dict(sm80.KNOBS), 1.8, shape=shape))
    assert chosen()[0] == "sm90"  # one record: nothing to compare
    database.add(database.new_record(target, "sm90", workload, knobs90, 1.9, shape=shape))
    assert chosen()[:2] == ("sm80", "tuned records favour sm80: sm90 1.900 ms, sm80 1.800 ms at " + str(dict(sorted(shape.items()))))
    database.add(database.new_record(target, "sm90", workload, knobs90, 1.7, shape=shape))
    schedule, source, knobs = chosen()
    assert schedule == "sm90" and source.startswith("tuned records: sm90 1.700 ms, sm80 1.800 ms")
    assert knobs == knobs90
    assert chosen(knobs={"num_stages": 1})[0] == "sm80"
    # knobs that only the sm90 schedule has select it (the tuner passes its records' knobs that way)
    assert chosen(knobs={"kv_copy": "cp.async", "num_stages": 1})[:2] == ("sm90", "the knobs' (knobs of the sm90 schedule only)")
    monkeypatch.setenv("TVMFLASH_SM90", "0")
    assert chosen()[0] == "sm80"
    monkeypatch.delenv("TVMFLASH_SM90")
    database.add(database.new_record(target, "sm80", workload, dict(sm80.KNOBS), 1.6, shape={**shape, "batch": 8}))
    assert chosen()[0] == "sm90"  # sm80's best record is at another shape: nothing to compare


def test_tune_takes_the_schedule_compile_picks(cache_dir, monkeypatch):
    """On sm_90a the sm90 schedule serves the forward (at d32 the sm80 one), so that is the space the
    tuner searches; TVMFLASH_SM90=0 takes sm80's. Without xgboost (MetaSchedule's cost model) it
    stops there, before building anything."""
    monkeypatch.delenv("TVMFLASH_SM90", raising=False)
    for name, value in (("is_available", True), ("get_device_name", "a test GPU"), ("get_device_capability", (9, 0))):
        monkeypatch.setattr(torch.cuda, name, lambda *_, value=value: value)
    find_spec = tune.importlib.util.find_spec
    monkeypatch.setattr(tune.importlib.util, "find_spec", lambda name: None if name == "xgboost" else find_spec(name))
    for head_dim, setting, expected in ((128, None, "sm90"), (32, None, "sm80"), (128, "0", "sm80")):
        if setting is not None:
            monkeypatch.setenv("TVMFLASH_SM90", setting)
        lines = []
        with pytest.raises(RuntimeError, match="needs xgboost"):
            tune.tune(head_dim=head_dim, dtype="bfloat16", causal=False, target="sm90", echo=lines.append)
        assert lines[0].startswith(f"tvmflash tune: {expected} schedule"), lines
    assert not list(cache_dir.glob("**/*.so"))


def test_one_configuration_tasks_are_built_at_once(cache_dir):
    """MetaSchedule asks for one task's candidates at a time; tasks of one configuration (most of the
    GPU spaces) are built ahead in one parallel batch, and MetaSchedule's requests are served from it."""
    lines = []
    record = tune.tune(head_dim=32, dtype="float32", causal=False, target="cpu", trials=3, batch=1, seqlen=64,
                       heads=1, space={"block_m": [16, 32, 64], "block_n": [32], "vector": [8]}, seed=0, repeat=3,
                       echo=lines.append)
    built = [line for line in lines if line.startswith("  built ")]
    assert any(line.startswith("  building the 3 one-configuration tasks at once") for line in lines), lines
    assert len(built) == 1 and built[0].startswith("  built 3/3 candidates"), lines  # nothing built again
    assert lines[lines.index(built[0]) - 1].startswith("  building 3 candidates, "), lines  # said as it starts
    assert record["trials"] == 3 and record["tuned_ms"] > 0


def test_a_cached_compile_reads_no_tuning_record(cache_dir, monkeypatch):
    """compile() runs on every tvmflash.attention call: the records (tuned knobs, and on sm_90a the
    choice of schedule) are read once, when the Kernel is made, not again for a cached one."""
    monkeypatch.delenv("TVMFLASH_SM90", raising=False)
    lookups = []
    real = database.lookup
    monkeypatch.setattr(database, "lookup", lambda *args: lookups.append(args[1]) or real(*args))
    first = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90")
    assert sorted(lookups) == ["sm80", "sm90"]  # the choice (both schedules); sm90's knobs come from that read
    lookups.clear()
    assert tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90") is first and lookups == []


def test_shipped_records_match_the_current_spaces():
    """Every record shipped in tuning_logs/ names each knob of its schedule's current SPACE (a record
    tuned on an older space is passed over at run time, so shipping one ships nothing)."""
    import json
    from pathlib import Path

    from tvmflash import schedules

    shipped = sorted((Path(__file__).resolve().parent.parent / "tuning_logs").glob("*.json"))
    assert shipped
    for path in shipped:
        for record in json.loads(path.read_text())["records"]:
            module = getattr(schedules, record["schedule"])
            pass_ = record["workload"].get("pass", "forward")
            space = getattr(module, {"forward": "SPACE", "backward": "BACKWARD_SPACE", "decode": "DECODE_SPACE"}[pass_])
            missing = set(space) - set(record["knobs"])
            assert not missing, f"{path.name}: a {record['schedule']} record of {record['workload']} lacks {sorted(missing)}"


def test_tune_all_retunes_every_shipped_workload(cache_dir, monkeypatch, tmp_path, capsys):
    """``tvmflash tune --all`` takes its workloads from the shipped records (tuning_logs/), each once;
    without --all, --head-dim is needed."""
    from tvmflash import cli as tvmflash_cli

    shipped = tmp_path / "shipped"
    record = database.new_record(CPU, "cpu", WORKLOAD, {"block_m": 16, "block_n": 32, "vector": 8}, 1.0)
    database.write(shipped / "some-gpu.json", [record, {**record, "device": "another"}])
    monkeypatch.setattr(database, "SHIPPED_DIR", shipped)
    assert tvmflash_cli.shipped_workloads() == [(32, "float32", False, "forward", 0)]
    assert tvmflash_cli.main(["tune", "--all", "--trials", "1", "--target", "cpu", "--seqlen", "64", "--batch", "1",
                              "--heads", "1"]) == 0
    out = capsys.readouterr().out
    assert "d32 float32 full" in out.split("== summary")[1]
    stored = [r for path, r in database.all_records() if path.parent == database.user_dir()]
    assert [(r["workload"], r["trials"]) for r in stored] == [(WORKLOAD, 1)]
    with pytest.raises(SystemExit) as exit_:
        tvmflash_cli.main(["tune", "--trials", "1"])
    assert exit_.value.code != 0 and "--head-dim" in capsys.readouterr().err


def test_the_backward_space_known_configurations_first(monkeypatch):
    """``tune_passes.candidates``: the known configurations, then a random draw of the rest of the
    space (callable knobs resolved from the knobs before them), each once, leaving out before any
    build those a BackwardKernel refuses (the schedule's ``backward_knobs_problem``, shared memory)."""
    from tvmflash import tune_passes

    assert tune_passes.space_points({"m": [32, 64], "warps": lambda knobs: [knobs["m"] // 32], "v": [8]}) == [
        {"m": 32, "warps": 1, "v": 8}, {"m": 64, "warps": 2, "v": 8}]
    shape = {"batch": 4, "seqlen": 4096, "heads": 16}
    backward = tune_passes.Backward(128, "bfloat16", False, targets.cuda_target("sm90"), shape)
    assert backward.schedule is sm90
    defaults = choice.backward_default_knobs(sm90, 128)
    known = {"default": defaults, "user": {**defaults, "block_n": 64}}
    chosen, problems = tune_passes.candidates(backward, known, 12, random.Random(0))
    assert [label for label, _ in chosen[:3]] == ["default", "user", "#1"] and len(chosen) == 12
    assert len({repr(sorted(knobs.items())) for _, knobs in chosen}) == 12  # no configuration twice
    every = tune_passes.space_points(sm90.BACKWARD_SPACE)
    all_chosen, problems = tune_passes.candidates(backward, known, 1000, random.Random(0))
    assert len(all_chosen) + len(problems) == len(every)
    # dq_atomic with 32-row Q blocks (ds k takes 64 rows a wgmma): a quarter of the space, on the H200
    # 23 of 96 trials failed to schedule before this was checked first
    assert len(problems) == len(every) // 4 and all("pass dq_atomic False" in p for p in problems)
    monkeypatch.setattr(sm90, "BACKWARD_SHARED_MEMORY_LIMIT", 100 * 1024, raising=False)
    fitting, problems = tune_passes.candidates(backward, {}, 1000, random.Random(0))
    assert any("shared memory" in p for p in problems) and len(fitting) + len(problems) == len(every)


def test_tune_backward_stores_a_record_compile_backward_reads(cache_dir, capsys):
    """``tvmflash tune --pass backward`` on the CPU: the defaults and a draw of the space, built in
    parallel processes, each checked against float32 and timed; the fastest is stored as a record of
    the workload's backward, which compile_backward then runs (a forward kernel reads none of it)."""
    from tvmflash import cli as tvmflash_cli

    assert tvmflash_cli.main(["tune", "--pass", "backward", "--head-dim", "32", "--dtype", "float32", "--causal",
                              "--trials", "2", "--target", "cpu", "--seqlen", "64", "--batch", "1", "--heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "measuring 2 configurations (default first)" in out and "trial 2/2" in out, out
    assert "d32 float32 causal backward" in out.split("== summary")[1]
    (record,) = [r for path, r in database.all_records() if path.parent == database.user_dir()]
    assert record["workload"] == {"head_dim": 32, "dtype": "float32", "causal": True, "pass": "backward"}
    assert record["trials"] == 2 and record["failed_trials"] == 0 and set(record["known_ms"]) == {"default"}
    kernels.forget_kernels()
    backward = tvmflash.compile_backward(head_dim=32, dtype="float32", causal=True, target="cpu")
    assert backward.knobs == record["knobs"] and backward.knobs_source.startswith("tuned (")
    assert tvmflash.compile(head_dim=32, dtype="float32", causal=True, target="cpu").knobs_source == "defaults"
    varlen = tvmflash.compile_backward(head_dim=32, dtype="float32", causal=True, target="cpu", varlen=True)
    assert varlen.knobs_source == "defaults"


def test_tune_decode_stores_a_record_compile_decode_reads(cache_dir, capsys):
    """``tvmflash tune --pass decode`` on the CPU: one query token over full caches, a quarter as many
    K/V heads as query heads; the record is the cache layout's (a paged kernel keeps its defaults)."""
    from tvmflash import cli as tvmflash_cli

    assert tvmflash_cli.main(["tune", "--pass", "decode", "--head-dim", "32", "--dtype", "float32", "--trials", "2",
                              "--target", "cpu", "--seqlen", "96", "--batch", "2", "--heads", "4"]) == 0
    out = capsys.readouterr().out
    assert "'heads_q': 4, 'heads_kv': 1" in out and "trial 2/2" in out and "d32 float32 full decode" in out, out
    (record,) = [r for path, r in database.all_records() if path.parent == database.user_dir()]
    assert record["workload"] == choice.decode_workload(32, "float32", 0) and record["failed_trials"] == 0
    contiguous = kernels.compile_decode(head_dim=32, dtype="float32", target="cpu")
    assert contiguous.knobs == record["knobs"] and contiguous.knobs_source.startswith("tuned (")
    assert kernels.compile_decode(head_dim=32, dtype="float32", page_size=16, target="cpu").knobs_source == "defaults"
    with pytest.raises(SystemExit):
        tvmflash_cli.main(["tune", "--head-dim", "32", "--page-size", "16", "--target", "cpu"])
    assert "--page-size" in capsys.readouterr().err


def test_a_tuning_shape_keeps_the_grids_tokens_at_any_seqlen():
    """``--seqlen`` alone: bench's tokens in batches of that length (a GPU's 16k, a CPU's 2k)."""
    from tvmflash import tune

    for target, seqlen, batch in (("sm90", 512, 32), ("sm90", None, 4), ("cpu", 256, 8)):
        _, _, shape = tune.tuning_request(128, "bfloat16", False, 1, target, None, seqlen, None)
        assert (shape["batch"], shape["heads"]) == (batch, 16 if target == "sm90" else 4)
    assert tune.tuning_request(128, "bfloat16", False, 1, "sm90", 3, 512, 2)[2] == {"seqlen": 512, "batch": 3,
                                                                                    "heads": 2}
