"""What a run shows and keeps (tvmflash/tune/progress.py): failed candidates, exhausted tasks, the
progress bar."""

import pytest
import tvm

from tvmflash import program, program_forward
from tvmflash.schedules import cpu
from tvmflash.tune.progress import Progress, Reporter, left_out_line, reason_gist
from tvmflash.tune.space import configurations, space_fn, task_knobs
from tvmflash.tune.task import specialize


def test_failed_candidates_are_never_picked():
    """Failed builds and runs (MetaSchedule gives them 1e10 s) are counted, reported, never best."""
    from tvm.s_tir import meta_schedule as ms

    spec = program.AttentionSpec(32, "float32", False, 1, 1)
    mod = tvm.IRModule({"main": specialize(program_forward.attention_forward(spec, 16, 32), spec, batch=1,
                                                seqlen_q=32, seqlen_k=32, softmax_scale=0.2)})
    fixed, sampled = task_knobs({"block_m": [16], "block_n": [32], "vector": [4, 8]}, 16, 32)
    candidates = []
    for decision in (0, 1, 0, 1):
        sch = tvm.s_tir.Schedule(mod)
        space_fn(cpu.SCHEDULE, fixed, sampled)(sch)
        (inst,) = [i for i in sch.trace.insts if i.kind.name == "SampleCategorical"]
        replayed = tvm.s_tir.Schedule(mod)
        sch.trace.with_decision(inst, decision, remove_postproc=True).apply_to_schedule(replayed, remove_postproc=False)
        candidates.append(ms.MeasureCandidate(replayed, []))
    built = [ms.builder.BuilderResult("a.tar", None), ms.builder.BuilderResult(None, "error: too much shared memory"),
             ms.builder.BuilderResult("c.tar", None), ms.builder.BuilderResult("d.tar", None)]
    ran = [ms.runner.RunnerResult([2e-3], None), ms.runner.RunnerResult(None, None),
           ms.runner.RunnerResult(None, "CUDA launch failed"), ms.runner.RunnerResult([1e10], None)]
    lines = []
    progress = Progress([{"name": "bm16_bn32", "fixed": fixed, "sampled": sampled}], 4, lines.append)
    progress.apply(ms.task_scheduler.TaskScheduler.create("round-robin"), 0, candidates, built, ran)
    assert progress.done == 4 and progress.failed == 3
    assert progress.best_knobs == {"block_m": 16, "block_n": 32, "vector": 4} and progress.best_ms == pytest.approx(2.0)
    assert any("too much shared memory" in line for line in lines) and "3 failed" in lines[-1]


def test_a_task_is_exhausted_once_its_configurations_are_measured():
    """A task whose every configuration is measured, or whose search round found nothing new, gets
    no more search rounds (on the H200 each such round cost 6 s and found nothing)."""
    from tvm.s_tir import meta_schedule as ms

    progress = Progress([{"name": "a", "fixed": {}, "structures": [{}], "sampled": {}}, {"name": "b"}], 4,
                             lambda line: None)
    scheduler = ms.task_scheduler.TaskScheduler.create("round-robin")
    assert configurations({"structures": [{}, {}], "sampled": {"vec": [4, 8], "unroll": [0, 1, 2]}}) == 12
    progress.apply(scheduler, 1, [], [], [])
    assert progress.exhausted == {1}
    a = tvm.te.placeholder((4,), name="a")
    sch = tvm.s_tir.Schedule(tvm.te.create_prim_func([a, tvm.te.compute((4,), lambda i: a[i] + 1.0)]))
    progress.apply(scheduler, 0, [ms.MeasureCandidate(sch, [])], [ms.builder.BuilderResult("a.tar", None)],
                   [ms.runner.RunnerResult([1e-3], None)])
    assert progress.exhausted == {0, 1} and progress.best_ms == pytest.approx(1.0)


def test_progress_bar_on_a_terminal():
    """On a terminal the status is one bar redrawn in place (carriage return, erase line), and other
    lines go above it; the last bar stays on its line when the run ends."""
    import io

    stream, lines = io.StringIO(), []
    reporter = Reporter(4, lines.append, stream)
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


# What sm90's pre-check said of the 44 configurations it left out of 124 at d128 (a line each on the
# console before this summary): two reasons, each with its configuration's particulars.
REGISTERS = ("knobs: min_blocks_per_sm: 2 blocks of 512 threads an SM leave 64 registers a thread, and the "
             "accumulators need 128 at head_dim 128 and block_n {}")
MISALIGNED = ("knobs: swizzled tiles without TMA at block_m 64: the 512-byte row values, {}-byte Q tile and "
              "{}-byte K/V tiles put one off the 1024-byte boundary the swizzle needs")


def test_configurations_left_out_are_one_line_counted_by_reason():
    """The configurations the pre-check leaves out before building are one line, counted by what
    their messages say without their particulars (``reason_gist``), the most common first."""
    problems = ([REGISTERS.format(64)] * 10 + [REGISTERS.format(128)] * 10
                + [MISALIGNED.format(q, kv) for q in (16384, 18432) for kv in (16384, 18432) for _ in range(6)])
    assert reason_gist(REGISTERS.format(64)) == "min_blocks_per_sm: 2 blocks of 512 threads an SM leave 64 registers a thread"
    assert reason_gist("it needs 174 KiB of shared memory, cuda sm_80 allows 163 KiB") == "it needs 174 KiB of shared memory"
    assert reason_gist("knobs: q_copy 'tma' needs q_layout 'swizzled' and kv_copy 'tma', got 'core_matrices' and "
                       "'tma'") == "q_copy 'tma' needs q_layout 'swizzled' and kv_copy 'tma'"
    line = left_out_line(problems, 124, "/work/left_out.txt")
    assert line == ('left out 44 of 124 configurations before building: 24 for "swizzled tiles without TMA at block_m '
                    '64: the 512-byte row values", 20 for "min_blocks_per_sm: 2 blocks of 512 threads an SM leave 64 '
                    'registers a thread" (each in /work/left_out.txt)')
    assert "\n" not in line
    assert left_out_line([], 9) == "pre-checked 9 configurations: none left out"
    assert left_out_line([]) == "none left out before building"
    assert left_out_line(["knobs: block_n (24) must be a multiple of threads (64)"]) == \
        'left out 1 configuration before building: 1 for "block_n (24) must be a multiple of threads (64)"'
