"""The driver (tvmflash/tune/run.py): real short llvm tuning runs, warm and cold, through ``tune`` and
the ``tvmflash tune`` command."""

import itertools
import json
import re

import pytest
import torch
from conftest import tune_on_one_core

import tvmflash
from tvmflash import database, kernels, tune
from tvmflash import target as targets
from tvmflash.schedules import cpu
from tvmflash.tune import mutator, run, task

CPU = targets.cpu_target()
WORKLOAD = {"head_dim": 32, "dtype": "float32", "causal": False}


def test_short_tuning_run_is_used_by_compile(records_dir, one_core, monkeypatch):
    mutations = []
    apply = mutator.MutateKnob._cls.apply  # the class behind @derived_object

    def counting(self, trace, rand_state):
        mutated = apply(self, trace, rand_state)
        mutations.append(mutated is not None)
        return mutated

    monkeypatch.setattr(mutator.MutateKnob._cls, "apply", counting)
    lines = []
    record = tune.tune(head_dim=32, dtype="float32", causal=False, target="cpu", trials=6, batch=1, seqlen=96,
                       heads=2, space={"block_m": [16, 32], "block_n": [32], "vector": [4, 8, 16]}, seed=0,
                       repeat=5, echo=lines.append)
    text = "\n".join(lines)
    assert re.search(r"\[\d+/6 trials, \d+ failed", text) and "best so far" in text, text
    assert re.search(r"built \d+/6 candidates", text), text  # progress while MetaSchedule builds
    assert "default" in text and "tuned" in text and record["default_ms"] > 0 and record["tuned_ms"] > 0
    assert record["shape"] == {"batch": 1, "seqlen_q": 96, "seqlen_k": 96, "heads_q": 2, "heads_kv": 2}
    assert 1 <= record["trials"] <= 6 and record["wall_s"] > 0 and record["workload"] == WORKLOAD
    assert record["tuned_knobs"]["block_m"] in (16, 32) and record["tuned_knobs"]["vector"] in (4, 8, 16)

    # MetaSchedule measured more than one value of the sampled knob.
    decisions = set()
    with open(f"{record['work_dir']}/database_tuning_record.json") as f:
        for line in f:
            trace = json.loads(line)[1][0]
            decisions |= {tuple(d[1]) if isinstance(d[1], list) else d[1] for d in trace[1]}
    assert len(decisions) >= 2, decisions
    assert any(mutations), "the evolutionary search never mutated a sampled knob"

    # A new compile() (symbolic shapes) picks the record up, and runs at another shape.
    kern = tvmflash.compile(head_dim=32, dtype="float32", causal=False, target="cpu")
    # (the defaults may win at this shape: the record then keeps them, and they are not called tuned)
    won = "defaults" if record["knobs"] == cpu.SCHEDULE.forward.knobs.defaults(32, dtype="float32") else "tuned"
    assert kern.info()["knobs_source"].startswith(won), kern.info()
    assert kern.knobs == record["knobs"]
    import torch

    q, k, v = torch.randn(2, 37, 2, 32), torch.randn(2, 53, 2, 32), torch.randn(2, 53, 2, 32)
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert torch.allclose(kern(q, k, v), ref, atol=1e-4)


def test_tuned_knobs_with_wrong_results_are_never_stored(records_dir, one_core, monkeypatch):
    """The tuned knobs must also give correct output (flash-attn's rule) at the tuning shape: a
    faster but wrong kernel is reported and the default is kept."""
    from tvmflash import bench

    checked = []

    def wrong_when_tuned(out, q, k, v, causal):
        checked.append(len(checked))
        return (1.0, 1e-3) if len(checked) > 1 else (0.0, 1e-3)  # the default first, then the tuned ones

    monkeypatch.setattr(bench, "error_vs_float32", wrong_when_tuned)
    lines = []
    record = tune.tune(head_dim=32, dtype="float32", causal=False, target="cpu", trials=2, batch=1, seqlen=64,
                       heads=1, space={"block_m": [16], "block_n": [32], "vector": [4, 8]}, seed=0, repeat=3,
                       echo=lines.append)
    assert len(checked) == 3 and any("the tuned knobs #" in line and "give wrong results" in line for line in lines), lines
    assert record["knobs"] == cpu.SCHEDULE.forward.knobs.defaults(32, dtype="float32")


