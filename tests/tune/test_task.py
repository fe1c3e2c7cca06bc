"""The tasks (tvmflash/tune/task.py): a task a program, its structures design spaces of one task,
and what cannot build left out with a message before anything is built."""

import pytest
import tvm

import tvmflash
from tvmflash import program
from tvmflash import target as targets
from tvmflash.schedules import sm80, sm90
from tvmflash.schedules.contract import STRUCTURE
from tvmflash.tune.mutator import MutateKnob
from tvmflash.tune.space import Retracer, decided_knobs
from tvmflash.tune.task import make_tasks


def test_structures_are_design_spaces_of_one_task(tmp_path, monkeypatch):
    """sm90's structure knobs (layouts, copies, stages) are not tasks: one task per program (tiles and
    min_blocks_per_sm) holds a design space per valid structure, so one evolutionary search and one
    cost model see them all. A candidate's trace names its structure; MutateKnob moves it to another
    (scheduled again); the defaults seed their task. None of it needs TVM's tensor intrinsic library
    (``task.tune_context``: its import took 16-38 s of every tuning process)."""
    import random
    import sys

    monkeypatch.setitem(sys.modules, "tvm.s_tir.tensor_intrin", None)  # importing it now fails

    spec = program.AttentionSpec(128, "bfloat16", False, 2, 2)
    lines = []
    knobs90 = sm90.SCHEDULE.forward.knobs
    space = {**knobs90.space(), "block_m": [128], "block_n": [64]}
    defaults = knobs90.defaults(128)
    tasks = make_tasks(sm90.SCHEDULE, spec, {"batch": 1, "seqlen": 512, "heads": 2}, space, targets.cuda_target("sm90"),
                            tmp_path, random.Random(0), lines.append, known={"default": defaults})
    assert [t["name"] for t in tasks] == ["bm128_bn64_mb1", "bm128_bn64_mb2"]
    assert lines[0].startswith("  building the design space: 2 tasks (programs), pre-checking their 22 configurations")
    assert len(lines) == 2 and lines[1].endswith("pre-checked 22 configurations: none left out"), lines
    task = tasks[1]
    fixed, sampled, options = task["fixed"], task["sampled"], task["structures"]
    assert len(options) == 10 and not sampled  # mb2: no producer warpgroup
    ((label, seed),) = task["seeds"]
    assert label == "default" and decided_knobs(seed, fixed, sampled, options) == {**defaults, **fixed}
    spaces = task["context"].generate_design_space()
    assert [decided_knobs(s.trace, fixed, sampled, options) for s in spaces] == [{**fixed, **o} for o in options]
    retracer = Retracer(sm90.SCHEDULE, task["context"].mod, fixed, sampled, options)
    mutator = MutateKnob(3, options, retracer)
    seen = set()
    for _ in range(4):
        mutated = mutator.apply(seed)
        again = tvm.s_tir.Schedule(task["context"].mod)
        mutated.apply_to_schedule(again, remove_postproc=True)  # replays: the trace is the new structure's
        knobs = decided_knobs(again.trace, fixed, sampled, options)
        changed = {n for n in knobs90.names_of(STRUCTURE) if knobs[n] != defaults[n]}
        # one knob moved, with the fewest others that must go with it (kv_layout "core_matrices"
        # needs kv_copy "cp.async"; num_stages 1 too), to a structure of the task
        assert changed in ({"q_layout"}, {"kv_copy"}, {"kv_layout", "kv_copy"}, {"num_stages", "kv_copy"}), changed
        seen.add(frozenset(changed))
    assert len(seen) > 1


def test_rejected_tile_pairs_are_skipped(tmp_path):
    """sm80 needs block_n % 16 == 0: that pair is skipped, counted in the summary line; the others
    become tasks."""
    import random

    spec = program.AttentionSpec(64, "float16", False, 2, 2)
    lines = []
    space = {**sm80.SCHEDULE.forward.knobs.space(), "block_m": [64], "block_n": [40, 64], "num_stages": [1]}
    tasks = make_tasks(sm80.SCHEDULE, spec, {"batch": 1, "seqlen": 256, "heads": 2}, space, targets.cuda_target("sm80"),
                            tmp_path, random.Random(0), lines.append)
    assert [t["name"] for t in tasks] == ["bm64_bn64"] and tasks[0]["fixed"]["num_warps"] == 2
    assert len(lines) == 2 and 'left out 1 of 2 configurations before building: 1 for "the sm80 schedule rejects it' \
        in lines[1], lines
    assert (tmp_path / "left_out.txt").read_text().startswith("bm64_bn40 ns1: the sm80 schedule rejects it: block_n and head_dim")
    with pytest.raises(ValueError, match="rejects every"):
        make_tasks(sm80.SCHEDULE, spec, {"batch": 1, "seqlen": 256, "heads": 2}, {**space, "block_n": [40]},
                        targets.cuda_target("sm80"), tmp_path, random.Random(0), lines.append)


def test_tasks_over_the_shared_memory_limit_are_skipped(tmp_path):
    """A task whose tiles need more shared memory than the target allows is skipped before anything is
    built (sm80's 163 KiB: 128x128 tiles at d128 fit with one K/V stage, not two): the summary line
    counts it by reason, left_out.txt in the work dir says which and why."""
    import random

    spec = program.AttentionSpec(128, "bfloat16", False, 2, 2)
    lines = []
    space = {**sm80.SCHEDULE.forward.knobs.space(), "block_m": [128], "block_n": [128], "num_stages": [1, 2]}
    tasks = make_tasks(sm80.SCHEDULE, spec, {"batch": 1, "seqlen": 256, "heads": 2}, space, targets.cuda_target("sm80"),
                            tmp_path, random.Random(0), lines.append)
    assert [t["name"] for t in tasks] == ["bm128_bn128"] and tasks[0]["structures"] == [{"num_stages": 1}]
    assert lines[1].endswith('left out 1 of 2 configurations before building: 1 for "it needs 174 KiB of shared '
                             f'memory" (each in {tmp_path / "left_out.txt"})'), lines
    assert (tmp_path / "left_out.txt").read_text() == \
        "bm128_bn128 ns2: it needs 174 KiB of shared memory, cuda sm_80 allows 163 KiB\n"


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
    space = {**sm90.SCHEDULE.forward.knobs.space(), "block_m": [256], "block_n": [64], "num_stages": [2],
             "kv_layout": ["swizzled"], "q_layout": ["core_matrices"]}
    tasks = make_tasks(sm90.SCHEDULE, spec, {"batch": 1, "seqlen": 512, "heads": 2}, space, targets.cuda_target("sm90"),
                            tmp_path, random.Random(0), lines.append)
    # (a producer warpgroup needs block_m 128: those structures are never made)
    assert [t["name"] for t in tasks] == ["bm256_bn64_mb1"]
    assert [s["kv_copy"] for s in tasks[0]["structures"]] == ["tma", "cp.async"]
    assert 'for "min_blocks_per_sm: 2 blocks of 512 threads an SM leave 64 registers a thread"' in lines[1], lines
    details = (tmp_path / "left_out.txt").read_text().splitlines()
    assert details[0].startswith("bm256_bn64_mb2 ns2_swizzled") and all(d.startswith("bm256_bn64_mb2 ") for d in details)
