"""Tuning the FP8 kernels (issue 44, item 5): ``tvmflash tune --dtype float8_e4m3fn`` (the FP8 forward, sm90) and
``tvmflash tune --pass decode --cache-dtype float8_e4m3fn`` (decode over an FP8 KV cache); their records' keys,
read by those kernels alone."""

import math
import random

import pytest
import torch

import tvmflash
from tvmflash import choice, database, fp8_reference, kernels
from tvmflash import target as targets
from tvmflash.kernels.fp8 import Fp8Kernel, fp8_kernel
from tvmflash.program import FP8
from tvmflash.schedules import cpu, sm90
from tvmflash.tune import measured

F8 = torch.float8_e4m3fn


@pytest.fixture
def unchecked(monkeypatch):
    """The FP8 kernels are served on a GPU target where TVMFLASH_GPU_UNCHECKED=1 asks until their GPU tests pass."""
    monkeypatch.setenv(choice.GPU_UNCHECKED, "1")


def user_records() -> list[dict]:
    return [r for path, r in database.all_records() if path.parent == database.user_dir()]


def fp8_cache_record(kernel) -> dict:
    """The tuning record a decode kernel's knobs came from (``choice.decode``'s), looked up as it looks it up."""
    workload = choice.workload({"head_dim": kernel.head_dim, "dtype": kernel.dtype, "causal": False}, "decode",
                               kernel.page_size, kernel.variant.get("cache_dtype"))
    return choice.lookup(kernel.target, kernel.schedule, "decode", workload)


def rewrite_knobs(record: dict, knobs: dict) -> None:
    """Give the user's record of ``record``'s key these knobs (as a run that found them faster would have)."""
    path = database.user_dir() / f"{database.slug(record['device'])}.json"
    database.write(path, [{**r, "knobs": knobs} if database.same_key(r, record) else r for r in database.read(path)])
    kernels.forget_kernels()


# ----------------------------------------------------------------------------------------------------
# the keys
# ----------------------------------------------------------------------------------------------------
def test_fp8_workloads_are_keys_of_their_own_and_the_others_keep_theirs():
    """The FP8 forward's workload is the forward's with the dtype float8_e4m3fn; decode over an FP8 cache has
    cache_dtype, a field only then (a cache in q's dtype, given or not, keeps the key of the shipped records)."""
    plain = {"head_dim": 128, "dtype": "bfloat16", "causal": False}
    assert choice.fp8_workload(128, True) == {"head_dim": 128, "dtype": FP8, "causal": True}
    assert choice.workload(plain, "decode", 16) == {**plain, "pass": "decode", "page_size": 16}
    assert choice.workload(plain, "decode", 16, "bfloat16") == choice.workload(plain, "decode", 16)
    assert choice.workload(plain, "decode", 0, FP8) == {**plain, "pass": "decode", "page_size": 0, "cache_dtype": FP8}
    assert choice.workload(plain) == plain and choice.workload(plain, "backward") == {**plain, "pass": "backward"}
    # what a shipped record's knobs are checked against (tests/test_database.py)
    assert choice.record_knob_set(sm90.SCHEDULE, choice.fp8_workload(128, False)) is sm90.SCHEDULE.fp8_forward.knobs
    assert choice.record_knob_set(sm90.SCHEDULE, plain) is sm90.SCHEDULE.forward.knobs