def test_the_fastest_few_are_timed_again_as_compile_builds_them(records_dir, one_core, monkeypatch):
    """MetaSchedule times static shapes; tvmflash.compile builds symbolic ones, which can rank
    configurations differently (sm90 on the H200). The fastest few are timed again through
    tvmflash.compile, and the fastest there is kept, not MetaSchedule's first."""
    from tvmflash import bench

    timings = itertools.cycle([5.0, 4.0, 3.0])  # default, MetaSchedule's #1, #2: timed in turns, no noise
    monkeypatch.setattr(bench, "time_ms", lambda fn, device, repeat: next(timings))
    schedules, compile_ = [], kernels.compile

    def compile_named(**kwargs):  # the tuned schedule, named: knobs alone do not say whose they are
        schedules.append(kwargs.get("schedule"))
        return compile_(**kwargs)

    monkeypatch.setattr(kernels, "compile", compile_named)
    lines = []
    record = tune.tune(head_dim=32, dtype="float32", causal=False, target="cpu", trials=2, batch=1, seqlen=64,
                       heads=1, space={"block_m": [16], "block_n": [32], "vector": [4, 8]}, seed=0, repeat=3,
                       echo=lines.append)
    assert schedules == ["cpu"] * 3, schedules
    rechecked = [line.split() for line in lines if line.startswith("  #")]
    assert [line[0] for line in rechecked] == ["#1", "#2"], lines
    assert record["tuned_ms"] == 3.0 and record["default_ms"] == 5.0 and record["mean_ms"] == 3.0
    assert record["knobs"] == record["tuned_knobs"] and record["knobs"]["vector"] == int(rechecked[1][-1].rstrip("}"))
    assert record["incumbent"] == "default" and record["kept"] == "#2" and record["noise"] == 0
    assert any(line.startswith("stored: the tuned knobs #2 ran 1.667x as fast as the defaults (median of 5 timings "
                               "each, which spread by up to 0.0%): more than the noise") for line in lines), lines


# A user record for the full workload, slower than anything measured (so the run replaces it), with
# knobs of its own: a warm run must seed the search with it and time it again.
USER_KNOBS = {"block_m": 16, "block_n": 64, "vector": 8}  # each unlike the float32 defaults


@pytest.fixture(scope="module")
def cli_tuning_run(tmp_path_factory):
    """One ``tvmflash tune`` command over two workloads, warm, its output captured (not a terminal),
    with USER_KNOBS in the user's database: several tests read it. In this process (its ``main``):
    a new one would import TVM, tvmflash and torch again. Fresh records, the run's modules
    (``records_dir``)."""
    import contextlib
    import io

    from tvmflash import cache
    from tvmflash import cli as tvmflash_cli

    env_dir = tmp_path_factory.mktemp("cli-tuning")
    cache.module_dir().mkdir(parents=True, exist_ok=True)  # the run's modules, as ``records_dir``'s
    (env_dir / "modules").symlink_to(cache.module_dir(), target_is_directory=True)
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.setenv("TVMFLASH_CACHE_DIR", str(env_dir))
        tune_on_one_core(patch)
        # (at the run's shape: records of another seqlen bucket would be kept apart from its own)
        database.add(database.new_record(CPU, "cpu", WORKLOAD, USER_KNOBS, 1e3, shape={"seqlen_k": 64}))
        code = tvmflash_cli.main(["tune", "--head-dim", "32", "--dtype", "float32", "--causal", "both", "--trials", "2",
                                  "--target", "cpu", "--seqlen", "64", "--batch", "1", "--heads", "1"])
        assert code == 0, err.getvalue()
        full = database.lookup(CPU, "cpu", WORKLOAD, usable=cpu.SCHEDULE.forward.knobs.accepts)
    kernels.forget_kernels()  # kernels made while the run's cache dir was set read its records
    return out.getvalue(), full


