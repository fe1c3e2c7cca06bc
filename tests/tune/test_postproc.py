"""The pre-check (tvmflash/tune/postproc.py, space.candidate_problem): what cannot build is rejected
before it is built, and only that."""

import shutil

import pytest
import tvm

import tvmflash
from tvmflash import program, program_forward
from tvmflash import target as targets
from tvmflash.schedules import cpu, sm80, sm90
from tvmflash.schedules.sm90 import knobs as sm90_knobs
from tvmflash.tune.builder import ms_build
from tvmflash.tune.postproc import PreCheck
from tvmflash.tune.space import candidate_problem, space_fn, structures, task_knobs
from tvmflash.tune.task import specialize


def test_pre_check_postprocessor_rejects_before_building():
    """PreCheck (a MetaSchedule postprocessor) returns False for a candidate whose knobs
    candidate_problem rejects, so the search samples another instead of building it."""
    from tvm.s_tir import meta_schedule as ms

    spec = program.AttentionSpec(32, "float32", False, 1, 1)
    mod = tvm.IRModule({"main": specialize(program_forward.attention_forward(spec, 16, 32), spec, batch=1,
                                                seqlen_q=32, seqlen_k=32, softmax_scale=0.2)})
    fixed, sampled = task_knobs({"block_m": [16], "block_n": [32], "vector": [4, 8]}, 16, 32)
    stats = {}
    check = PreCheck(lambda knobs: "too wide" if knobs["vector"] == 8 else None, fixed, sampled, [{}], stats)
    assert isinstance(check, ms.postproc.Postproc)
    sch = tvm.s_tir.Schedule(mod)
    space_fn(cpu.SCHEDULE, fixed, sampled)(sch)
    (inst,) = [i for i in sch.trace.insts if i.kind.name == "SampleCategorical"]
    verdicts = []
    for decision in (0, 1):
        replayed = tvm.s_tir.Schedule(mod)
        sch.trace.with_decision(inst, decision, remove_postproc=True).apply_to_schedule(replayed, remove_postproc=True)
        verdicts.append(check.apply(replayed))
    assert verdicts == [True, False] and stats == {"rejected": 1}
    # sm90: what fails to build is a problem before building
    sm90_target, forward90 = targets.cuda_target("sm90"), sm90.SCHEDULE.forward.knobs
    assert "64 registers" in candidate_problem(forward90, sm90_target, 128, "bfloat16",
                                               {"block_m": 256, "num_warpgroups": 4, "min_blocks_per_sm": 2})
    assert "1024-byte" in candidate_problem(forward90, sm90_target, 128, "bfloat16", {
        "block_m": 64, "num_warpgroups": 1, "kv_copy": "cp.async", "num_stages": 2})
    assert "shared memory" in candidate_problem(sm80.SCHEDULE.forward.knobs, targets.cuda_target("sm80"), 128,
                                                "bfloat16", {"block_m": 128, "num_warps": 4, "block_n": 128,
                                                             "num_stages": 2})
    assert candidate_problem(forward90, sm90_target, 128, "bfloat16", {}) is None  # the defaults


@pytest.mark.parametrize("schedule,head_dim,block_m,block_n", [
    (sm90.SCHEDULE, 128, 128, 64), (sm80.SCHEDULE, 128, 128, 64)], ids=["sm90-d128-bm128", "sm80-d128-bm128"])
