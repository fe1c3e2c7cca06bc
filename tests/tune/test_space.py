"""The design space (tvmflash/tune/space.py): which knobs are tasks, structures or sampled decisions,
and a design space's trace replays."""

import tvm

from tvmflash import program
from tvmflash.schedules import cpu, simt, sm80, sm90
from tvmflash.tune.space import space_fn, structures, task_knobs, task_name, task_points
from tvmflash.tune.task import specialize


def test_spaces_hold_knobs_of_their_schedules():
    for module in (cpu, simt, sm80):
        assert set(module.SPACE) <= set(module.KNOBS)
        assert module.KNOBS["block_m"] in module.SPACE["block_m"] and module.KNOBS["block_n"] in module.SPACE["block_n"]
    # sm80 needs block_m == 32 * num_warps: num_warps is derived, never sampled.
    for block_m in sm80.SPACE["block_m"]:
        fixed, sampled = task_knobs(sm80.SPACE, block_m, 64, num_stages=2)
        assert fixed["num_warps"] * 32 == block_m and fixed["num_stages"] == 2 and not sampled
    fixed, sampled = task_knobs(cpu.SPACE, 32, 64)
    assert fixed == {"block_m": 32, "block_n": 64} and sampled == {"vector": [8, 16]}
    assert len(task_points(simt, simt.SPACE)) == 9
    # Only the program's tiles are tasks; sm80's num_stages sets pipeline annotations (a plain int):
    # each value is a design space (structure) inside the task.
    points = task_points(sm80, sm80.SPACE)
    assert len(points) == 2 * 3 and task_name(points[-1]) == "bm128_bn128"
    assert structures(sm80, sm80.SPACE, points[-1]) == [{"num_stages": 1}, {"num_stages": 2}]
    # sm90: the tiles and min_blocks_per_sm (a function attribute) are the program; the rest structures.
    points = task_points(sm90, sm90.SPACE)
    assert len(points) == 3 * 2 * 2 and set(points[0]) == {"block_m", "block_n", "min_blocks_per_sm"}
    options = structures(sm90, sm90.SPACE, {"block_m": 128, "block_n": 64, "min_blocks_per_sm": 1})
    assert all(sm90.valid_knobs({**sm90.KNOBS, "min_blocks_per_sm": 1, **o}) for o in options) and len(options) == 12


def test_sm80_design_space_replays():
    """MetaSchedule's search replays each design-space trace on a fresh schedule: the sm80 space
    with its default knobs must replay to the same IR (a schedule step outside the trace, such as a
    block replaced in the schedule state, breaks this and leaves the search without candidates)."""
    spec = program.AttentionSpec(64, "bfloat16", True, 2, 1)
    mod = tvm.IRModule({"main": specialize(program.attention_forward(spec, 128, 64), spec, batch=1,
                                                seqlen_q=300, seqlen_k=300, softmax_scale=0.1)})
    fixed, sampled = task_knobs(sm80.SPACE, 128, 64, num_stages=sm80.KNOBS["num_stages"])
    sch = tvm.s_tir.Schedule(mod)
    space_fn(sm80, fixed, sampled)(sch)
    replayed = tvm.s_tir.Schedule(mod)
    sch.trace.apply_to_schedule(replayed, remove_postproc=True)
    tvm.ir.assert_structural_equal(replayed.mod, sch.mod)
