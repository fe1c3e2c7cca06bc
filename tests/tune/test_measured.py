"""The measured spaces (tvmflash/tune/measured.py): ``tvmflash tune --pass backward|decode``."""

import dataclasses
import random

import pytest

import tvmflash
from tvmflash import choice, database, kernels
from tvmflash import target as targets
from tvmflash.schedules import sm90
from tvmflash.tune import measured


def test_the_backward_space_known_configurations_first():
    """``measured.candidates``: the known configurations, then a random draw of the rest of the
    space (callable knobs resolved from the knobs before them), each once, leaving out before any
    build those ``candidate_problem`` rejects (the knob set's ``problem``, shared memory)."""
    assert measured.space_points({"m": [32, 64], "warps": lambda knobs: [knobs["m"] // 32], "v": [8]}) == [
        {"m": 32, "warps": 1, "v": 8}, {"m": 64, "warps": 2, "v": 8}]
    shape = {"batch": 4, "seqlen": 4096, "heads": 16}
    backward = measured.Backward(128, "bfloat16", False, targets.cuda_target("sm90"), shape)
    assert backward.schedule is sm90.SCHEDULE
    defaults = sm90.SCHEDULE.backward.knobs.defaults(128)
    known = {"default": defaults, "user": {**defaults, "block_n": 64}}
    chosen, problems = measured.candidates(backward, known, 12, random.Random(0))
    assert [label for label, _ in chosen[:3]] == ["default", "user", "#1"] and len(chosen) == 12
    assert len({repr(sorted(knobs.items())) for _, knobs in chosen}) == 12  # no configuration twice
    every = sm90.SCHEDULE.backward.knobs.points()
    assert every == measured.space_points(sm90.SCHEDULE.backward.knobs.space())  # no rules between them
    all_chosen, problems = measured.candidates(backward, known, 10000, random.Random(0))
    assert len(all_chosen) + len(problems) == len(every)
    # dq_atomic with 32-row Q blocks (ds k takes 64 rows a wgmma): five twelfths of the space (of the 24
    # points a tile has, dq_atomic takes 20: ds_buffers 1 and 2 by dq_reduce "atomic" and "vector", and
    # with TMA copies "tma" and two producers), on the H200 23 of 96 trials failed to schedule before
    # this was checked first
    assert 12 * len(problems) == 5 * len(every) and all("pass dq_atomic False" in p for p in problems)
    backward.knobs = dataclasses.replace(backward.knobs, shared_memory_limit=100 * 1024)
    fitting, problems = measured.candidates(backward, {}, 10000, random.Random(0))
    assert any("shared memory" in p for p in problems) and len(fitting) + len(problems) == len(every)


def record_source(record: dict, kernel) -> str:
    """How a kernel that runs a record's knobs names their source: tuned, or the defaults where tuning found
    none faster (the record then holds the defaults, as for the forward)."""
    program = kernel.schedule.program("backward" if isinstance(kernel, tvmflash.BackwardKernel) else "decode")
    same = record["knobs"] == program.knobs.defaults(kernel.head_dim, dtype=kernel.dtype)
    return "defaults (tuning found none faster: " if same else "tuned ("


def test_tune_backward_stores_a_record_compile_backward_reads(records_dir, capsys):
    """``tvmflash tune --pass backward`` on the CPU: the defaults and a draw of the space, built in
    parallel processes, each checked against float32 and timed; the fastest is stored as a record of
    the workload's backward, which compile_backward then runs (a forward kernel reads none of it)."""
    from tvmflash import cli as tvmflash_cli

    assert tvmflash_cli.main(["tune", "--pass", "backward", "--head-dim", "32", "--dtype", "float32", "--causal",
                              "--trials", "2", "--target", "cpu", "--seqlen", "64", "--batch", "1", "--heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "measuring 2 configurations (default first)" in out and "trial 2/2" in out, out
    assert "d32 float32 causal backward" in out.split("== summary")[1]
    (record,) = [r for path, r in database.all_records() if path.parent == database.user_dir()]
    assert record["workload"] == {"head_dim": 32, "dtype": "float32", "causal": True, "pass": "backward"}
    assert record["trials"] == 2 and record["failed_trials"] == 0 and set(record["known_ms"]) == {"default"}
    kernels.forget_kernels()
    backward = tvmflash.compile_backward(head_dim=32, dtype="float32", causal=True, target="cpu")
    assert backward.knobs == record["knobs"] and backward.knobs_source.startswith(record_source(record, backward))
    assert tvmflash.compile(head_dim=32, dtype="float32", causal=True, target="cpu").knobs_source == "defaults"
    varlen = tvmflash.compile_backward(head_dim=32, dtype="float32", causal=True, target="cpu", varlen=True)
    assert varlen.knobs_source == "defaults"


def test_tune_decode_stores_a_record_compile_decode_reads(records_dir, one_core, capsys):
    """``tvmflash tune --pass decode`` on the CPU: one query token over full caches, a quarter as many
    K/V heads as query heads; the record is the cache layout's (a paged kernel keeps its defaults)."""
    from tvmflash import cli as tvmflash_cli

    assert tvmflash_cli.main(["tune", "--pass", "decode", "--head-dim", "32", "--dtype", "float32", "--trials", "2",
                              "--target", "cpu", "--seqlen", "96", "--batch", "2", "--heads", "4"]) == 0
    out = capsys.readouterr().out
    assert "'heads_q': 4, 'heads_kv': 1" in out and "trial 2/2" in out and "d32 float32 full decode" in out, out
    (record,) = [r for path, r in database.all_records() if path.parent == database.user_dir()]
    assert record["workload"] == choice.workload({"head_dim": 32, "dtype": "float32", "causal": False}, "decode", 0)
    assert record["failed_trials"] == 0
    contiguous = kernels.compile_decode(head_dim=32, dtype="float32", target="cpu")
    assert contiguous.knobs == record["knobs"] and contiguous.knobs_source.startswith(record_source(record, contiguous))
    assert kernels.compile_decode(head_dim=32, dtype="float32", page_size=16, target="cpu").knobs_source == "defaults"
    with pytest.raises(SystemExit):
        tvmflash_cli.main(["tune", "--head-dim", "32", "--page-size", "16", "--target", "cpu"])
    assert "--page-size" in capsys.readouterr().err


def test_a_measured_pass_replaces_the_incumbent_only_beyond_the_noise(records_dir, monkeypatch):
    """The winner of a measured pass is timed again against the incumbent (here the defaults), five
    times each in turns: 1.05x faster within an 8% spread keeps the defaults (said, and what
    compile_backward then takes); 1.25x faster without noise replaces them. (The candidates are built
    in this process: building them in spawned ones, which import torch and TVM again, is
    test_tune_backward_stores_a_record_compile_backward_reads's; the second pass's are the first's.)"""
    from tvmflash import bench

    monkeypatch.setattr(bench, "build_in_parallel", lambda builds, processes, echo=print, keep_going=False:
                        [bench._build(build) for build in builds])

    def timings(*values):
        sequence = iter(values)
        monkeypatch.setattr(bench, "time_ms", lambda fn, device, repeat: next(sequence))

    args = {"head_dim": 32, "dtype": "float32", "target": "cpu", "trials": 2, "batch": 1, "seqlen": 64, "heads": 2,
            "seed": 0}
    defaults = tvmflash.compile_backward(head_dim=32, dtype="float32", target="cpu").knobs
    # one trial each (default, #1), then the rounds in turns: default 1.00-1.08, #1 0.95-0.99
    timings(1.00, 0.96, *[t for pair in zip((1.00, 1.08, 1.02, 1.05, 1.00), (0.96, 0.97, 0.99, 0.95, 0.98))
                          for t in pair])
    lines = []
    record = measured.tune_pass("backward", echo=lines.append, **args)
    assert record["kept"] == "default" and record["knobs"] == defaults and record["noise"] == 0.08
    assert ("not stored: the tuned knobs #1 ran 1.052x as fast as the defaults (median of 5 timings each, which "
            "spread by up to 8.0%): within the noise, the defaults stay") in lines, lines
    kernels.forget_kernels()
    backward = tvmflash.compile_backward(head_dim=32, dtype="float32", target="cpu")
    assert backward.knobs == defaults and backward.knobs_source.startswith("defaults (tuning found none faster")

    timings(1.00, 0.80, *[1.00, 0.80] * 5)
    lines = []
    record = measured.tune_pass("backward", echo=lines.append, **args)
    assert record["kept"] == "#1" and record["knobs"] != defaults and record["mean_ms"] == 0.8
    assert any(line.startswith("stored: the tuned knobs #1 ran 1.250x") for line in lines), lines
    kernels.forget_kernels()
    assert tvmflash.compile_backward(head_dim=32, dtype="float32", target="cpu").knobs == record["knobs"]


def test_tune_flex_stores_a_record_that_kernels_of_the_same_mods_read(records_dir, one_core, capsys):
    """``tvmflash tune --flex alibi --block-mask`` is refused (no mask_mod); ``--flex document --block-mask`` on the
    CPU: the forward's space measured with the pattern's captured document ids and BlockMask lists, each output
    checked against the pattern's reference; the record is keyed by the mods' trace (``choice.flex_digest``),
    which flex_attention's kernel of the same mods reads at other shapes, while plain attention and other mods
    keep their defaults."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from tvmflash import cli as tvmflash_cli
    from tvmflash import flex, flex_patterns

    assert tvmflash_cli.FLEX_PATTERNS == tuple(flex_patterns.PATTERNS)
    with pytest.raises(SystemExit):
        tvmflash_cli.main(["tune", "--flex", "alibi", "--block-mask", "--head-dim", "32", "--target", "cpu"])
    assert "no mask_mod" in capsys.readouterr().err
    assert tvmflash_cli.main(["tune", "--flex", "document", "--block-mask", "--head-dim", "32", "--dtype", "float32",
                              "--trials", "2", "--target", "cpu", "--seqlen", "128", "--batch", "2",
                              "--heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "(flex document block-mask)" in out and "trial 2/2" in out, out
    assert "d32 float32 full flex document block-mask" in out.split("== summary")[1]
    (record,) = [r for path, r in database.all_records() if path.parent == database.user_dir()]
    assert record["failed_trials"] == 0 and record["flex_case"] == "flex document block-mask"
    mods, _, _ = flex_patterns.TuningCase("document", block_mask=True)(1, 2, 256, "cpu")
    assert record["workload"] == {"head_dim": 32, "dtype": "float32", "causal": False,
                                  "flex": choice.flex_digest(mods)}
    kernels.forget_kernels()
    q = torch.randn(1, 256, 2, 32)
    kernel = flex.flex_kernel(q, mods)
    assert kernel.knobs == record["knobs"]
    assert kernel.knobs_source.startswith(("tuned (", "defaults (tuning found none faster: "))
    # the same mods through flex_attention, at another length and batch: that kernel, right results
    pattern = flex_patterns.make("document", 1, 2, 256, "cpu")
    block_mask = create_block_mask(pattern.mask_mod, 1, None, 256, 256, device="cpu")
    qh, kh, vh = (torch.randn(1, 2, 256, 32) for _ in range(3))
    out = tvmflash.flex_attention(qh, kh, vh, block_mask=block_mask)
    ref = flex_patterns.reference(qh, kh, vh, pattern, torch.float64)
    assert (out.double() - ref).abs().max().item() < 1e-5
    assert tvmflash.compile(head_dim=32, dtype="float32", target="cpu").knobs_source == "defaults"
    other, _, _ = flex_patterns.TuningCase("document")(1, 2, 256, "cpu")  # no BlockMask: other mods
    assert flex.flex_kernel(q, other).knobs_source == "defaults"


def test_tune_flex_backward_stores_a_record_that_the_backward_of_the_same_mods_reads(records_dir, one_core, capsys):
    """``tvmflash tune --flex relative-bias --pass backward``: the backward's space measured with the table
    captured, the gradients checked against the pattern's reference by torch's autograd; compile_backward of the
    same mods reads the record, their forward does not."""
    from tvmflash import cli as tvmflash_cli
    from tvmflash import flex_patterns

    assert tvmflash_cli.main(["tune", "--flex", "relative-bias", "--pass", "backward", "--head-dim", "32", "--dtype",
                              "float32", "--trials", "2", "--target", "cpu", "--seqlen", "64", "--batch", "1",
                              "--heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "(flex relative-bias backward)" in out and "trial 2/2" in out, out
    (record,) = [r for path, r in database.all_records() if path.parent == database.user_dir()]
    mods, _, _ = flex_patterns.TuningCase("relative-bias")(1, 2, 64, "cpu")
    assert record["failed_trials"] == 0
    assert record["workload"] == {"head_dim": 32, "dtype": "float32", "causal": False, "pass": "backward",
                                  "flex": choice.flex_digest(mods)}
    kernels.forget_kernels()
    backward = tvmflash.compile_backward(head_dim=32, dtype="float32", target="cpu", flex=mods)
    assert backward.knobs == record["knobs"] and backward.knobs_source.startswith(record_source(record, backward))
    assert tvmflash.compile(head_dim=32, dtype="float32", target="cpu", flex=mods).knobs_source == "defaults"