def test_tune_several_workloads_in_one_command(cli_tuning_run):
    """One command tunes each (head_dim, dtype, causal) in turn and ends with a summary table: a row
    each, with trials, the failed share, the search's best, the kept and the defaults' times, the
    speedup and the wall time."""
    stdout, _ = cli_tuning_run
    assert "== workload 1/2: d32 float32 full" in stdout and "== workload 2/2: d32 float32 causal" in stdout
    header, *rows = stdout.split("== summary")[1].strip().splitlines()[1:]
    assert header.split()[:8] == ["workload", "start", "trials", "failed", "search", "ms", "kept", "ms"], header
    assert [row.split()[:4] for row in rows] == [["d32", "float32", "full", "warm"], ["d32", "float32", "causal", "warm"]]
    for row in rows:
        trials, failed, _search_ms, kept_ms, default_ms, speedup, wall_s = row.split()[4:11]
        assert 1 <= int(trials) <= 2 and failed.endswith("%") and float(wall_s) > 0, row
        # (the kept knobs may be the user's, slower than the defaults within the noise: see decision.py)
        assert float(kept_ms) > 0 and float(default_ms) > 0 and speedup.endswith("x"), row


def test_progress_is_reported_a_line_a_trial_when_not_a_terminal(cli_tuning_run):
    """Not a terminal (a pipe here): no progress bar, a plain line for each build batch and each
    trial as it ends, with the trials done of the total, failures, best so far, elapsed and
    remaining time."""
    stdout, _ = cli_tuning_run
    assert "\r" not in stdout and "\x1b[" not in stdout
    trials = re.findall(r"^  trial (\d+): .*\((\d+)/2 trials, (\d+) failed, best ([\d.]+ ms|none yet), \d+ s"
                        r"(, ~\d+ s left)?\)$", stdout, flags=re.MULTILINE)
    assert [(n, done) for n, done, *_ in trials] == [("1", "1"), ("2", "2")] * 2, stdout
    assert all(left for *_, left in trials), stdout  # the remaining time, once a trial has ended
    assert re.search(r"^  built \d+/2 candidates", stdout, flags=re.MULTILINE), stdout


def is_seed(line: str) -> bool:
    """Whether a line of MetaSchedule's JSON database is one of the tuner's seeds (by its run time)."""
    return json.loads(line)[1][1] == pytest.approx([task._SEED_SECS])


def test_a_warm_run_starts_from_the_known_and_never_ends_below_them(cli_tuning_run):
    """Warm (the default), the user's record seeds MetaSchedule's database and is timed again with
    the defaults and the search's best, in the same run: the record keeps the fastest of them where it
    beats the user's knobs, the incumbent, by more than the noise of their timings, else the user's."""
    stdout, full = cli_tuning_run
    assert "warm start: seeded the search with the default, user knobs" in stdout, stdout
    # (with MetaSchedule's time too where the search measured them)
    assert re.search(r"^  user +(MetaSchedule [\d.]+ ms, )?tvmflash.compile [\d.]+ ms \(spread [\d.]+%\): "
                     + re.escape(str(USER_KNOBS)),
                     stdout, flags=re.MULTILINE), stdout
    assert full["start"] == "warm" and set(full["known_ms"]) == {"default", "user"}
    assert full["default_ms"] == full["known_ms"]["default"] and full["incumbent"] == "user"
    assert re.search(r"^(not )?stored: .*(your tuning record's knobs|the defaults)", stdout, flags=re.MULTILINE), stdout
    if full["kept"] == "user":
        assert full["knobs"] == USER_KNOBS and full["mean_ms"] == full["known_ms"]["user"]
    else:  # the fastest, by more than the noise
        assert full["mean_ms"] == min(full["tuned_ms"], *full["known_ms"].values())
        assert full["mean_ms"] * (1 + full["noise"]) < full["known_ms"]["user"]
    with open(f"{full['work_dir']}/database_tuning_record.json") as f:
        seeds = [line for line in f if is_seed(line)]
    assert len(seeds) == 2, seeds  # the defaults and the user's knobs, each in its task
    # The task that holds the user's record is handed the first trials (PromisingTasksFirst: the user's
    # record, then the shipped one, then the defaults), here both of them.
    full_run = stdout.split("== workload 2/2")[0]
    assert re.findall(r"^\[\d+/2 trials, .*\] task (\w+):", full_run, flags=re.MULTILINE)[0] == "bm16_bn64"


