"""examples/train_gpt.py: a few training steps on the CPU, tvmflash against SDPA."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def losses(example, attn, device="cpu", extra=()):
    args = example.parse_args(["--attn", attn, "--steps", "8", "--batch-size", "4", "--seq-len", "64", "--layers", "2",
                               "--width", "64", "--heads", "2", "--lr", "3e-3", "--device", device, "--log-every", "4",
                               *extra])
    return example.train(args)


def test_tvmflash_and_sdpa_train_alike_on_cpu(capsys):
    example = load_example()
    ours, sdpa = losses(example, "tvmflash"), losses(example, "sdpa")
    assert ours[-1] < ours[0] - 0.5  # it learns
    assert max(abs(a - b) for a, b in zip(ours, sdpa)) < 1e-4, (ours, sdpa)  # float32: the same curve
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "peak memory" in printed and "attn=tvmflash" in printed


@pytest.mark.gpu
def test_tvmflash_and_sdpa_train_alike_on_the_gpu():
    """bf16 autocast under torch.compile: the curves agree within bf16 noise."""
    example = load_example()
    ours = losses(example, "tvmflash", "cuda", ["--compile", "--steps", "30"])
    sdpa = losses(example, "sdpa", "cuda", ["--compile", "--steps", "30"])
    assert ours[-1] < ours[0] - 0.5
    assert abs(sum(ours[-5:]) - sum(sdpa[-5:])) / 5 < 0.05, (ours, sdpa)
