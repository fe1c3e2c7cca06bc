"""The design space (tvmflash/tune/space.py): which knobs are tasks, structures or sampled decisions,
and a design space's trace replays."""

import tvm

from tvmflash import program, program_forward
from tvmflash.schedules import cpu, simt, sm80, sm90
from tvmflash.tune.space import space_fn, structures, task_knobs, task_name, task_points
from tvmflash.tune.task import specialize


def test_spaces_hold_knobs_of_their_schedules():
    for schedule in (cpu.SCHEDULE, simt.SCHEDULE, sm80.SCHEDULE):
        knobs = schedule.forward.knobs
        space, defaults = knobs.space(), knobs.defaults()
        assert set(space) == set(defaults) == set(knobs.names)
        assert defaults["block_m"] in space["block_m"] and defaults["block_n"] in space["block_n"]
    # sm80 needs block_m == 32 * num_warps: num_warps is derived, never sampled.
    sm80_space = sm80.SCHEDULE.forward.knobs.space()
    for block_m in sm80_space["block_m"]:
        fixed, sampled = task_knobs(sm80_space, block_m, 64, num_stages=2)
        assert fixed["num_warps"] * 32 == block_m and fixed["num_stages"] == 2 and not sampled
    fixed, sampled = task_knobs(cpu.SCHEDULE.forward.knobs.space(), 32, 64)
    assert fixed == {"block_m": 32, "block_n": 64} and sampled == {"vector": [8, 16]}
    assert len(task_points(simt.SCHEDULE, simt.SCHEDULE.forward.knobs.space())) == 9
    # Only the program's tiles are tasks; sm80's num_stages sets pipeline annotations (a plain int):
    # each value is a design space (structure) inside the task.
    points = task_points(sm80.SCHEDULE, sm80_space)
    assert len(points) == 2 * 3 and task_name(points[-1]) == "bm128_bn128"
    assert structures(sm80.SCHEDULE, sm80_space, points[-1]) == [{"num_stages": 1}, {"num_stages": 2}]
    # sm90: the tiles and min_blocks_per_sm (a function attribute) are the program; the rest structures.
    sm90_knobs = sm90.SCHEDULE.forward.knobs
    points = task_points(sm90.SCHEDULE, sm90_knobs.space())
    assert len(points) == 3 * 2 * 2 and set(points[0]) == {"block_m", "block_n", "min_blocks_per_sm"}
    options = structures(sm90.SCHEDULE, sm90_knobs.space(), {"block_m": 128, "block_n": 64, "min_blocks_per_sm": 1})
    assert all(sm90_knobs.rules({**sm90_knobs.defaults(), "min_blocks_per_sm": 1, **o}) is None for o in options)
    assert len(options) == 12


def test_sm80_design_space_replays():
    """MetaSchedule's search replays each design-space trace on a fresh schedule: the sm80 space
    with its default knobs must replay to the same IR (a schedule step outside the trace, such as a
    block replaced in the schedule state, breaks this and leaves the search without candidates)."""
    spec = program.AttentionSpec(64, "bfloat16", True, 2, 1)
    mod = tvm.IRModule({"main": specialize(program_forward.attention_forward(spec, 128, 64), spec, batch=1,
                                                seqlen_q=300, seqlen_k=300, softmax_scale=0.1)})
    knobs = sm80.SCHEDULE.forward.knobs
    fixed, sampled = task_knobs(knobs.space(), 128, 64, num_stages=knobs.defaults()["num_stages"])
    sch = tvm.s_tir.Schedule(mod)
    space_fn(sm80.SCHEDULE, fixed, sampled)(sch)
    replayed = tvm.s_tir.Schedule(mod)
    sch.trace.apply_to_schedule(replayed, remove_postproc=True)
    tvm.ir.assert_structural_equal(replayed.mod, sch.mod)


def test_a_space_that_leaves_a_tile_out_keeps_the_dtypes_default():
    """``searched_space``: a tile knob the given space leaves out keeps its default at the run's dtype
    (the CPU's float32 tiles are 128 x 32, its others 64 x 64)."""
    from tvmflash.schedules import cpu
    from tvmflash.tune.space import searched_space

    assert searched_space(cpu.SCHEDULE, {"vector": [8, 16]}, "float32") == {"block_m": [128], "block_n": [32],
                                                                              "vector": [8, 16]}
    assert searched_space(cpu.SCHEDULE, {"vector": [8]}, "bfloat16")["block_m"] == [64]
