"""The builder (tvmflash/tune/builder.py): Kernel's build for every kind of candidate, and the
one-configuration tasks built ahead at once."""

import shutil

import pytest
import tvm

from tvmflash import program, program_forward, tune
from tvmflash import target as targets
from tvmflash.schedules import cpu, simt, sm80, sm90
from tvmflash.tune.builder import ms_build
from tvmflash.tune.space import space_fn, task_knobs
from tvmflash.tune.task import specialize

CPU = targets.cpu_target()


def test_builds_use_the_schedules_pass_config():
    """The tuner's builder is Kernel's build (PassContext config + workarounds), returning a runtime module."""
    spec = program.AttentionSpec(32, "float32", False, 1, 1)
    func = specialize(program_forward.attention_forward(spec, 16, 32), spec, batch=1, seqlen_q=40, seqlen_k=40,
                           softmax_scale=0.2)
    sch = cpu.SCHEDULE.forward.apply(tvm.s_tir.Schedule(tvm.IRModule({"main": func})), block_m=16, block_n=32, vector=8)
    built = ms_build(sch.mod, CPU, None, pass_config={})
    assert isinstance(built, tvm.runtime.Module) and built.implements_function("main")


def test_cuda_spaces_cross_compile():
    """Every sampled vector width of the SIMT space, and the sm80 tasks, build through the tuner's
    builder for their GPU (source only: no GPU here). The GPU runs are tuned on the GPU itself."""
    spec = program.AttentionSpec(128, "bfloat16", True, 2, 1)

    def static(block_m, block_n):
        func = program_forward.attention_forward(spec, block_m, block_n)
        return tvm.IRModule({"main": specialize(func, spec, batch=2, seqlen_q=1000, seqlen_k=1000,
                                                     softmax_scale=0.1)})

    mod = static(64, 32)
    fixed, sampled = task_knobs(simt.SCHEDULE.forward.knobs.space(), 64, 32)
    sch = tvm.s_tir.Schedule(mod)
    space_fn(simt.SCHEDULE, fixed, sampled)(sch)
    (inst,) = [i for i in sch.trace.insts if i.kind.name == "SampleCategorical"]
    sources = set()
    for decision in range(len(sampled["vector_bytes"])):
        replayed = tvm.s_tir.Schedule(mod)
        sch.trace.with_decision(inst, decision, remove_postproc=True).apply_to_schedule(replayed, remove_postproc=True)
        built = ms_build(replayed.mod, targets.cuda_target("sm80"), None, pass_config={})
        sources.add(built.imports[0].inspect_source())
    assert len(sources) == len(sampled["vector_bytes"])  # each width is its own kernel

    for block_m, block_n, num_stages in ((64, 32, 1), (128, 64, 2)):
        fixed, sampled = task_knobs(sm80.SCHEDULE.forward.knobs.space(), block_m, block_n, num_stages=num_stages)
        sch = tvm.s_tir.Schedule(static(block_m, block_n))
        space_fn(sm80.SCHEDULE, fixed, sampled)(sch)
        built = ms_build(sch.mod, targets.cuda_target("sm80"), None, **sm80.SCHEDULE.build_options("forward"))
        assert "mma.sync" in built.imports[0].inspect_source()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("schedule,block_m,causal,kv_copy", [
    (sm80.SCHEDULE, 128, False, None), (sm80.SCHEDULE, 64, True, None), (sm90.SCHEDULE, 64, False, "cp.async"),
    (sm90.SCHEDULE, 64, True, "tma")],
    ids=["sm80-bm128-full", "sm80-bm64-causal", "sm90-bm64-full", "sm90-bm64-causal-tma"])
def test_pipelined_candidates_build_with_static_shapes(schedule, block_m, causal, kv_copy):
    """The tuner builds static shapes. TVM bugs made every num_stages 2 candidate fail there:
    InjectSoftwarePipeline guards each statement of the K/V step apart, which split a local
    buffer's allocation in an intrinsic (a row reduction's scratch, a wgmma descriptor) from its
    uses; and a cp.async.wait_group count was left as ``if_then_else(True & True, 1, 0)`` (causal,
    block_m 64). The TMA lowering (tvmflash.lowering.tma_copies) must take the static-shape pipeline too; there, at
    block_m 64, shared-memory merging put the K/V tiles off the swizzle's 1024-byte boundary until the
    build learned to grow the barriers (``annotations.TMA_BARRIER_PADDINGS``)."""
    spec = program.AttentionSpec(64, "bfloat16", causal, 2, 2)
    mod = tvm.IRModule({"main": specialize(program_forward.attention_forward(spec, block_m, 64), spec, batch=1,
                                                seqlen_q=512, seqlen_k=512, softmax_scale=0.125)})
    # cp.async copies into the swizzled layout have no barriers to pad, and at block_m 64 merging
    # puts those tiles off the 1024-byte boundary: that build fails loudly (below), so here cp.async
    # copies into core matrices.
    layout = "swizzled" if kv_copy == "tma" else "core_matrices"
    task = {"num_stages": 2, **({"min_blocks_per_sm": 2, "kv_layout": layout, "kv_copy": kv_copy, "producer": "thread",
                                 "q_layout": "core_matrices", "q_copy": "threads", "o_store": "staged", "overlap": 0}
                                if schedule is sm90.SCHEDULE else {})}  # the task knobs

    def build(task):
        fixed, sampled = task_knobs(schedule.forward.knobs.space(), block_m, 64, **task)
        sch = tvm.s_tir.Schedule(mod)
        space_fn(schedule, fixed, sampled)(sch)
        return ms_build(sch.mod, targets.cuda_target(schedule.name), None, **options)

    options = schedule.build_options("forward")
    if kv_copy == "cp.async":
        from tvmflash.lowering import tile_alignment
        with pytest.raises(tile_alignment.MisalignedTiles, match="swizzled wgmma operand"):
            build({**task, "kv_layout": "swizzled"})
    built = build(task)
    source = built.imports[0].inspect_source()
    if kv_copy == "tma":
        assert "cp.async.bulk.tensor.5d" in source and "cp.async.wait_group" not in source
        return
    wait = "cp.async.wait_group 0;" + ("\\n\\tfence.proxy.async" if options["async_proxy_operands"] else "")
    assert wait in source


def test_one_configuration_tasks_are_built_at_once(records_dir):
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
