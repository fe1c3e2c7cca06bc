"""CUDA builds on a machine with no GPU: the generated source, and (where nvcc exists) its cubin."""

import shutil

import pytest
import tvm

import tvmflash


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_source_builds(arch, dtype):
    kernel = tvmflash.compile(head_dim=128, dtype=dtype, causal=True, target=arch)
    src = kernel.source(heads_q=8, heads_kv=2)
    assert '__global__ void' in src and "__shared__" in src
    assert kernel.info()["target"] == {"sm80": "cuda sm_80", "sm90": "cuda sm_90a"}[arch]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm80", "sm90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_cuda_source_compiles_with_nvcc(arch, dtype):
    from tvm.support import nvcc

    kernel = tvmflash.compile(head_dim=64, dtype=dtype, target=arch)
    with kernel.target:
        cubin = nvcc.compile_cuda(kernel.source(heads_q=4, heads_kv=4), target_format="cubin",
                                  arch=str(kernel.target.attrs["arch"]), compiler="nvcc")
    assert len(cubin) > 1000


def test_target_forms():
    for target in ["sm90", {"kind": "cuda", "arch": "sm_90a"}, tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})]:
        kernel = tvmflash.compile(head_dim=64, dtype="float16", target=target)
        assert kernel.info()["target"] == "cuda sm_90a"