def test_an_fp8_forward_record_is_read_by_the_fp8_forward_alone(records_dir, unchecked):
    """A record of ``fp8_workload`` on sm90 (made here without a GPU: the device key of a machine without one)
    gives the FP8 forward's kernels of its causal setting its knobs (fp8_kernel, which flash_attn_func calls,
    after forget_kernels); not the other causal setting's, nor the bf16 forward's; a caller's knobs win, and
    a record whose knobs the knob set no longer accepts is passed over."""
    target = targets.resolve("sm90")
    knobset = sm90.SCHEDULE.fp8_forward.knobs
    tuned = {**knobset.defaults(128), "block_m": 64, "num_warpgroups": 1, "min_blocks_per_sm": 2}
    record = database.new_record(target, "sm90", choice.fp8_workload(128, False), tuned, 1.0,
                                 shape={"batch": 4, "seqlen_q": 4096, "seqlen_k": 4096, "heads_q": 16, "heads_kv": 16})
    database.add(record)
    kernels.forget_kernels()
    kernel = Fp8Kernel(128, False, "sm90")
    assert kernel.knobs == tuned and kernel.knobs_source.startswith("tuned (") and kernel.record["knobs"] == tuned
    assert fp8_kernel(128, False, "sm90").knobs == tuned
    assert kernels.compile_fp8(head_dim=128, target="sm90").knobs == tuned
    assert Fp8Kernel(128, True, "sm90").knobs == knobset.defaults(128)  # causal: a workload of its own
    assert Fp8Kernel(64, False, "sm90").knobs_source == "defaults"
    given = Fp8Kernel(128, False, "sm90", knobs={"block_n": 64})
    assert given.knobs == {**knobset.defaults(128), "block_n": 64} and given.knobs_source == "given"
    bf16 = kernels.compile(head_dim=128, dtype="bfloat16", target="sm90")
    assert bf16.knobs_source == "defaults"  # the bf16 forward's records are its own
    # a record of knobs the knob set does not take (an older schedule's): the defaults
    rewrite_knobs(record, {**tuned, "no_such_knob": 1})
    assert Fp8Kernel(128, False, "sm90").knobs_source == "defaults"
    with pytest.raises(ValueError, match="not FP8 forward knobs of the sm90 schedule"):
        Fp8Kernel(128, False, "sm90", knobs={"no_such_knob": 1})


def test_the_fp8_forward_knob_set_keeps_its_defaults_and_spans_a_space_that_fits(unchecked):
    """sm90's FP8 knob set: the defaults by head_dim the kernels were built and checked with, each of
    FP8_VARIANTS a valid configuration; its points that the tuner measures are left out before building only
    for the build's reasons (registers, shared memory)."""
    knobset = sm90.SCHEDULE.fp8_forward.knobs
    base = {"block_m": 128, "num_warpgroups": 2, "num_stages": 2, "kv_copy": "cp.async"}
    assert knobset.defaults(64) == {**base, "block_n": 128, "min_blocks_per_sm": 2}
    assert knobset.defaults(128) == {**base, "block_n": 128, "min_blocks_per_sm": 1}
    assert knobset.defaults(256) == {**base, "block_n": 64, "min_blocks_per_sm": 1}
    for head_dim, variants in sm90.knobs.FP8_VARIANTS.items():
        for knobs in variants.values():
            assert knobset.problem(knobs, head_dim, FP8) is None, (head_dim, knobs)
    assert cpu.SCHEDULE.fp8_forward.knobs is cpu.SCHEDULE.forward.knobs  # the CPU's: its forward's
    shape = {"batch": 4, "seqlen": 4096, "heads": 16}
    pass_ = measured.Fp8Forward(256, FP8, False, targets.resolve("sm90"), shape)
    chosen, problems = measured.candidates(pass_, {"default": pass_.defaults}, 100, random.Random(0))
    assert chosen[0] == ("default", pass_.defaults) and len(chosen) + len(problems) == len(knobset.points())
    # d256's 128-key tiles in 3 stages need 252 KiB
    assert any("KiB of shared memory" in p for p in problems), problems


# ----------------------------------------------------------------------------------------------------
# the FP8 forward's tune: sm90 alone
# ----------------------------------------------------------------------------------------------------
def test_the_fp8_forward_tune_is_refused_off_sm90(records_dir, capsys):
    """On the CPU and on a GPU without sm90 the FP8 forward's tune says why, before anything is built; the
    command line's other FP8 misuses too."""
    from tvmflash import cli as tvmflash_cli

    assert tvmflash_cli.FP8 == FP8  # (written out there: the parser imports no torch)
    with pytest.raises(ValueError, match=r"the FP8 forward is tuned on an sm90 GPU \(H100, H200\)"):
        tvmflash.tune.tune_pass("fp8", head_dim=128, dtype=FP8, target="cpu", trials=2)
    with pytest.raises(ValueError, match=r"runs on sm90 \(H100, H200\) alone"):
        tvmflash.tune.tune_pass("fp8", head_dim=128, dtype=FP8, target="sm80", trials=2)
    with pytest.raises(ValueError, match="tune_pass"):  # MetaSchedule's search is the bf16 forward's
        tvmflash.tune.tune(head_dim=128, dtype=FP8, causal=False, target="cpu", trials=2)
    for args, message in ((["--dtype", FP8, "--target", "cpu"], "sm90 GPU"),
                          (["--dtype", FP8, "--pass", "backward"], "no backward"),
                          (["--dtype", FP8, "--pass", "decode"], "--cache-dtype"),
                          (["--cache-dtype", FP8], "--pass decode only"),
                          (["--pass", "decode", "--cache-dtype", FP8, "--dtype", "float32", "--target", "cpu"],
                           "float16 or bfloat16")):
        with pytest.raises(SystemExit) as exited:
            tvmflash_cli.main(["tune", "--head-dim", "128", *args])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and message in err and "Traceback" not in err, (args, err)
    assert user_records() == []


