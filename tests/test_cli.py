"""The tvmflash command line, run as a user would."""

import os
import json
import re
import subprocess
import sys

import pytest

from conftest import cli
from tvmflash import database
from tvmflash import target as targets

CPU = targets.cpu_target()
WORKLOAD = {"head_dim": 32, "dtype": "float32", "causal": False}


def tvmflash(*args):
    done = subprocess.run([sys.executable, "-m", "tvmflash.cli", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_info():
    """In a process of its own, as a user runs it (the other commands mostly through ``main``, which is what
    ``python -m tvmflash.cli`` runs: a process imports TVM and torch, some 3 s of CPU each)."""
    out = tvmflash("info")
    assert "TVM 0.27" in out and "cache dir:" in out and "default target:" in out


def test_compile_emits_cuda(tmp_path):
    from tvmflash import cli

    path = tmp_path / "out.cu"
    assert cli.main(["compile", "--target", "sm90", "--head-dim", "128", "--dtype", "bfloat16", "--causal",
                     "--emit", "cuda", "-o", str(path)]) == 0
    assert "__global__" in path.read_text()


def test_bench_on_cpu(capsys):
    """--layout bhsd times tvmflash on (b, h, s, d) tensors seen through a transpose against contiguous
    ones in the same run (and checks both outputs)."""
    from tvmflash import cli

    assert cli.main(["bench", "--device", "cpu", "--head-dim", "64", "--causal", "yes", "--seqlens", "128",
                     "--tokens", "256", "--hidden", "128", "--repeat", "2", "--layout", "bhsd"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("bfloat16 d64 causal")]
    assert len(lines) == 1 and lines[0].split()[-1] == "yes", out
    schedule = "amx" if targets.host_amx() else "cpu"  # bf16 on a CPU with AMX: the amx schedule
    assert f"kernel d64 causal: {schedule} schedule, " in out and "knobs {'block_m': " in out, out  # what ran
    assert "tvmflash-bhsd ms" in out and re.search(r"strided \(b, h, s, d\) views over contiguous .* time ratio: "
                                                   r"[\d.]+x to [\d.]+x", out), out


# One small CPU configuration (test_bench_on_cpu's: its module is built once for both).
SMALL_BENCH = ["bench", "--device", "cpu", "--head-dim", "64", "--causal", "yes", "--seqlens", "128", "--tokens", "256",
               "--hidden", "128", "--repeat", "2"]


def test_bench_saves_its_run_and_prints_it_again(tmp_path, capsys):
    """--json writes the run (results with their shapes, the ceilings measured in the same run, device,
    date, version); --from-json reads it back, measuring nothing, and prints the same table."""
    from tvmflash import bench, cli

    path = tmp_path / "run.json"
    assert cli.main([*SMALL_BENCH, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    ceilings = re.search(r"ceilings in this run: 1024x1024 bfloat16 matmul ([\d.]+) TFLOP/s, copy of 256 MiB "
                         r"([\d.]+) GB/s \(read \+ write\)", out)
    assert ceilings and all(float(x) > 0 for x in ceilings.groups()), out
    data = json.loads(path.read_text())
    report = bench.load_report(path)
    assert report.to_json() == data and report.dtype == "bfloat16" and report.device.startswith("CPU: ")
    assert report.ceilings.matmul_tflops > 0 and report.ceilings.copy_gbps > 0
    (result,) = report.results
    assert result.shape == {"batch": 2, "seqlen": 128, "heads": 2, "head_dim": 64, "causal": True}
    assert result.times_ms["tvmflash"] > 0 and result.error <= result.tolerance
    rows = [line for line in out.splitlines() if line.startswith("bfloat16 d64 causal")]

    assert cli.main(["bench", "--from-json", str(path)]) == 0
    again = capsys.readouterr().out
    assert rows and rows == [line for line in again.splitlines() if line.startswith("bfloat16 d64 causal")], again
    assert ceilings.group(0) in again and "(from a saved report)" in again


def test_bench_plots_what_it_measured(tmp_path, capsys):
    """--plot draws the run as it ends, and --from-json FILE --plot draws a saved run (on a machine
    without the GPU that measured it): both valid PNGs."""
    pytest.importorskip("matplotlib")
    from tvmflash import cli

    drawn, saved, again = tmp_path / "run.png", tmp_path / "run.json", tmp_path / "again.png"
    assert cli.main([*SMALL_BENCH, "--plot", str(drawn), "--json", str(saved)]) == 0
    assert cli.main(["bench", "--from-json", str(saved), "--plot", str(again)]) == 0
    assert f"wrote {drawn}" in capsys.readouterr().out
    for png in (drawn, again):
        head = png.read_bytes()[:24]
        width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
        assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR" and width > 200 and height > 200


def test_plot_draws_a_grid_of_panels(tmp_path):
    """Five (head_dim, causal) panels on a grid of two rows (the unused cell hidden), a backend that refused
    an input (no point), a tvmflash output over the error tolerance (a red x): from a hand-made report."""
    pytest.importorskip("matplotlib")
    from tvmflash import bench, plot

    results = [bench.Result(f"d{d} s{s}", {"tvmflash": s / 1000, "sdpa-flash": None if s == 512 else s / 900}, s * 1e9,
                            error=1.0 if (d, s) == (64, 1024) else 0.0, tolerance=0.5,
                            shape={"batch": 1, "seqlen": s, "heads": 8, "head_dim": d, "causal": causal})
               for d, causal in ((64, False), (64, True), (96, False), (128, False), (256, True)) for s in (512, 1024)]
    report = bench.Report("NVIDIA H100 80GB HBM3", "bfloat16", "2026-12-07", "0.1.0 (abcdef0)",
                          bench.Ceilings(700.0, 8192, 3000.0, 1 << 30), results)
    plot.plot(report, tmp_path / "grid.svg")
    svg = (tmp_path / "grid.svg").read_text()
    assert "NVIDIA H100 80GB HBM3" in svg and "over the error tolerance" in svg and "d256, 8 heads, causal" in svg


def test_plot_bandwidth_draws_a_panel_a_batch(tmp_path):
    """decode_bench.py --plot's figure: GB/s against the keys, a panel per batch (the fourth cell of a
    grid of three columns hidden), tvmflash's lines and SDPA's, the copy's ceiling; a bad file name or an
    empty run refused."""
    pytest.importorskip("matplotlib")
    from tvmflash import plot

    panels = {f"batch {b}": {"tvmflash contiguous": [(4096, 900.0 * b), (16384, 1500.0)],
                             "sdpa-cudnn": [(4096, 1000.0), (16384, 1600.0)]} for b in (1, 8, 32, 64)}
    plot.plot_bandwidth(panels, 3000.0, "decode on NVIDIA H100 80GB HBM3", tmp_path / "decode.svg")
    svg = (tmp_path / "decode.svg").read_text()
    assert "decode on NVIDIA H100 80GB HBM3" in svg and "batch 64" in svg and "sdpa-cudnn" in svg
    with pytest.raises(ValueError, match="nothing measured"):
        plot.plot_bandwidth({}, 1.0, "t", tmp_path / "empty.png")
    with pytest.raises(ValueError, match="expected a file name ending in"):
        plot.plot_bandwidth(panels, 1.0, "t", tmp_path / "decode.txt")


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    """Without matplotlib, --plot is refused before anything is measured, with the command that installs
    it and the way round it (--json now, --from-json where matplotlib is)."""
    from tvmflash import cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: its import raises ImportError
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--device", "cpu", "--plot", str(tmp_path / "run.png")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "pip install 'tvmflash[plot]'" in err and "--from-json" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run.png").exists()


def write_file(folder, name, text):
    (folder / name).write_text(text)
    return str(folder / name)


@pytest.mark.parametrize("args,message", [
    (lambda d: ["--plot", str(d / "run.txt")], "--plot: expected a file name ending in .png, .svg, .pdf, got "),
    (lambda d: ["--plot", str(d / "missing" / "run.png")], "/missing is not a folder"),
    (lambda d: ["--plot", write_file(d, "a-file", "") + "/run.png"], "/a-file is not a folder"),
    (lambda d: ["--plot", str(d)], "is a folder, expected a file name"),
    (lambda d: ["--json", str(d / "missing" / "run.json")], "--json: cannot write"),
    (lambda d: ["--from-json", str(d / "missing.json")], "missing.json: cannot read it: No such file or directory"),
    (lambda d: ["--from-json", write_file(d, "broken.json", "{")], "broken.json: Expecting property name"),
    (lambda d: ["--from-json", write_file(d, "other.json", '{"results": []}')],
     "other.json: expected a report of `tvmflash bench --json` ('tvmflash bench report 1'), got None"),
    (lambda d: ["--from-json", write_file(d, "damaged.json", '{"format": "tvmflash bench report 1"}')],
     "damaged.json: a damaged bench report: KeyError: 'ceilings'"),
])
def test_bench_refuses_bad_outputs_and_reports(tmp_path, capsys, args, message):
    """A file bench cannot write, or a report it cannot read, is one line of error before anything is
    measured, not a traceback after minutes of it."""
    from tvmflash import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--device", "cpu", *args(tmp_path)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_bad_arguments_fail_cleanly(capsys):
    from tvmflash import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["compile", "--head-dim", "59", "--target", "cpu"])
    err = capsys.readouterr().err
    assert exited.value.code != 0 and "head_dim: expected a multiple of 8 from 8 to 256, got 59" in err
    assert "Traceback" not in err


def test_compile_emits_what_its_target_has(capsys):
    """Without --emit, a CPU target gives its TensorIR (the default was --emit cuda on any target), as
    --emit tir does."""
    from tvmflash import cli

    assert cli.main(["compile", "--target", "cpu", "--head-dim", "64"]) == 0
    default = capsys.readouterr().out
    assert "T.sblock" in default
    assert cli.main(["compile", "--target", "cpu", "--head-dim", "64", "--emit", "tir"]) == 0
    assert capsys.readouterr().out == default


def test_help_says_the_defaults():
    out = tvmflash("bench", "--help")
    assert "(default: 20)" in out and "(default: bfloat16)" in out and "(default: 64 128)" in out, out
    assert "(default: 16)" in tvmflash("compile", "--help")


@pytest.mark.parametrize("command,required,default", [
    ("compile", ["--head-dim", "64"], "no"),
    ("bench", [], "both"),
    ("tune", ["--head-dim", "64"], "no"),
])
def test_causal_takes_the_same_forms_in_every_command(command, required, default, capsys):
    """``tune --causal`` took no value and ``bench --causal`` required one: every command now takes
    --causal alone (yes) and --causal yes|no, and the commands that run several configurations
    --causal both; the invocations of before (``tune --causal``, ``bench --causal no``, ``compile
    --causal``) mean what they meant."""
    from tvmflash import cli

    def causal(*args):
        return cli.parser().parse_args([command, *required, *args]).causal

    assert causal() == default
    assert causal("--causal") == causal("--causal", "yes") == "yes"
    assert causal("--causal", "no") == "no"
    assert causal("--causal", "--dtype", "float32") == "yes"  # alone, before another option
    if command == "compile":  # one kernel: causal or not
        with pytest.raises(SystemExit):
            causal("--causal", "both")
        assert "invalid choice: 'both'" in capsys.readouterr().err
    else:
        assert causal("--causal", "both") == "both"
    with pytest.raises(SystemExit):
        causal("--causal", "maybe")
    assert "invalid choice: 'maybe'" in capsys.readouterr().err
    assert cli.CAUSAL == {"no": (False,), "yes": (True,), "both": (False, True)}


def test_bench_without_a_gpu_says_so(monkeypatch, capsys):
    import torch

    from tvmflash import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--device", "cuda"])
    assert exited.value.code == 2
    assert "device: 'cuda' needs a CUDA GPU visible to torch, and none is" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--seqlens", "0"], "seqlens: expected positive ints, got 0"),
    (["--seqlens", "128", "-4"], "seqlens: expected positive ints, got [-4]"),
    (["--tokens", "0"], "tokens: expected positive ints, got 0"),
    (["--repeat", "0"], "repeat: expected positive ints, got 0"),
    (["--hidden", "32"], "hidden: heads * head_dim must hold at least one head of head_dim 64, got 32"),
])
def test_bench_refuses_empty_grids(capsys, args, message):
    """``tvmflash bench --seqlens 0`` ended in a ZeroDivisionError traceback: a grid's sizes are checked
    before anything is built."""
    from tvmflash import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "--device", "cpu", "--head-dim", "64", *args])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_closed_pipe_ends_quietly():
    """`tvmflash info | head -2` ended in a BrokenPipeError traceback (so did every command: here one
    that starts quickly)."""
    done = subprocess.Popen([sys.executable, "-m", "tvmflash.cli", "cache", "ls"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    done.stdout.close()  # the reader is gone before the first line
    stderr = done.communicate(timeout=300)[1]
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_help_and_cache_commands_start_without_tvm(tmp_path):
    """Every command took about 3.5 s to start, --help included: it imported TVM (and torch) first."""
    code = ("import sys; from tvmflash import cli\n"
            "try:\n    cli.main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
            "cli.main(['cache', 'ls'])\n"
            "print('loaded:', sorted(m for m in ('tvm', 'torch') if m in sys.modules))")
    env = dict(os.environ, TVMFLASH_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip().endswith("loaded: []"), done.stdout


@pytest.mark.gpu
def test_bench_on_gpu():
    out = tvmflash("bench", "--head-dim", "128", "--causal", "no", "--seqlens", "1024", "--repeat", "3",
                   "--layout", "bhsd")
    assert "sdpa-flash" in out and "tvmflash-bhsd ms" in out and "strided (b, h, s, d) views" in out, out
    host = re.search(r"host time a call, the GPU kept busy \(.*\): tvmflash (\d+) us, sdpa-flash (\d+) us", out)
    assert host and all(0 < int(us) < 10_000 for us in host.groups())


def test_cache_commands(cache_dir, tmp_path):
    rec = database.new_record(CPU, "cpu", WORKLOAD, {"block_m": 16, "block_n": 32, "vector": 8}, 1.5)
    database.add(rec)
    slow = {**rec, "knobs": {"block_m": 64}, "mean_ms": 9.0, "workload": {**WORKLOAD, "causal": True}}
    database.add(slow)
    rid = database.record_id(rec)

    done = cli("cache", "ls", env_dir=cache_dir)
    assert done.returncode == 0, done.stderr
    shipped = sum(len(database.read(f)) for f in database.SHIPPED_DIR.glob("*.json"))  # e.g. the H200's
    assert f"tuning records: {2 + shipped}" in done.stdout and rid in done.stdout and "cached modules: 0" in done.stdout

    done = cli("cache", "show", rid[:8], env_dir=cache_dir)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["knobs"] == rec["knobs"]

    out = tmp_path / "exported"
    existing = {**rec, "device": rec["device"], "tvm": "0.26.0"}  # another key, already shipped: kept
    database.write(out / f"{database.slug(rec['device'])}.json", [existing])
    done = cli("cache", "export", "--out", str(out), env_dir=cache_dir)
    assert done.returncode == 0, done.stderr
    (written,) = out.glob("*.json")
    assert len(database.read(written)) == 3

    done = cli("cache", "clear", env_dir=cache_dir)
    assert done.returncode == 0 and "deleting 0 cached modules" in done.stdout and "2 tuning records" in done.stdout
    assert not database.user_dir().exists()


def test_bad_cli_input_is_one_line(cache_dir, capsys):
    """Bad input is one line of error, exit status 2: the first in a process of its own, as a user runs it,
    the others through ``main`` (what ``python -m tvmflash.cli`` runs; a process imports TVM and torch,
    some 2 s of CPU each)."""
    from tvmflash import cli as tvmflash_cli

    done = cli("tune", "--head-dim", "59", env_dir=cache_dir)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    for args in (("tune", "--head-dim", "64", "--trials", "0", "--target", "cpu"),
                 ("tune", "--head-dim", "64", "59", "--target", "cpu"),  # refused before 64 is tuned
                 ("cache", "show", "no-such-key")):
        with pytest.raises(SystemExit) as exited:
            tvmflash_cli.main(list(args))
        err = capsys.readouterr().err
        assert exited.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (args, err)


def test_tune_all_retunes_every_shipped_workload(records_dir, one_core, monkeypatch, tmp_path, capsys):
    """``tvmflash tune --all`` takes its workloads from the shipped records (tuning_logs/), each once;
    without --all, --head-dim is needed."""
    from tvmflash import cli as tvmflash_cli

    shipped = tmp_path / "shipped"
    record = database.new_record(CPU, "cpu", WORKLOAD, {"block_m": 16, "block_n": 32, "vector": 8}, 1.0)
    database.write(shipped / "some-gpu.json", [record, {**record, "device": "another"}])
    monkeypatch.setattr(database, "SHIPPED_DIR", shipped)
    assert tvmflash_cli.shipped_workloads() == [(32, "float32", False, "forward", 0, None)]
    assert tvmflash_cli.main(["tune", "--all", "--trials", "1", "--target", "cpu", "--seqlen", "64", "--batch", "1",
                              "--heads", "1"]) == 0
    out = capsys.readouterr().out
    assert "d32 float32 full" in out.split("== summary")[1]
    stored = [r for path, r in database.all_records() if path.parent == database.user_dir()]
    assert [(r["workload"], r["trials"]) for r in stored] == [(WORKLOAD, 1)]
    with pytest.raises(SystemExit) as exit_:
        tvmflash_cli.main(["tune", "--trials", "1"])
    assert exit_.value.code != 0 and "--head-dim" in capsys.readouterr().err
