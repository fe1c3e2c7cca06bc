"""The one place that chooses (tvmflash/choice.py): on sm_90a, the forward's schedule by the head_dim, the
environment (TVMFLASH_SM90), this device's tuning records of sm80 and sm90 and the caller; and the
records read once, when a kernel is made."""

import os

import pytest

import tvmflash
from tvmflash import choice, database
from tvmflash import target as targets
from tvmflash.schedules import sm80, sm90

SM90 = targets.cuda_target("sm90")
SHAPE = {"batch": 4, "seqlen_q": 4096, "seqlen_k": 4096, "heads_q": 16, "heads_kv": 16}


def spec_args(head_dim: int) -> dict:
    return {"head_dim": head_dim, "dtype": "bfloat16", "causal": False}


def forward_schedule(head_dim: int, **kwargs) -> tuple[str, str]:
    """The name of the forward's schedule on sm_90a and why (``choice.choose_schedule``)."""
    schedule, why, _ = choice.choose_schedule("forward", SM90, spec_args(head_dim), **kwargs)
    return schedule.name, why


def test_sm90a_serves_head_dim_32_with_sm80(cache_dir, monkeypatch):
    """At head_dim 32 the sm80 schedule measured faster on the H200, so sm_90a uses it unless
    TVMFLASH_SM90=1 or this device's records of both schedules say otherwise; other head_dims stay
    on sm90."""
    monkeypatch.delenv("TVMFLASH_SM90", raising=False)
    name, why = forward_schedule(32)
    assert name == "sm80" and "head_dim 32" in why, why
    assert forward_schedule(64)[0] == "sm90"
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    assert forward_schedule(32) == ("sm90", "TVMFLASH_SM90=1")
    # records of both schedules at the same shape decide, as at every head_dim
    monkeypatch.delenv("TVMFLASH_SM90")
    workload = choice.workload(spec_args(32))
    database.add(database.new_record(SM90, "sm80", workload, sm80.SCHEDULE.forward.knobs.defaults(32), 1.8,
                                     shape=SHAPE))
    knobs90 = {**sm90.SCHEDULE.forward.knobs.defaults(32), "kv_layout": "core_matrices", "num_stages": 1,
               "kv_copy": "cp.async"}
    database.add(database.new_record(SM90, "sm90", workload, knobs90, 1.7, shape=SHAPE))
    assert forward_schedule(32)[0] == "sm90"


def test_sm90_serves_a_workload_unless_records_favour_sm80(cache_dir, monkeypatch):
    """With TVMFLASH_SM90 unset, sm_90a's forward takes the sm90 schedule unless this device's tuned
    records for the workload, at the same shape, say the sm80 schedule is faster; 0 keeps sm80.
    Given knobs keep the target's schedule (no record decides, and no knob's name does): the caller
    names another with ``schedule=``."""
    monkeypatch.delenv("TVMFLASH_SM90", raising=False)
    workload = choice.workload(spec_args(128))
    knobs90 = {**sm90.SCHEDULE.forward.knobs.defaults(128), "block_m": 256, "num_warpgroups": 4,
               "min_blocks_per_sm": 1}
    assert forward_schedule(128) == ("sm90", "sm90 at head_dim 128 on sm_90a (no tuning records of both schedules "
                                             "to compare)")
    database.add(database.new_record(SM90, "sm80", workload, sm80.SCHEDULE.forward.knobs.defaults(128), 1.8,
                                     shape=SHAPE))
    assert forward_schedule(128)[0] == "sm90"  # one record: nothing to compare
    database.add(database.new_record(SM90, "sm90", workload, knobs90, 1.9, shape=SHAPE))
    assert forward_schedule(128) == ("sm80", "tuned records favour sm80: sm90 1.900 ms, sm80 1.800 ms at "
                                     + str(dict(sorted(SHAPE.items()))))
    database.add(database.new_record(SM90, "sm90", workload, knobs90, 1.7, shape=SHAPE))
    name, why = forward_schedule(128)
    assert name == "sm90" and why.startswith("tuned records: sm90 1.700 ms, sm80 1.800 ms"), why
    chosen = choice.forward(SM90, spec_args(128), None)
    assert chosen.schedule.name == "sm90" and chosen.knobs == knobs90 and chosen.knobs_source.startswith("tuned (")
    assert forward_schedule(128, knobs_given=True) == ("sm90", "the target's")
    assert forward_schedule(128, schedule="sm80") == ("sm80", "given")
    assert choice.forward(SM90, spec_args(128), {"num_stages": 1}, schedule="sm80").schedule.name == "sm80"
    monkeypatch.setenv("TVMFLASH_SM90", "0")
    assert forward_schedule(128)[0] == "sm80"
    monkeypatch.delenv("TVMFLASH_SM90")
    database.add(database.new_record(SM90, "sm80", workload, sm80.SCHEDULE.forward.knobs.defaults(128), 1.6,
                                     shape={**SHAPE, "batch": 8}))
    assert forward_schedule(128)[0] == "sm90"  # sm80's best record is at another shape: nothing to compare


