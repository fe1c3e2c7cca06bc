"""The tools that tests, benchmarks and the tuner judge by: the GPU suite's order (tests/gpu_test_times.txt,
the longest first), benchmarks/gpu_tests.py's record of their seconds, and ``tvmflash.bench``'s error rule."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import GPU_TEST_TIMES, longest_first, recorded_seconds
from reference import reference_gradients

from tvmflash import bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_tests  # noqa: E402


def test_the_recorded_gpu_seconds_read_back():
    seconds = recorded_seconds(GPU_TEST_TIMES)
    assert len(seconds) > 100 and all(t.startswith("tests/") and "::" in t for t in seconds)
    assert all(s >= 0 for s in seconds.values())
    assert recorded_seconds("/nonexistent/times.txt") == {}


def test_gpu_tests_start_longest_first_and_unlisted_ones_before_all():
    def item(nodeid, gpu=True):
        return SimpleNamespace(nodeid=nodeid, keywords={"gpu": True} if gpu else {})

    items = [item("a"), item("cpu1", gpu=False), item("b"), item("new"), item("c"), item("cpu2", gpu=False)]
    longest_first(items, {"a": 1.0, "b": 30.0, "c": 7.5})
    assert [i.nodeid for i in items] == ["new", "b", "c", "a", "cpu1", "cpu2"]


def test_saved_times_merge_the_run_over_the_record(tmp_path):
    def line(seconds, test):
        return f"{seconds:8.1f} s   1 builds     0.5 s  {test}"

    saved, run = tmp_path / "saved.txt", tmp_path / "run.times"
    saved.write_text(f"{line(1.0, 'tests/a.py::x')}\n{line(2.0, 'tests/a.py::y[1, 2]')}\n")
    run.write_text(f"{line(5.0, 'tests/a.py::y[1, 2]')}\n{line(3.0, 'tests/b.py::z')}\n")
    gpu_tests.save_times(run, saved)
    assert recorded_seconds(str(saved)) == {"tests/a.py::y[1, 2]": 5.0, "tests/b.py::z": 3.0, "tests/a.py::x": 1.0}
    assert [float(l.split()[0]) for l in saved.read_text().splitlines()] == [5.0, 3.0, 1.0]


def test_outcomes_are_read_with_ids_that_hold_spaces():
    log = ("tests/a.py::t[64-(8, 2)] \n[gw4] [ 16%] PASSED tests/a.py::t[64-(8, 2)] \n"
           "[gw1] [100%] FAILED tests/b.py::u[x] \n")
    assert dict((t, o) for o, t in gpu_tests.OUTCOME.findall(log)) == {"tests/a.py::t[64-(8, 2)]": "PASSED",
                                                                       "tests/b.py::u[x]": "FAILED"}


def test_sticky_cuda_errors_are_told_from_others():
    """The errors after which a GPU worker ends (conftest): CUDA's that leave the context unusable, not a test's
    own assertion or an out-of-memory error, which later tests survive."""
    from conftest import is_sticky_cuda_error

    assert is_sticky_cuda_error("torch.AcceleratorError: CUDA error: misaligned address\nSearch for ...")
    assert is_sticky_cuda_error("RuntimeError: CUDA error: an illegal memory access was encountered")
    assert not is_sticky_cuda_error("AssertionError: (0.336, 0.124)")
    assert not is_sticky_cuda_error("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not is_sticky_cuda_error("a test's own message: misaligned address")


def test_sticky_cuda_errors_are_told_from_tvms_launch():
    """TVM's calls after an earlier kernel's fault: its launch names the error by its driver name, its runtime
    calls by CUDA's words after 'CUDA Runtime Error'."""
    from conftest import is_sticky_cuda_error

    assert is_sticky_cuda_error("tvm.error.InternalError: CUDALaunch Error: CUDA_ERROR_MISALIGNED_ADDRESS\n"
                                " grid=(4,2,1)")
    assert is_sticky_cuda_error("CUDALaunch Error: CUDA_ERROR_ILLEGAL_ADDRESS\n grid=(1,1,1),  block=(128,1,1)")
    assert not is_sticky_cuda_error("CUDALaunch Error: CUDA_ERROR_INVALID_VALUE\n grid=(2048,1,1)")
    assert not is_sticky_cuda_error("CUDALaunch Error: CUDA_ERROR_OUT_OF_MEMORY")
    assert is_sticky_cuda_error("RuntimeError: CUDA Runtime Error: an illegal memory access was encountered")


def test_every_gpu_test_may_end_its_worker():
    """A run of the GPU suite restarts a worker as often as it has tests (conftest ends a worker after a sticky CUDA
    error): past pytest-xdist's default, 4 a worker, it would stop the run and leave the queued tests unrun."""
    command = gpu_tests.pytest_command(16, 900, ["-k", "fp8"])
    assert command[command.index("--max-worker-restart") + 1] == "900"
    assert command[command.index("-n") + 1] == "16" and command[-2:] == ["-k", "fp8"]
    # the GPU tests alone unless asked: the nvcc tests need nvcc and no GPU
    marks = command.index("-m", command.index("pytest")) + 1
    assert command[marks] == "gpu" and gpu_tests.pytest_command(16, 9, [], "gpu or nvcc")[marks] == "gpu or nvcc"


@pytest.mark.parametrize("causal", [False, True])
def test_the_rules_float32_attention_is_sdpas(causal):
    q, k, v = (torch.randn(2, n, 3, 16, dtype=torch.float64) for n in (5, 9, 9))  # seqlen_q < seqlen_k: bottom-right
    ours = bench.attention_in(torch.float64, q, k, v, causal)
    mask = torch.ones(5, 9, dtype=torch.bool).tril(9 - 5) if causal else None
    sdpa = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(ours, sdpa)


def test_the_gradient_rule_takes_bfloat16_attention_as_its_baseline():
    """flash-attn's rule: 2x the error of torch's attention in bf16 (products and softmax rounded to bf16),
    not of SDPA's math backend, which computes bf16 in float32 and would set a baseline several times
    tighter. The float64 reference's own gradients pass; the same ones off by a few times the allowance fail."""
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(2, 64, 2, 32, dtype=torch.bfloat16) for _ in range(4))
    exact = reference_gradients(q, k, v, dout)
    checked = bench.gradient_errors_vs_float32([g.to(torch.bfloat16) for g in exact], q, k, v, dout, causal=False)
    assert all(err <= allowed for err, allowed in checked)
    same = [t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    bf16_errors = [allowed for _, allowed in checked]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in same)).transpose(1, 2)
    math = torch.autograd.grad(out, same, dout)
    math_errors = bench.gradient_errors_vs_float32(math, q, k, v, dout, causal=False)
    assert all(2 * err < allowed for (err, _), allowed in zip(math_errors, bf16_errors))
    off = [g.to(torch.bfloat16) + 3 * allowed for g, allowed in zip(exact, bf16_errors)]
    assert all(err > allowed for err, allowed in bench.gradient_errors_vs_float32(off, q, k, v, dout, causal=False))
