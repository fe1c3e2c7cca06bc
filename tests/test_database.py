"""The tuning database (tvmflash/database.py): records, their keys and buckets, and what compile reads
of them (the tuned knobs; on sm_90a the choice of schedule is tests/test_choice.py's)."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import tvmflash
from conftest import cli
from tvmflash import choice, database
from tvmflash import target as targets
from tvmflash.schedules import SCHEDULES, cpu

CPU = targets.cpu_target()
WORKLOAD = {"head_dim": 32, "dtype": "float32", "causal": False}
DEFAULTS = cpu.SCHEDULE.forward.knobs.defaults()  # the cpu schedule's forward knobs


def lookup(target, schedule: str, workload: dict, seqlen_k: int | None = None) -> dict | None:
    """``database.lookup`` of the records whose knobs the schedule's forward takes (as compile reads them)."""
    return database.lookup(target, schedule, workload, seqlen_k, usable=SCHEDULES[schedule].forward.knobs.accepts)


def test_database_round_trip(cache_dir):
    rec = database.new_record(CPU, "cpu", WORKLOAD, {"block_m": 16, "block_n": 32, "vector": 8}, 2.0, trials=4)
    path = database.add(rec)
    assert database.read(path) == [rec]
    found = lookup(CPU, "cpu", WORKLOAD)
    assert found["knobs"] == rec["knobs"] and found["source"] == str(path) and found["trials"] == 4
    slower = {**rec, "knobs": {"block_m": 64}, "mean_ms": 3.0}
    database.add(slower)  # a slower record for the same key does not replace the faster one
    faster = {**rec, "knobs": {"block_m": 32}, "mean_ms": 1.0}
    database.add(faster)
    assert database.read(path) == [faster]
    assert lookup(CPU, "cpu", {**WORKLOAD, "causal": True}) is None


def test_records_of_other_sequence_lengths_never_compete(cache_dir, tmp_path):
    """A record tuned at 512 keys is always faster than one tuned at 4096: each seqlen bucket keeps
    its own best (in the database and in an export), and a lookup takes the record of the length's
    bucket, else the longest bucket's."""
    knobs = {name: dict(DEFAULTS, block_m=value) for name, value in (("long", 64), ("short", 16))}
    long_ = database.new_record(CPU, "cpu", WORKLOAD, knobs["long"], 2.0, shape={"seqlen_k": 4096})
    short = database.new_record(CPU, "cpu", WORKLOAD, knobs["short"], 0.2, shape={"seqlen_k": 512})
    path = database.add(long_)
    database.add(short)
    assert database.read(path) == [long_, short]
    assert database.record_id(long_) != database.record_id(short)
    assert lookup(CPU, "cpu", WORKLOAD)["knobs"] == knobs["long"]
    assert lookup(CPU, "cpu", WORKLOAD, seqlen_k=300)["knobs"] == knobs["short"]
    assert lookup(CPU, "cpu", WORKLOAD, seqlen_k=2048)["knobs"] == knobs["long"]
    database.add({**long_, "knobs": knobs["short"], "mean_ms": 1.5, "shape": {"seqlen_k": 8192}})  # same bucket, faster
    assert lookup(CPU, "cpu", WORKLOAD)["mean_ms"] == 1.5 and len(database.read(path)) == 2
    assert len(database.read(database.export_best(tmp_path / "export")[0])) == 2


def test_a_call_runs_the_knobs_tuned_for_its_key_lengths(cache_dir):
    """With records of two seqlen buckets, a kernel runs the longest bucket's knobs, and a call whose
    keys fall in the other bucket that bucket's, in a module of its own; no length builds twice."""
    knobs = {"long": dict(DEFAULTS, block_m=32, block_n=32), "short": dict(DEFAULTS, block_m=16, block_n=32)}
    database.add(database.new_record(CPU, "cpu", WORKLOAD, knobs["long"], 2.0, shape={"seqlen_k": 4096}))
    database.add(database.new_record(CPU, "cpu", WORKLOAD, knobs["short"], 0.2, shape={"seqlen_k": 512}))
    kern = tvmflash.compile(head_dim=32, dtype="float32", causal=False, target="cpu")
    info = kern.info()
    assert info["knobs"] == knobs["long"], info
    assert info["seqlen_buckets"]["seqlen_k <= 1024"]["knobs"] == knobs["short"], info
    short = kern.by_bucket[0]
    for seqlen_k, runs in ((53, short), (1100, kern), (700, short)):
        q, k, v = torch.randn(1, 37, 2, 32), torch.randn(1, seqlen_k, 2, 32), torch.randn(1, seqlen_k, 2, 32)
        ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        assert torch.allclose(kern(q, k, v), ref, atol=1e-4)
        assert list(runs.build.modules) == [(2, 2)]
    assert kern.build.modules[(2, 2)] is not short.build.modules[(2, 2)]


