"""The schedule contract (``schedules/contract.py``): one declaration of each knob, and everything the
floors above read derived from it: the defaults, the tuning space, the one validation."""

import pytest

from tvmflash.schedules import contract
from tvmflash.schedules.contract import DERIVED, STRUCTURE, TILE, Knob, KnobSet


def tiles(rules=None, build_problem=None):
    return KnobSet("demo", "forward", (
        Knob("block_m", 64, space=(32, 64), role=TILE),
        Knob("num_warps", 2, space=lambda knobs: [knobs["block_m"] // 32], role=DERIVED),
        Knob("num_stages", 2, choices=(1, 2, 3), space=(1, 2), by_head_dim={256: 1}, role=STRUCTURE,
             by_dtype={"float32": 3}),
        Knob("layout", "padded", choices=("padded", "swizzled"), varlen="padded"),
        Knob("flag", False),
    ), rules=rules, build_problem=build_problem, varlen_by_head_dim={128: {"num_stages": 1}})


def test_defaults_follow_the_head_dim_the_dtype_and_varlen():
    knobs = tiles()
    assert knobs.defaults() == {"block_m": 64, "num_warps": 2, "num_stages": 2, "layout": "padded", "flag": False}
    assert knobs.defaults(256)["num_stages"] == 1
    assert knobs.defaults(64, dtype="float32")["num_stages"] == 3 and knobs.defaults(64, dtype="float16")["num_stages"] == 2
    assert knobs.defaults(256, dtype="float32")["num_stages"] == 1  # a head_dim's default over a dtype's
    assert knobs.defaults(128, varlen=True)["num_stages"] == 1
    assert knobs.varlen_required() == {"layout": "padded"}


def test_the_space_and_its_points_are_derived_from_the_declaration():
    knobs = tiles(rules=lambda k: "no" if k["block_m"] == 32 and k["num_stages"] == 1 else None)
    space = knobs.space()
    assert space["block_m"] == [32, 64] and space["layout"] == ["padded"] and callable(space["num_warps"])
    points = knobs.points()
    assert {(p["block_m"], p["num_warps"], p["num_stages"]) for p in points} == {(32, 1, 2), (64, 2, 1), (64, 2, 2)}
    assert knobs.names_of(TILE, STRUCTURE) == ("block_m", "num_stages")


@pytest.mark.parametrize("knobs, message", [
    ({"block_k": 64}, "knobs: ['block_k'] are not knobs of the demo schedule"),
    ({"block_m": 0}, "knobs: block_m: expected a positive int, got 0"),
    ({"block_m": True}, "knobs: block_m: expected a positive int, got True"),
    ({"num_stages": 4}, "knobs: num_stages: the demo schedule takes one of [1, 2, 3], got 4"),
    ({"layout": "banana"}, "knobs: layout: the demo schedule takes one of ['padded', 'swizzled'], got 'banana'"),
    ({"flag": 1}, "knobs: flag: expected True or False, got 1"),
])
def test_one_validation_names_what_is_wrong(knobs, message):
    assert tiles().problem(knobs).startswith(message)


def test_the_rules_and_the_build_problem_see_complete_knobs():
    seen = []
    knobs = tiles(rules=lambda k: seen.append(dict(k)) or ("swizzled needs 2 stages" if k["layout"] == "swizzled"
                                                           and k["num_stages"] != 2 else None),
                  build_problem=lambda head_dim, dtype, k: f"too big at {head_dim}" if head_dim > 128 else None)
    assert knobs.problem({"layout": "swizzled"}) is None and seen[-1]["block_m"] == 64
    assert knobs.problem({"layout": "swizzled", "num_stages": 1}) == "knobs: swizzled needs 2 stages"
    assert knobs.problem({}, 128, "float16") is None
    assert knobs.problem({}, 256, "float16") == "knobs: too big at 256"
    assert knobs.problem({}, 256) is None  # no dtype: the build's limits are not asked


def test_a_record_is_accepted_only_with_exactly_the_sets_knobs():
    knobs = tiles()
    assert knobs.accepts(knobs.defaults())
    assert not knobs.accepts({**knobs.defaults(), "retired": 1})
    assert not knobs.accepts({k: v for k, v in knobs.defaults().items() if k != "flag"})
    assert not knobs.accepts({**knobs.defaults(), "num_stages": 9})


def test_a_declaration_that_contradicts_itself_is_refused():
    with pytest.raises(ValueError, match="declaration"):
        Knob("num_stages", 4, choices=(1, 2, 3))
    with pytest.raises(ValueError, match="declaration"):
        Knob("num_stages", 2, choices=(1, 2, 3), by_dtype={"float32": 4})
    with pytest.raises(ValueError, match="derived"):
        Knob("num_warps", 2, space=lambda knobs: [2])
    with pytest.raises(ValueError, match="twice"):
        KnobSet("demo", "forward", (Knob("block_m", 64), Knob("block_m", 32)))
    with pytest.raises(ValueError, match="role"):
        Knob("block_m", 64, role="size")


def test_every_schedule_declares_valid_defaults_and_spaces():
    from tvmflash import schedules

    for schedule in schedules.SCHEDULES.values():
        for program in contract.PROGRAMS:
            mapped = schedule.program(program)
            if mapped is None:
                continue
            for head_dim in (None, *(mapped.head_dims or (32, 64, 96, 128, 256))):
                for dtype in (None, *schedule.dtypes):
                    assert mapped.knobs.problem(mapped.knobs.defaults(head_dim, dtype=dtype)) is None, \
                        (schedule.name, program, head_dim, dtype)
            assert mapped.knobs.points(), (schedule.name, program)


def test_every_head_dim_a_schedule_declares_passes_its_build_checks():
    """A schedule says which head_dims it builds through its declaration (``ProgramSchedule.head_dims``),
    never by failing in TVM: at each one it declares (every multiple of 8 where it declares none) its
    default knobs pass its own build checks in every dtype it takes."""
    from tvmflash import schedules
    from tvmflash.program import SUPPORTED_HEAD_DIMS

    for schedule in schedules.SCHEDULES.values():
        for program in contract.PROGRAMS:
            mapped = schedule.program(program)
            if mapped is None:
                continue
            for head_dim in mapped.head_dims or SUPPORTED_HEAD_DIMS:
                for dtype in schedule.dtypes:
                    problem = mapped.knobs.problem(mapped.knobs.defaults(head_dim), head_dim, dtype)
                    assert problem is None, (schedule.name, program, head_dim, dtype, problem)
