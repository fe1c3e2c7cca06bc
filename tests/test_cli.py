"""The tvmflash command line, run as a user would."""

import re
import subprocess
import sys

import pytest


def tvmflash(*args):
    done = subprocess.run([sys.executable, "-m", "tvmflash.cli", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_info():
    out = tvmflash("info")
    assert "TVM 0.27" in out and "cache dir:" in out and "default target:" in out


def test_compile_emits_cuda(tmp_path):
    path = tmp_path / "out.cu"
    tvmflash("compile", "--target", "sm90", "--head-dim", "128", "--dtype", "bfloat16", "--causal",
             "--emit", "cuda", "-o", str(path))
    assert "__global__" in path.read_text()


def test_compile_emits_tir():
    assert "T.sblock" in tvmflash("compile", "--target", "cpu", "--head-dim", "64", "--emit", "tir")


def test_bench_on_cpu():
    out = tvmflash("bench", "--device", "cpu", "--head-dim", "64", "--causal", "yes", "--seqlens", "128",
                   "--tokens", "256", "--hidden", "128", "--repeat", "2")
    lines = [line for line in out.splitlines() if line.startswith("bfloat16 d64 causal")]
    assert len(lines) == 1 and lines[0].split()[-1] == "yes", out
    assert "kernel d64 causal: cpu schedule, " in out and "knobs {'block_m': " in out, out  # what ran


def test_bad_arguments_fail_cleanly():
    done = subprocess.run([sys.executable, "-m", "tvmflash.cli", "compile", "--head-dim", "80", "--target", "cpu"],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "head_dim: expected one of" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.gpu
def test_bench_on_gpu():
    out = tvmflash("bench", "--head-dim", "128", "--causal", "no", "--seqlens", "1024", "--repeat", "3")
    assert "sdpa-flash" in out
    host = re.search(r"host time a call, the GPU kept busy \(.*\): tvmflash (\d+) us, sdpa-flash (\d+) us", out)
    assert host and all(0 < int(us) < 10_000 for us in host.groups())