def test_a_cached_compile_reads_no_tuning_record(cache_dir, monkeypatch):
    """compile() runs on every tvmflash.attention call: the records (tuned knobs, and on sm_90a the
    choice of schedule) are read once, when the Kernel is made, not again for a cached one. The choice
    reads both schedules' records, and the chosen one's knobs come from that read."""
    monkeypatch.delenv("TVMFLASH_SM90", raising=False)
    lookups = []
    real = database.lookup
    monkeypatch.setattr(database, "lookup", lambda *args, **kwargs: lookups.append(args[1]) or real(*args, **kwargs))
    assert choice.forward(SM90, spec_args(128), None).schedule.name == "sm90"
    assert sorted(lookups) == ["sm80", "sm90"]
    lookups.clear()
    first = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90")
    assert sorted(lookups) == ["sm80", "sm90"]
    lookups.clear()
    assert tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm90") is first and lookups == []


def test_the_environment_is_read_in_one_place_and_a_bad_value_is_refused(monkeypatch):
    """TVMFLASH_SM90, TVMFLASH_BACKWARD and TVMFLASH_DECODE are read by ``choice.settings`` alone; a value
    none of them takes is an error, not "on"."""
    monkeypatch.setenv("TVMFLASH_SM90", "banana")
    with pytest.raises(ValueError, match="TVMFLASH_SM90: expected 1 \\(on\\), 0 \\(off\\) or unset"):
        forward_schedule(128)
    monkeypatch.setenv("TVMFLASH_SM90", "0")
    monkeypatch.setenv("TVMFLASH_BACKWARD", "sm70")
    with pytest.raises(ValueError, match="TVMFLASH_BACKWARD: expected one of"):
        choice.settings()
    monkeypatch.setenv("TVMFLASH_BACKWARD", "simt")
    assert choice.settings() == choice.Settings("off", "simt", None)
    assert choice.choose_schedule("backward", SM90, spec_args(128))[:2] == (choice.registry.SCHEDULES["simt"],
                                                                            "TVMFLASH_BACKWARD")


def test_a_schedule_asked_for_must_serve(monkeypatch):
    monkeypatch.delenv("TVMFLASH_SM90", raising=False)
    with pytest.raises(ValueError, match="schedule 'sm90' \\(given\\): the sm90 schedule does not run on cuda sm_80"):
        choice.choose_schedule("forward", targets.cuda_target("sm80"), spec_args(128), schedule="sm90")
    with pytest.raises(ValueError, match="schedule: expected one of"):
        choice.choose_schedule("forward", SM90, spec_args(128), schedule="sm75")
    with pytest.raises(ValueError, match="the sm90 backward serves head_dim 64, 96, 128, 256, got 32"):
        choice.choose_schedule("backward", SM90, spec_args(32), schedule="sm90")


def test_a_newer_gpu_gets_the_sm80_schedule_with_a_note(caplog):
    schedule, why, _ = choice.choose_schedule("forward", targets.cuda_target("sm120"), spec_args(128))
    assert schedule.name == "sm80" and "no schedule is written for sm_120 yet" in why


def test_derived_knobs_follow_the_given_ones():
    """A derived knob that was not given takes its first candidate where its default does not go with the
    given knobs: dkdv_copy "cp.async" at d128 leaves dq_reduce "tma" (TMA reductions, which need dkdv's TMA
    lowering) for "atomic", and dkdv_producer "warpgroup" at d64 for "thread"; a derived knob given with
    the knobs it needs is kept, and one given against them is refused."""
    backward = tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90")
    assert backward.knobs["dq_reduce"] == "tma" and backward.knobs["dkdv_copy"] == "tma"
    plain = tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90", knobs={"dkdv_copy": "cp.async"})
    assert plain.knobs["dq_reduce"] == "atomic"
    d64 = tvmflash.compile_backward(head_dim=64, dtype="bfloat16", target="sm90", knobs={"dkdv_copy": "cp.async"})
    assert d64.knobs["dkdv_producer"] == "thread" and d64.knobs["dq_reduce"] == "vector"
    with pytest.raises(ValueError, match="needs dkdv_copy 'tma'"):
        tvmflash.compile_backward(head_dim=128, dtype="bfloat16", target="sm90",
                                  knobs={"dkdv_copy": "cp.async", "dq_reduce": "tma"})


def test_the_environment_key_follows_os_environ(monkeypatch):
    """choice.environment (the kernels' caches' key, read from os.environ's own mapping on POSIX) sees each
    change of a variable through os.environ at once, set, changed and removed."""
    from tvmflash import choice

    monkeypatch.delenv("TVMFLASH_BACKWARD", raising=False)
    before = choice.environment("backward")
    assert before[-1] == ""
    monkeypatch.setenv("TVMFLASH_BACKWARD", "sm80")
    assert choice.environment("backward") == (*before[:-1], "sm80")
    monkeypatch.setenv("TVMFLASH_BACKWARD", "simt")
    assert choice.environment("backward")[-1] == "simt"
    monkeypatch.delenv("TVMFLASH_BACKWARD")
    assert choice.environment("backward") == before
    for program, names in choice.ENVIRONMENT.items():
        assert choice.environment(program) == tuple(os.environ.get(name, "") for name in names)