def test_the_fp8_forward_check_is_the_tests_rule(unchecked):
    """``Fp8Forward.wrong``: ``fp8_reference.forward_error`` on two heads' last rows; the emulation passes,
    an output a little off fails, as does one the kernel never wrote (NaN: the pass poisons it first)."""
    pass_ = measured.Fp8Forward(64, FP8, True, targets.resolve("sm90"), {"batch": 2, "seqlen": 80, "heads": 3})
    pass_.inputs(torch.device("cpu"))
    scale = 64 ** -0.5
    emulated = fp8_reference.emulation(pass_.q, pass_.k, pass_.v, *pass_.descales, scale, True)
    assert pass_.wrong(emulated) == []
    off = emulated.clone()
    off[0, -1, 1, 0] += 0.25
    assert "2x the emulation's" in pass_.wrong(off)[0]
    pass_.poison()
    assert pass_.wrong(pass_.out) and pass_.out.isnan().all()
    assert pass_.record_shape == {"batch": 2, "seqlen_q": 80, "seqlen_k": 80, "heads_q": 3, "heads_kv": 3}


def test_the_fp8_tune_runs_end_to_end_on_the_cpu_schedule(records_dir, one_core, monkeypatch, capsys):
    """The FP8 forward's measured pass, run on the CPU schedule's FP8 forward (which the tune refuses, lifted
    here): its candidates build (``kernels.compile_fp8``), pass the check and are timed; the record is
    ``fp8_workload``'s, which compile_fp8 reads and the forward of the other dtypes does not."""
    monkeypatch.setattr(measured.Fp8Forward, "target_problem", staticmethod(lambda target: None))
    record = tvmflash.tune.tune_pass("fp8", head_dim=32, dtype=FP8, target="cpu", trials=2, batch=1, seqlen=64,
                                     heads=2, seed=0)
    out = capsys.readouterr().out
    assert "trial 2/2" in out and record["failed_trials"] == 0, out
    (stored,) = user_records()
    assert stored["workload"] == choice.fp8_workload(32, False) and stored["schedule"] == "cpu"
    kernel = kernels.compile_fp8(head_dim=32, target="cpu")
    assert kernel.knobs == stored["knobs"] and kernel.record is not None
    assert tvmflash.compile(head_dim=32, dtype="float32", target="cpu").knobs_source == "defaults"


