"""Decode's schedules (tvmflash.flash_attn_with_kvcache): the SIMT and sm80 tensor-core CUDA built here
(with nvcc, no spills), the schedule choice, and on a GPU each schedule and knob set against float64, other
head_dims and dtypes, CUDA graph replays with new lengths, and no rebuild a step. The numerics on every
device and the bad input: tests/test_decode.py."""

import math
import shutil

import pytest
import torch
from conftest import captured_in_a_cuda_graph, ptxas_report
from test_decode import check_decode, make_cache, poisoned, random_q, sequence_kv

import tvmflash
from tvmflash import lowering

# ------------------------------------------------------------------------------------------------
# CUDA: the SIMT schedule's source here; numerics and CUDA graphs on a GPU
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size,knobs", [(0, None), (16, {"num_stages": 1}), (256, {"block_n": 128, "threads": 128}),
                                             (0, {"row_max": "shuffle", "unroll": 0})],
                         ids=["contiguous", "paged16-one-stage", "paged256-four-warps", "shuffle-max-rolled"])
def test_cuda_decode_source_builds(page_size, knobs):
    """The SIMT decode builds to CUDA here (no GPU needed): the split kernel copies K/V 16 bytes at a
    time into padded shared rows (cp.async in a pipeline by default, plain vector loads with one
    stage), reduces the row max with warp shuffles, and the merge kernel is there; with nvcc, the
    split kernel compiles with no stack frame (no per-row value in local memory) and no spill."""
    kernel = tvmflash.compile_decode(head_dim=128, dtype="bfloat16", page_size=page_size, target="sm90", knobs=knobs,
                                     schedule="simt")
    src = kernel.source(heads_q=32, heads_kv=8)
    assert "split_kernel" in src and "merge_kernel" in src and "single_kernel" in src
    if kernel.knobs["num_stages"] > 1:
        assert "cp.async.cg.shared.global" in src and "cp.async.wait_group 0" in src
    else:
        assert "*(uint4*)(K_ptr" in src and "*(uint4*)(V_ptr" in src and "cp.async" not in src
    assert "__shfl_down_sync" in src
    assert "* 136)" in src or "* 17)" in src  # K/V shared rows padded to 128 + 8 elements (17 uint4s)
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    report = ptxas_report(src, "sm_90a")
    assert "0 bytes stack frame, 0 bytes spill stores" in report["split_kernel"], report["split_kernel"]


@pytest.mark.parametrize("page_size,knobs,heads", [(0, None, (32, 8)), (16, {"num_stages": 1}, (8, 1)),
                                                   (256, {"block_n": 32, "num_stages": 4}, (12, 2))],
                         ids=["contiguous-group4", "paged16-one-stage-group8", "paged256-four-stages-group6"])
def test_sm80_decode_source_builds(page_size, knobs, heads):
    """The tensor-core decode (the default on sm80+ GPUs for fp16/bf16) builds to CUDA here: Q Kᵀ and
    P V are ldmatrix + mma.sync, the K/V tiles are cp.async copies in a pipeline (plain vector loads
    with one stage), and a task's rows fill whole 16-row tiles: 32/8 heads take 4 query tokens a task
    (one warp), 8/1 two, and 12/2 (a group of 6) eight, in three warps."""
    kernel = tvmflash.compile_decode(head_dim=128, dtype="bfloat16", page_size=page_size, target="sm90", knobs=knobs)
    assert kernel.schedule.name == "sm80" and kernel.tensor_cores
    group = heads[0] // heads[1]
    assert kernel.query_tokens(group) * group == {4: 16, 8: 16, 6: 48}[group]
    src = kernel.source(*heads)
    assert "split_kernel" in src and "merge_kernel" in src and "single_kernel" in src
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in src and "ldmatrix.sync.aligned" in src
    warps = group * kernel.query_tokens(group) // 16
    assert f"__launch_bounds__({32 * warps}) split_kernel" in src
    if kernel.knobs["num_stages"] > 1:
        assert "cp.async.cg.shared.global" in src
    else:
        assert "cp.async" not in src
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    report = ptxas_report(src, "sm_90a")
    for name in ("single_kernel", "split_kernel") if knobs is None else ("single_kernel",):
        assert "0 bytes stack frame, 0 bytes spill stores" in report[name], report[name]


def test_sm80_decode_rejects_16_key_tiles():
    """block_n 16 builds, but on the H200 it returned wrong results (``sm80.knobs.decode_build_problem``): it
    is refused with the reason, never run."""
    with pytest.raises(ValueError, match="block_n .16. of 32"):
        tvmflash.compile_decode(head_dim=128, dtype="bfloat16", target="sm90", knobs={"block_n": 16})


