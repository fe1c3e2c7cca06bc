"""The row_state knob of sm80 and sm90: the per-row softmax state in registers on the quads
(default; no __syncthreads in the softmax) or in shared memory: the CUDA source, nvcc and, on an
sm_90a GPU, the sm90 forward with each."""

import re
import shutil

import pytest
import torch
import tvm
from conftest import SHAPES, kv_loop_body, poisoned_out, random_qkv
from reference import check_attention

import tvmflash


def test_row_state_rejects_unknown():
    with pytest.raises(ValueError, match="row_state"):
        tvmflash.compile(head_dim=64, dtype="float16", target="sm80", knobs={"row_state": "smem"}).source(1, 1)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_registers_row_state_has_no_softmax_barriers(head_dim):
    def source(row_state):
        return tvmflash.compile(head_dim=head_dim, dtype="bfloat16", target="sm80",
                                knobs={"row_state": row_state, "num_stages": 1}).source(heads_q=2, heads_kv=1)

    shared, regs = source("shared"), source("registers")
    assert kv_loop_body(shared).count("__syncthreads") >= 5
    # only the two barriers that guard the K/V shared tiles (before the loads, before the reads)
    assert kv_loop_body(regs).count("__syncthreads") <= 2
    assert "__shfl_xor_sync" in regs and "mma.sync" in regs


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_registers_row_state_has_no_softmax_barriers(monkeypatch, causal):
    monkeypatch.setenv("TVMFLASH_SM90", "1")

    def source(row_state):
        return tvmflash.compile(head_dim=128, dtype="bfloat16", causal=causal, target="sm90",
                                knobs={"row_state": row_state, "num_stages": 1, "kv_copy": "cp.async"}
                                ).source(heads_q=2, heads_kv=1)

    shared, regs = source("shared"), source("registers")
    assert kv_loop_body(shared).count("__syncthreads") >= 5
    # the barrier before the K/V loads and the one before the QK wgmma reads them
    assert kv_loop_body(regs).count("__syncthreads") == 2
    assert "wgmma" in regs and "_shared_ptr[" not in kv_loop_body(regs)  # no per-row value in shared memory


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("num_stages,causal", [(1, False), (2, True), (3, False)])
def test_registers_row_state_compiles_with_nvcc(num_stages, causal):
    from tvm.support import nvcc

    kernel = tvmflash.compile(head_dim=64, dtype="float16", causal=causal, target="sm80",
                              knobs={"row_state": "registers", "num_stages": num_stages})
    src = kernel.source(heads_q=4, heads_kv=2)
    if num_stages > 1:
        assert "cp.async.cg.shared.global" in src
    assert kv_loop_body(src).count("__syncthreads") <= 2
    for arch in ("sm_80", "sm_90a"):
        with tvm.target.Target({"kind": "cuda", "arch": arch}):
            cubin = nvcc.compile_cuda(src, target_format="cubin", arch=arch, compiler="nvcc")
        assert len(cubin) > 1000


def _ptxas_usage(src, arch="sm_90a"):
    """(registers, stack frame bytes, spill store bytes) that ptxas -v reports for the kernel."""
    from conftest import ptxas_report

    (out,) = ptxas_report(src, arch).values()  # the forward's one kernel
    stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", out)
    regs = re.search(r"Used (\d+) registers", out)
    return int(regs.group(1)), int(stack.group(1)), int(stack.group(2))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_registers_row_state_stays_in_registers(head_dim):
    """The per-row values are 4 statically indexed registers per lane, not local-memory arrays
    indexed by the lane (that was a ~1.1 KB stack frame)."""
    regs = tvmflash.compile(head_dim=head_dim, dtype="bfloat16", target="sm80",  # (test_generated_cuda's module)
                            knobs={"row_state": "registers"}).source(heads_q=4, heads_kv=2)
    for name in ("m", "l", "m_new", "alpha"):
        assert f"float {name}_local_ptr[4];" in regs
    assert not re.search(r"_local_ptr\[[^\]]*threadIdx", regs), "a per-row register array indexed by the lane"
    assert kv_loop_body(regs).count("__syncthreads") <= 2
    _, stack, spills = _ptxas_usage(regs)
    if head_dim == 64:
        assert stack == 0 and spills == 0
    else:
        # head_dim 128 runs at the 255-register cap in both modes: the 16 registers of per-row
        # state cost a few bytes of spills there (24 B stack measured), never the arrays themselves.
        assert stack <= 64


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("row_state", ["registers", "shared"])
def test_sm90_row_state_on_the_gpu(monkeypatch, row_state, causal):
    """The sm90 forward with either row state, over the edge shapes of SHAPES."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 schedule needs an sm_90a GPU")
    monkeypatch.setenv("TVMFLASH_SM90", "1")
    kernel = tvmflash.compile(head_dim=128, dtype=torch.bfloat16, causal=causal, knobs={"row_state": row_state})
    for seqlen_q, seqlen_k, heads_q, heads_kv in SHAPES:
        q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads_q, heads_kv, 128, torch.bfloat16, "cuda")
        out, lse = kernel(q, k, v, out=poisoned_out(q), return_lse=True)
        check_attention(out, lse, q, k, v, causal=causal)