# ----------------------------------------------------------------------------------------------------
# decode over an FP8 cache: end to end on the CPU
# ----------------------------------------------------------------------------------------------------
def test_tune_fp8_cache_decode_stores_a_record_fp8_decode_alone_reads(records_dir, one_core, monkeypatch, capsys):
    """``tvmflash tune --pass decode --cache-dtype float8_e4m3fn`` on the CPU: candidates checked as
    tests/test_decode_fp8.py checks them; the record (workload with cache_dtype) is read by decode over an FP8
    cache (compile_decode's, and flash_attn_with_kvcache's, whose output then passes the same check) and not by
    decode over a bf16 cache."""
    from tvmflash import cli as tvmflash_cli

    assert tvmflash_cli.main(["tune", "--pass", "decode", "--cache-dtype", FP8, "--head-dim", "32", "--dtype",
                              "bfloat16", "--trials", "2", "--target", "cpu", "--seqlen", "96", "--batch", "2",
                              "--heads", "4"]) == 0
    out = capsys.readouterr().out
    assert f"{FP8} cache" in out and "trial 2/2" in out, out
    assert f"d32 bfloat16 full decode {FP8} cache" in out.split("== summary")[1]
    (record,) = user_records()
    assert record["workload"] == {"head_dim": 32, "dtype": "bfloat16", "causal": False, "pass": "decode",
                                  "page_size": 0, "cache_dtype": FP8}
    assert record["failed_trials"] == 0
    fp8_cache = kernels.compile_decode(head_dim=32, dtype="bfloat16", target="cpu", cache_dtype=F8)
    assert fp8_cache.knobs == record["knobs"] and fp8_cache.knobs_source.split(" (")[0] in ("tuned", "defaults")
    assert database.record_id(fp8_cache_record(fp8_cache)) == database.record_id(record)
    assert kernels.compile_decode(head_dim=32, dtype="bfloat16", target="cpu").knobs_source == "defaults"
    assert kernels.compile_decode(head_dim=32, dtype="bfloat16", target="cpu", cache_dtype=F8,
                                  page_size=16).knobs_source == "defaults"

    # knobs other than the defaults in the record: flash_attn_with_kvcache over an FP8 cache runs them
    knobset = fp8_cache.schedule.decode.knobs
    other = next(p for p in knobset.points() if {**knobset.defaults(32, dtype="bfloat16"), **p} != fp8_cache.knobs)
    other = {**knobset.defaults(32, dtype="bfloat16"), **other}
    rewrite_knobs(record, other)
    seen = []
    decode = choice.decode
    monkeypatch.setattr(choice, "decode", lambda *a, **k: seen.append(decode(*a, **k)) or seen[-1])
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 1, 4, 32, generator=gen).to(torch.bfloat16)
    k8, v8 = ((torch.randn(2, 40, 1, 32, generator=gen) * 2).to(F8) for _ in range(2))
    kd, vd = ((torch.rand(2, 1, generator=gen) + 0.5) for _ in range(2))
    lengths = torch.tensor([40, 17], dtype=torch.int32)
    out = tvmflash.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lengths, k_descale=kd, v_descale=vd)
    assert seen and seen[-1].knobs == other and seen[-1].knobs_source.startswith("tuned (")
    error, allowed = fp8_reference.decode_error(out, q, k8, v8, lengths, kd, vd)
    assert 0 < error <= allowed, (error, allowed)
    tvmflash.flash_attn_with_kvcache(q, k8.to(torch.bfloat16), v8.to(torch.bfloat16), cache_seqlens=lengths)
    assert seen[-1].knobs_source == "defaults"  # a bf16 cache: not the FP8 cache's record


# ----------------------------------------------------------------------------------------------------
# on the GPU (sm90)
# ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_tune_the_fp8_forward_on_sm90(records_dir, unchecked, capsys):
    """``tvmflash tune --dtype float8_e4m3fn`` with few trials on an sm90 GPU: every candidate builds and passes
    the tests' rule, the record is the FP8 workload's, and flash_attn_func in FP8 then runs its knobs and
    passes the same rule."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs an sm90 GPU (H100, H200)")
    from tvmflash import cli as tvmflash_cli

    assert tvmflash_cli.main(["tune", "--dtype", FP8, "--head-dim", "128", "--trials", "4", "--seqlen", "2048",
                              "--batch", "2", "--heads", "8"]) == 0
    out = capsys.readouterr().out
    print(out)
    (record,) = user_records()
    assert record["workload"] == choice.fp8_workload(128, False) and record["schedule"] == "sm90"
    assert record["failed_trials"] == 0, out
    kernel = fp8_kernel(128, False, None)
    assert kernel.knobs == record["knobs"] and kernel.record is not None
    gen = torch.Generator().manual_seed(3)
    q, k, v = ((torch.randn(2, 700, 4, 128, generator=gen) * 2).to(F8).cuda() for _ in range(3))
    qd, kd, vd = ((torch.rand(2, 4, generator=gen) + 0.5).cuda() for _ in range(3))
    out = tvmflash.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    error, allowed = fp8_reference.forward_error(out, q, k, v, qd, kd, vd, 128 ** -0.5, False)
    assert not math.isnan(error) and error <= allowed, (error, allowed)