def test_decode_schedule_choice(monkeypatch):
    """sm80's tensor cores on sm80+ targets for fp16/bf16; SIMT for float32, older GPUs, or when asked
    (the argument, or TVMFLASH_DECODE)."""
    def chosen(**kwargs):
        return tvmflash.compile_decode(head_dim=64, **kwargs).schedule.name

    assert chosen(dtype="float16", target="sm80") == "sm80"
    assert chosen(dtype="bfloat16", target="sm90", schedule="simt") == "simt"
    assert chosen(dtype="float32", target="sm90") == "simt"
    assert chosen(dtype="float32", target="cpu") == "cpu"
    with pytest.raises(ValueError, match=r"schedule 'sm80' \(given\): the sm80 schedule takes \['float16', 'bfloat16'\]"):
        chosen(dtype="float32", target="sm90", schedule="sm80")
    with pytest.raises(ValueError, match="expected one of"):
        chosen(dtype="float16", target="sm90", schedule="wgmma")
    monkeypatch.setenv("TVMFLASH_DECODE", "simt")
    assert chosen(dtype="float16", target="sm80") == "simt"
    assert chosen(dtype="float16", target="sm80", schedule="sm80") == "sm80"


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["sm80", "simt"])
@pytest.mark.parametrize("page_size", [0, 16, 256], ids=["contiguous", "paged16", "paged256"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_on_the_gpu(dtype, page_size, schedule, monkeypatch):
    """GQA 32/8 or 8/1 at head_dim 128 on the GPU (each layout, dtype and schedule meets both ratios over
    the cases: a head count is a module of its own, and each build is a sizeable share of the GPU suite's
    time), with either schedule (TVMFLASH_DECODE): decode and a causal chunk, ragged lengths (0 and the
    full cache), automatic and given split counts, against float64."""
    monkeypatch.setenv("TVMFLASH_DECODE", schedule)
    capacity = 1000
    lengths = torch.tensor([0, 1, 129, 555, capacity], dtype=torch.int32)
    batch = len(lengths)
    both = [(32, 8), (8, 1)]
    for heads_q, heads_kv in [both[(page_size == 16) ^ (dtype == torch.bfloat16)]]:
        k_cache, v_cache, table = make_cache(batch, capacity, heads_kv, 128, dtype, "cuda", page_size)
        for seqlen_q, causal in [(1, False), (4, True)]:
            q = random_q(batch, seqlen_q, heads_q, 128, dtype, "cuda")
            results = [tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths.cuda(),
                                                        block_table=table, causal=causal, num_splits=num_splits,
                                                        return_softmax_lse=True) for num_splits in (0, 1, 5)]
            check_decode(*results[0], q, k_cache, v_cache, lengths, causal=causal, block_table=table, more=results[1:])


# Knob sets of the decode schedules worth timing (benchmarks/decode_bench.py --knobs; "schedule" picks
# one, as there): each must be right before its time counts.
SIMT_KNOB_SETS = [{}, {"num_stages": 1}, {"num_stages": 3}, {"threads": 32, "block_n": 64},
                  {"threads": 64, "block_n": 64}, {"threads": 128, "block_n": 128},
                  {"threads": 128, "block_n": 128, "num_stages": 1}, {"threads": 128, "block_n": 128, "row_max": "shuffle"},
                  {"row_max": "shuffle", "unroll": 0}, {"unroll": 0}, {"row_max": "shuffle"},
                  {"query_tokens": 2}]
GPU_KNOB_SETS = ([{"schedule": "simt", **knobs} for knobs in SIMT_KNOB_SETS]
                 + [{"num_stages": 1}, {"block_n": 64, "num_stages": 2}, {"block_n": 64, "num_stages": 3},
                    {"num_stages": 4}, {"block_n": 128, "num_stages": 2}])


def knob_set(knobs: dict) -> dict:
    """compile_decode's arguments for a knob set (its "schedule" key apart)."""
    knobs = dict(knobs)
    schedule = knobs.pop("schedule", None)
    return {"knobs": knobs or None, "schedule": schedule}


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", GPU_KNOB_SETS, ids=lambda k: "-".join(f"{n}{v}" for n, v in k.items()) or "defaults")
def test_decode_knob_sets_on_the_gpu(knobs):
    """Each knob set the benchmark compares, on a contiguous cache or a paged one (16; by turns along the
    list: each layout is a build of its own, and test_decode_on_the_gpu meets both with the defaults), on
    decode and a causal chunk of 5 tokens, one split and several, against float64."""
    capacity, dtype = 700, torch.bfloat16
    lengths = torch.tensor([0, 33, 400, capacity], dtype=torch.int32)
    for page_size in [(0, 16)[GPU_KNOB_SETS.index(knobs) % 2]]:
        kernel = tvmflash.compile_decode(head_dim=128, dtype=dtype, page_size=page_size, **knob_set(knobs))
        k_cache, v_cache, table = make_cache(len(lengths), capacity, 8, 128, dtype, "cuda", page_size)
        index = table if page_size else kernel.batch_rows(len(lengths), torch.device("cuda"))
        for seqlen_q, causal in [(1, False), (5, True)]:
            q = random_q(len(lengths), seqlen_q, 32, 128, dtype, "cuda")
            results = [kernel(q, k_cache, v_cache, lengths.cuda(), index, num_splits=n, causal=causal, out=poisoned(q))
                       for n in (1, 4)]
            check_decode(*results[0], q, k_cache, v_cache, lengths, causal=causal, block_table=table, more=results[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,dtype,heads", [(64, torch.bfloat16, (8, 2)), (256, torch.float16, (8, 2)),
                                                  (96, torch.float16, (4, 4)), (32, torch.bfloat16, (8, 1)),
                                                  (128, torch.float32, (64, 8))], ids=str)
def test_other_head_dims_and_dtypes_on_the_gpu(head_dim, dtype, heads):
    capacity = 300
    lengths = torch.tensor([300, 1, 129], dtype=torch.int32)
    k_cache, v_cache, table = make_cache(len(lengths), capacity, heads[1], head_dim, dtype, "cuda", page_size=32)
    q = random_q(len(lengths), 2, heads[0], head_dim, dtype, "cuda")
    results = [tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths.cuda(), block_table=table,
                                                causal=True, num_splits=n, return_softmax_lse=True) for n in (0, 3)]
    check_decode(*results[0], q, k_cache, v_cache, lengths, causal=True, block_table=table, more=results[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [0, 64], ids=["contiguous", "paged64"])
def test_cuda_graph_replays_with_new_lengths(page_size):
    """A decode step (append one token's k/v, attend) captured once in a CUDA graph, replayed as
    cache_seqlens moves on (in place, ragged, and back to 0): each replay matches the reference over
    the cache as it then is."""
    dtype, batch, capacity, heads_q, heads_kv = torch.bfloat16, 3, 700, 32, 8
    k_cache, v_cache, table = make_cache(batch, capacity, heads_kv, 128, dtype, "cuda", page_size)
    cache_seqlens = torch.tensor([0, 100, 200], dtype=torch.int32, device="cuda")
    q = random_q(batch, 1, heads_q, 128, dtype, "cuda")
    k_new, v_new = (random_q(batch, 1, heads_kv, 128, dtype, "cuda", seed=s) for s in (3, 4))

    def step():
        return tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                block_table=table, return_softmax_lse=True)

    graph, (out, lse) = captured_in_a_cuda_graph(step)
    for lengths in ([1, 2, 3], [5, 300, 698], [699, 0, 64]):
        cache_seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(random_q(batch, 1, heads_q, 128, dtype, "cuda", seed=sum(lengths)))
        k_new.copy_(random_q(batch, 1, heads_kv, 128, dtype, "cuda", seed=sum(lengths) + 1))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for b, length in enumerate(lengths):  # the appended token is in the cache
            assert torch.equal(sequence_kv(k_cache, v_cache, b, capacity, table)[0][0, length], k_new[b, 0])
        check_decode(out, lse, q, k_cache, v_cache, torch.tensor(lengths) + 1, causal=False, block_table=table)