def test_records_never_cross_devices_or_targets(cache_dir):
    mine = database.device_key(CPU)
    # Another CPU's target, whatever this host is (on a znver4 host "llvm znver4" is the host's own).
    another_target = next(t for t in ("llvm znver4", "llvm sapphirerapids") if t != mine["target"])
    other = [
        {"target": another_target},  # same device file, other target
        {"device": mine["device"].replace("cores", "cores-other")},  # other CPU
        {"tvm": "0.26.0"},  # other TVM
        {"tvmflash": "0.0.1"},
        {"compute_capability": "9.0"},
    ]
    base = database.new_record(CPU, "cpu", WORKLOAD, {**DEFAULTS, "block_m": 16}, 1.0)
    path = database.user_dir() / f"{database.slug(mine['device'])}.json"
    database.write(path, [{**base, **o} for o in other])
    assert lookup(CPU, "cpu", WORKLOAD) is None
    assert lookup(CPU, "simt", WORKLOAD) is None
    # A record made for a GPU is never used for another GPU or for the CPU.
    h200 = {**base, "device": "NVIDIA H200", "compute_capability": "9.0", "target": "cuda sm_90a"}
    database.write(database.user_dir() / "nvidia-h200.json", [h200])
    sm90 = targets.cuda_target("sm90")
    assert lookup(sm90, "cpu", WORKLOAD) is None  # no GPU here: device "unknown-gpu"
    assert lookup(targets.cuda_target("sm80"), "cpu", WORKLOAD) is None
    # ...while the matching record is found.
    database.add(base)
    assert lookup(CPU, "cpu", WORKLOAD)["knobs"] == {**DEFAULTS, "block_m": 16}
    # A record without one of the schedule's knobs is from before the schedule had it: passed over
    # (this faster one also replaces the record above in the file, which keeps the best per key).
    database.add(database.new_record(CPU, "cpu", WORKLOAD, {"block_m": 32}, 0.5))
    assert lookup(CPU, "cpu", WORKLOAD) is None


def test_corrupt_database_is_skipped_with_a_warning(cache_dir):
    rec = database.new_record(CPU, "cpu", WORKLOAD, {"block_m": 16}, 1.0)
    path = database.add(rec)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # truncated
    with pytest.warns(UserWarning, match="skipping unreadable tuning database"):
        assert lookup(CPU, "cpu", WORKLOAD) is None
    with pytest.warns(UserWarning):
        kern = tvmflash.compile(head_dim=32, dtype="float32", target="cpu")
    assert kern.knobs_source == "defaults"
    path.write_text('{"format": 1, "records": "nope"}')
    with pytest.warns(UserWarning):
        assert database.read(path) == []


def test_records_with_wrong_fields_are_skipped_with_a_warning(cache_dir):
    """Valid JSON with wrong fields was listed, silently, as 'None None dNone ... nan ms'."""
    good = database.new_record(CPU, "cpu", WORKLOAD, {"block_m": 16}, 1.0)
    bad = [{"hello": 1}, {**good, "knobs": "fast"}, {**good, "mean_ms": "1 ms"}, {**good, "workload": {"head_dim": 32}}, 7]
    path = database.user_dir() / "records.json"
    database.write(path, [good, *bad])
    with pytest.warns(UserWarning, match=r"skipping record \d of tuning database") as caught:
        assert database.read(path) == [good]
    assert len(caught) == len(bad)
    for shipped in database.SHIPPED_DIR.glob("*.json"):  # the shipped records are all well formed
        data = json.loads(shipped.read_text())
        assert all(database.record_problem(r) is None for r in data["records"])
    done = cli("cache", "ls", env_dir=cache_dir)
    assert done.returncode == 0 and "None" not in done.stdout and "nan ms" not in done.stdout, done.stdout
    assert done.stderr.count("skipping record") == len(bad), done.stderr


def test_stored_defaults_are_not_called_tuned(cache_dir):
    """Where no candidate beat the defaults, tuning stores them: bench and info() called them tuned."""
    from tvmflash import bench

    database.add(database.new_record(CPU, "cpu", WORKLOAD, cpu.SCHEDULE.forward.knobs.defaults(32, dtype="float32"), 1.0))
    info = tvmflash.compile(head_dim=32, dtype="float32", target="cpu").info()
    assert info["knobs_source"].startswith("defaults (tuning found none faster: "), info
    lines = []
    bench.run(device="cpu", dtype="float32", head_dims=(32,), causal=(False,), seqlens=[32], tokens=32, hidden=64,
              repeat=1, echo=lines.append)
    assert lines[-1].startswith("kernel d32 full: cpu schedule, default knobs {"), lines


def test_concurrent_writers_keep_both_records(cache_dir):
    """Two processes add records to one file at once (this machine's record, made here: the writers then
    import tvmflash.database alone, not TVM)."""
    script = textwrap.dedent("""
        import json, sys
        from tvmflash import database
        record, writer = json.loads(sys.argv[1]), sys.argv[2]
        for i in range(15):
            wl = {"head_dim": 32, "dtype": "float32", "causal": False, "writer": writer, "i": i}
            database.add({**record, "workload": wl})
    """)
    record = json.dumps(database.new_record(CPU, "cpu", WORKLOAD, {"block_m": 16}, 1.0))
    procs = [subprocess.Popen([sys.executable, "-c", script, record, name]) for name in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    (path,) = database.user_dir().glob("*.json")
    records = json.loads(path.read_text())["records"]  # valid JSON
    assert sorted((r["workload"]["writer"], r["workload"]["i"]) for r in records) == \
        sorted((w, i) for w in "ab" for i in range(15))


def test_shipped_records_match_the_current_spaces():
    """Every record shipped in tuning_logs/ names each knob of its schedule's program as it is now, with
    values it takes (``KnobSet.accepts``: a record tuned on an older space is passed over at run time,
    so shipping one ships nothing)."""
    import json
    from pathlib import Path

    shipped = sorted((Path(__file__).resolve().parent.parent / "tuning_logs").glob("*.json"))
    assert shipped
    for path in shipped:
        for record in json.loads(path.read_text())["records"]:
            knobs = choice.record_knob_set(SCHEDULES[record["schedule"]], record["workload"])  # (FP8's too)
            missing = set(knobs.names) - set(record["knobs"])
            assert not missing, f"{path.name}: a {record['schedule']} record of {record['workload']} lacks {sorted(missing)}"
            assert knobs.accepts(record["knobs"]), (path.name, record["workload"], knobs.problem(record["knobs"]),
                                                    sorted(set(record["knobs"]) - set(knobs.names)))
