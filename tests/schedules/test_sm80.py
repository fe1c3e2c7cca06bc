"""The sm80 schedule (``schedules/sm80/``: mma.sync and ldmatrix), cross-compiled: no GPU needed."""

import shutil

import pytest
import tvm

import tvmflash


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tensor_core_schedule_emits_mma_and_ldmatrix(monkeypatch, arch, dtype):
    monkeypatch.setenv("TVMFLASH_SM90", "0")  # the sm80 schedule, also on sm_90a
    kernel = tvmflash.compile(head_dim=64, dtype=dtype, target=arch)
    src = kernel.source(heads_q=4, heads_kv=2)  # (heads of test_generated_cuda: its modules)
    assert kernel.info()["schedule"] == "sm80"
    ptx_type = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32" in src
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in src
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in src  # V, transposed on load
    # The softmax runs on the fragments: rows reduced across each quad of lanes by shuffles, and
    # P handed to the PV mma from registers (ldmatrix loads Q, K and V only: 3 call sites in the
    # K/V step; Q fragments are re-read from shared memory each step, as in FA2). The
    # cp.async pipeline (num_stages > 1) repeats the K/V step's compute once in its epilogue.
    copies = 1 if kernel.knobs["num_stages"] == 1 else 2
    assert src.count("__shfl_xor_sync(__activemask()") == 2 * copies  # row max, row sum
    assert src.count('"ldmatrix.sync.aligned') == 3 * copies


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("num_stages", [2, 3])
def test_sm80_pipelined_kv_loads_use_cp_async(num_stages):
    """num_stages > 1: K/V tiles are copied with cp.async, num_stages - 1 tiles ahead, into
    num_stages shared buffers; the source compiles for sm_80 and sm_90a."""
    from tvm.support import nvcc

    kernel = tvmflash.compile(head_dim=64, dtype="bfloat16", causal=True, target="sm80",
                              knobs={"num_stages": num_stages})
    src = kernel.source(heads_q=4, heads_kv=2)
    assert "cp.async.cg.shared.global" in src and "cp.async.commit_group" in src
    # At the top of the steady-state loop, before the step's own copies are issued: wait until all
    # but the num_stages - 2 newest copies are done (cp_async_barriers.OneBarrierPerPipelinedStep).
    assert f"cp.async.wait_group {num_stages - 2};" in src
    assert ("& 1)" if num_stages == 2 else "% 3)") in src  # the buffer version of a K/V tile
    for arch in ("sm_80", "sm_90a"):
        with tvm.target.Target({"kind": "cuda", "arch": arch}):
            cubin = nvcc.compile_cuda(src, target_format="cubin", arch=arch, compiler="nvcc")
        assert len(cubin) > 1000


def test_sm80_rejects_unknown_num_stages():
    with pytest.raises(ValueError, match="num_stages"):
        tvmflash.compile(head_dim=64, dtype="float16", target="sm80", knobs={"num_stages": 4}).source(1, 1)


def test_knobs_fit_the_targets_shared_memory():
    """sm86 allows 99 KiB of shared memory a block: the default two-stage K/V pipeline at d128
    needs more, so compile() drops to one stage (and says so); knobs the caller gives that do not
    fit are a clear error, not a failed launch."""
    kernel = tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm86")
    assert kernel.knobs["num_stages"] == 1 and "shrunk to fit shared memory" in kernel.info()["knobs_source"]
    assert tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm80").knobs["num_stages"] == 2  # 163 KiB
    with pytest.raises(ValueError, match="KiB of shared memory, cuda sm_86 allows 99 KiB"):
        tvmflash.compile(head_dim=128, dtype="bfloat16", target="sm86", knobs={"num_stages": 3})