def test_pre_check_accepts_exactly_the_candidates_that_build(schedule, head_dim, block_m, block_n):
    """Every structure of a task of the space, built for its GPU (cross-compiled: no GPU here): the
    pre-check (candidate_problem) accepts exactly the ones that build. (MisalignedTiles was most
    of the failed candidates on the H200: swizzled tiles without TMA off the 1024-byte boundary.)"""
    target = targets.cuda_target(schedule.name)
    spec = program.AttentionSpec(head_dim, "bfloat16", True, 2, 2)
    point = {"block_m": block_m, "block_n": block_n,
             **({"min_blocks_per_sm": 2} if schedule is sm90.SCHEDULE else {})}
    space = schedule.forward.knobs.space()
    options = structures(schedule, space, point)
    fixed, sampled = task_knobs(space, **point, structure_names=list(options[0]))
    plain = {**schedule.forward.knobs.defaults(), **fixed}
    from tvmflash import schedules as registry
    mod = tvm.IRModule({"main": specialize(registry.program_for(spec, schedule, plain), spec, batch=1,
                                                seqlen_q=512, seqlen_k=512, softmax_scale=0.1)})
    outcomes = []
    for structure in options:
        problem = candidate_problem(schedule.forward.knobs, target, head_dim, "bfloat16", {**plain, **structure})
        sch = tvm.s_tir.Schedule(mod)
        try:
            space_fn(schedule, fixed, sampled, [structure])(sch)
            ms_build(sch.mod, target, None, **schedule.build_options("forward"))
            error = None
        except Exception as err:  # noqa: BLE001 - any failure to schedule or build
            error = f"{type(err).__name__}: {str(err).splitlines()[-1] if str(err) else ''}"
        outcomes.append((problem is None, error is None))
        assert (problem is None) == (error is None), (structure, problem, error)
    assert any(built for _, built in outcomes)
    if (schedule, block_m) == (sm90.SCHEDULE, 64):
        assert not all(built for _, built in outcomes)  # the check has failures to predict here


def test_sm90_register_floor_follows_the_widest_wgmma():
    """One wgmma of m64nN holds N/2 fp32 accumulators a thread: at d256 ptxas wanted 158 registers
    for P V and aborted the build at 128 (2 blocks of 256 threads, or one of 512). The pre-check
    rejects those before building; d128 at 128 registers still builds."""
    forward = sm90.SCHEDULE.forward.knobs
    base = forward.defaults(256)
    for knobs in ({"min_blocks_per_sm": 2}, {"block_m": 256, "num_warpgroups": 4}):
        problem = forward.problem({**base, **knobs}, 256, "bfloat16")
        assert problem is not None and "leave 128 registers" in problem and "need 158" in problem, problem
    assert forward.problem(base, 256, "bfloat16") is None
    assert forward.problem({**forward.defaults(), "min_blocks_per_sm": 2}, 128, "bfloat16") is None
    with pytest.raises(ValueError, match="need 158"):
        tvmflash.compile(head_dim=256, dtype="bfloat16", target="sm90", knobs={"min_blocks_per_sm": 2}).module(2, 2)


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("head_dim,builds", [(256, False), (128, True)], ids=["d256-aborts", "d128-builds"])
def test_sm90_register_floor_agrees_with_ptxas(head_dim, builds, monkeypatch):
    """Two blocks of 256 threads an SM (128 registers a thread), compiled by nvcc for sm_90a: ptxas
    aborts at d256 (P V's m64n256 wgmma) and builds d128, as ``sm90.knobs.register_problem`` says."""
    from tvm.support import nvcc

    knobs = {**sm90.SCHEDULE.forward.knobs.defaults(head_dim), "min_blocks_per_sm": 2}
    assert (sm90_knobs.register_problem(head_dim, knobs["block_n"], 256, 2) is None) == builds
    monkeypatch.setattr(sm90_knobs, "register_problem", lambda *_: None)  # schedule it anyway, for ptxas to judge
    spec = program.AttentionSpec(head_dim, "bfloat16", False, 2, 2)
    from tvmflash import schedules as registry
    func = specialize(registry.program_for(spec, sm90.SCHEDULE, knobs), spec, batch=1, seqlen_q=512, seqlen_k=512,
                      softmax_scale=0.1)
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    sm90.SCHEDULE.forward.apply(sch, **knobs)
    target = targets.cuda_target("sm90")

    def build_and_compile():  # where CUDA is installed, the build itself compiles (NVRTC), so ptxas may abort there
        source = ms_build(sch.mod, target, None, **sm90.SCHEDULE.build_options("forward")).imports[0].inspect_source()
        with target:
            nvcc.compile_cuda(source, target_format="cubin", arch="sm_90a", compiler="nvcc")

    if builds:
        build_and_compile()
        return
    with pytest.raises(Exception, match=r"Insufficient registers \(128\)"):
        build_and_compile()
