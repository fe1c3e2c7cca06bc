"""examples/flex_patterns.py and its catalogue (``tvmflash.flex_patterns``): every pattern traces, and the
example's float64 check and timing run on tiny sizes on the CPU (two patterns: a mask_mod with and without
its BlockMask beside the built-in causal, and the learnable bias table's gradient)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tvmflash import flex_patterns
from tvmflash.flex_trace import trace_mods

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "flex_patterns.py"


def load_example():
    spec = importlib.util.spec_from_file_location("flex_patterns_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", list(flex_patterns.PATTERNS))
def test_every_pattern_traces_to_one_module_at_every_length(name):
    """The mods trace, and the trace (what keys a module) does not change with the shape."""
    keys = set()
    for batch, seqlen in ((2, 64), (1, 300)):
        pattern = flex_patterns.make(name, batch, 4, seqlen, "cpu")
        assert (pattern.score_mod is None) != (pattern.mask_mod is None)
        mods, _ = trace_mods(pattern.score_mod, pattern.mask_mod)
        keys.add(repr(mods))
    assert len(keys) == 1


def test_the_share_of_pairs_a_mask_keeps():
    causal = flex_patterns.make("causal", 1, 1, 100, "cpu")
    assert causal.visible(1, 100, 100, "cpu") == pytest.approx(101 / 200)
    assert flex_patterns.make("softcap", 1, 1, 100, "cpu").visible(1, 100, 100, "cpu") == 1.0
    document = flex_patterns.make("document", 3, 1, 200, "cpu")
    assert 0 < document.visible(3, 200, 200, "cpu") < 101 / 200


def test_the_example_checks_and_times_on_the_cpu(tmp_path, capsys):
    """Its checks pass, it prints and writes a row each pattern, variant and pass, and the modules it builds
    first on a GPU (``builds``) are the ones its calls ran on."""
    from tvmflash import kernels

    example = load_example()
    out = tmp_path / "rows.json"
    argv = ["--device", "cpu", "--dtype", "float32", "--head-dim", "32", "--heads", "2", "--tokens", "64",
            "--seqlens", "64", "--patterns", "causal", "relative-bias", "--torch", "eager", "--repeat", "1"]
    kernels.forget_kernels()
    code = example.main(argv + ["--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "every pattern passed the float64 check" in printed
    assert printed.count("PASSED") == 3 and "FAILED" not in printed  # causal twice (mask_mod, BlockMask), the bias
    assert "dcaptured0" in printed  # the table's gradient was checked
    rows = json.loads(out.read_text())["rows"]
    assert {(r["pattern"], r["variant"], r["pass"]) for r in rows} == {
        (p, v, s) for p, v in (("causal", "mask_mod"), ("causal", "BlockMask"), ("relative-bias", "score_mod"))
        for s in ("forward", "forward+backward")}
    for row in rows:
        assert row["times_ms"]["tvmflash"] > 0 and row["check"]["passed"]
        assert ("built-in" in row["times_ms"]) == (row["pattern"] == "causal")
        assert ("torch" in row["times_ms"]) == (row["pass"] == "forward")  # torch's has no backward on the CPU
    causal = next(r for r in rows if r["pattern"] == "causal")
    assert causal["flops"] == pytest.approx(4 * 1 * 2 * 64 * 64 * 32 * 65 / 128)
    assert torch.isfinite(torch.tensor(causal["times_ms"]["built-in"]))
    builds = example.builds(example.parse_args(argv))
    assert len(builds) == 8  # causal: its mask_mod, its BlockMask, the built-in; the bias table; forward, backward
    for name, kwargs in builds:
        kwargs = {key: value for key, value in kwargs.items() if key not in ("heads_q", "heads_kv")}
        assert getattr(kernels, name)(**kwargs, target="cpu").build.modules, (name, kwargs)


@pytest.mark.gpu
def test_every_pattern_passes_the_float64_check_on_the_gpu(tmp_path, capsys):
    """The example at bf16 d128, 16 heads, on one length (its modules built first in parallel), without
    torch's FlexAttention (its compile takes minutes: the timing run's business): every pattern, with and
    without its BlockMask, forward and gradients (the bias table's too) within flash-attn's rule."""
    example = load_example()
    # its builds in 4 processes: the suite's other workers build at the same time (in a GPU run of the suite
    # it once did not finish in 290 s with one process a core)
    code = example.main(["--seqlens", "1024", "--tokens", "2048", "--torch", "none", "--repeat", "2", "--jobs", "4",
                         "--json", str(tmp_path / "rows.json")])
    printed = capsys.readouterr().out
    assert code == 0 and "FAILED" not in printed, printed
    assert printed.count("PASSED") == 4 * 2 + 3