def test_a_cold_run_reads_no_record(records_dir, one_core, monkeypatch):
    """--cold: nothing known seeds the search and no record is read (a user record is there, and
    would be timed warm); the defaults are still timed, as the reference."""
    database.add(database.new_record(CPU, "cpu", WORKLOAD, USER_KNOBS, 1e3))
    read = []
    monkeypatch.setattr(database, "known_records", lambda *args, **kwargs: read.append(args) or [])
    lines = []
    # One configuration, the defaults: what is timed again is the defaults alone.
    record = tune.tune(head_dim=32, dtype="float32", causal=False, target="cpu", trials=1, batch=1, seqlen=64,
                       heads=1, space={"block_m": [64], "block_n": [64], "vector": [16]}, seed=0, repeat=3,
                       cold=True, echo=lines.append)
    assert read == [] and "  cold start: no defaults or records seed the search" in lines, lines
    assert not any(line.startswith("  user ") or "seeded" in line for line in lines), lines
    assert record["start"] == "cold" and list(record["known_ms"]) == ["default"]
    with open(f"{record['work_dir']}/database_tuning_record.json") as f:
        assert [is_seed(line) for line in f] == [False], "a seed in a cold run"


def test_tune_takes_the_schedule_compile_picks(cache_dir, monkeypatch):
    """On sm_90a the sm90 schedule serves the forward (at d32 the sm80 one), so that is the space the
    tuner searches; TVMFLASH_SM90=0 takes sm80's. Without xgboost (MetaSchedule's cost model) it
    stops there, before building anything."""
    monkeypatch.delenv("TVMFLASH_SM90", raising=False)
    for name, value in (("is_available", True), ("get_device_name", "a test GPU"), ("get_device_capability", (9, 0))):
        monkeypatch.setattr(torch.cuda, name, lambda *_, value=value: value)
    find_spec = run.importlib.util.find_spec
    monkeypatch.setattr(run.importlib.util, "find_spec", lambda name: None if name == "xgboost" else find_spec(name))
    for head_dim, setting, expected in ((128, None, "sm90"), (32, None, "sm80"), (128, "0", "sm80")):
        if setting is not None:
            monkeypatch.setenv("TVMFLASH_SM90", setting)
        lines = []
        with pytest.raises(RuntimeError, match="needs xgboost"):
            tune.tune(head_dim=head_dim, dtype="bfloat16", causal=False, target="sm90", echo=lines.append)
        assert lines[0].startswith(f"tvmflash tune: {expected} schedule"), lines
    assert not list(cache_dir.glob("**/*.so"))


def test_a_tuning_shape_keeps_the_grids_tokens_at_any_seqlen():
    """``--seqlen`` alone: bench's tokens in batches of that length (a GPU's 16k, a CPU's 2k)."""
    for target, seqlen, batch in (("sm90", 512, 32), ("sm90", None, 4), ("cpu", 256, 8)):
        _, _, shape = run.tuning_request(128, "bfloat16", False, 1, target, None, seqlen, None)
        assert (shape["batch"], shape["heads"]) == (batch, 16 if target == "sm90" else 4)
    assert run.tuning_request(128, "bfloat16", False, 1, "sm90", 3, 512, 2)[2] == {"seqlen": 512, "batch": 3,
                                                                                    "heads": 2}