@pytest.mark.gpu
def test_gpu_decode_never_rebuilds(monkeypatch):
    k_cache, v_cache, _ = make_cache(8, 4096, 8, 128, torch.bfloat16, "cuda")
    q = random_q(8, 1, 32, 128, torch.bfloat16, "cuda")
    tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5)
    monkeypatch.setattr(lowering, "build", lambda *a, **k: pytest.fail("a decode step built a module"))
    for length in (1, 4095, 4096, 17):
        lengths = torch.full((8,), length, dtype=torch.int32, device="cuda")
        out, lse = tvmflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, return_softmax_lse=True)
        check_decode(out, lse, q, k_cache, v_cache, lengths.cpu(), causal=False)
    assert math.isfinite(float(lse[0, 0, 0]))


def test_a_pipelined_loop_over_a_loaded_count_gets_it_bound_first():
    """lowering.loops_and_blocks.BindLoadedPipelineExtents: a loop marked for the software pipeline whose trip
    count is read from a buffer runs over a variable bound to that value; other loops stay as they
    are."""
    import tvm
    from tvm import tirx
    from tvm.script import tirx as T

    from tvmflash.lowering import loops_and_blocks

    @T.prim_func
    def loops(n: T.Buffer((1,), "int32"), a: T.Buffer((64,), "float32"), m: T.int32):
        for i in T.serial(n[0], annotations={"software_pipeline_stage": [0, 1]}):
            a[i] = T.float32(1)
        for j in T.serial(n[0]):
            a[j] = T.float32(2)
        for k in T.serial(m, annotations={"software_pipeline_stage": [0, 1]}):
            a[k] = T.float32(3)

    body = loops_and_blocks.BindLoadedPipelineExtents()(tvm.IRModule({"main": loops}))["main"].body
    stmts = list(body.seq)
    assert isinstance(stmts[0], tirx.Bind) and stmts[1].extent.same_as(stmts[0].var)
    def loads(expr):
        return type(expr).__name__ in ("TensorLoad", "BufferLoad") and expr.source.name == "n"

    assert loads(stmts[0].value) and str(stmts[1].loop_var) == "i"
    assert loads(stmts[2].extent) and str(stmts[3].extent) == "m"
