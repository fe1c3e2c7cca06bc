"""Tuned knobs, per GPU: a small JSON database that never leaks records across GPUs.

A record says: on this GPU (name and compute capability) and target, with these tvmflash and TVM
versions, this schedule runs this workload (head_dim, dtype, causal, and "pass": "backward" or
"decode", with decode's cache layout "page_size", for those passes' knobs; the forward's have no
pass) fastest with these knobs, at
sequence lengths of its tuning shape's bucket (``SEQLEN_BUCKETS``).
The user's database (under the cache dir, written by ``tvmflash tune``) is layered over the
read-only logs shipped in ``tuning_logs/``; the user's records win.

Files are JSON, written atomically (write, then rename) under a file lock, so two tuners never
corrupt one. A corrupt or truncated file is reported with a warning and skipped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from tvmflash import cache

# TVM (and the targets, which import it) load where a record is made or looked up: listing, showing,
# exporting and clearing records (``tvmflash cache``) start in a fraction of a second without it.

FORMAT = 1
# What makes two records the same entry, with the sequence-length bucket of their tuning shape
# (``bucket``): one best record per key.
KEY_FIELDS = ("device", "compute_capability", "target", "tvm", "tvmflash", "schedule", "workload")
# Records tuned at different sequence lengths never compete on time (a shorter one always looks
# faster): each bucket of seqlen_k keeps its own best, up to and above these bounds.
SEQLEN_BUCKETS = (1024,)
_UNSHAPED_SEQLEN = 4096  # a record without a shape was tuned at the GPU grid's default


def _shipped_dir() -> Path:
    """The shipped logs: ``tvmflash/tuning_logs`` when installed (package data), else the source
    checkout's top-level ``tuning_logs/`` (which is also where an editable install finds them)."""
    here = Path(__file__).resolve().parent
    installed = here / "tuning_logs"
    return installed if installed.is_dir() else here.parent / "tuning_logs"


SHIPPED_DIR = _shipped_dir()


def device_key(target) -> dict:
    """What a record is keyed by, besides the workload: the device, the target and the versions."""
    import tvm

    from tvmflash.version import __version__
    from tvmflash import target as targets

    if targets.is_cuda(target):
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "unknown-gpu"
        major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
        device = {"device": name, "compute_capability": f"{major}.{minor}"}
    else:
        device = {"device": f"cpu-{target.attrs.get('mcpu', 'generic')}-{target.attrs.get('num-cores', 1)}cores",
                  "compute_capability": None}
    return {**device, "target": targets.describe(target), "tvm": tvm.__version__, "tvmflash": __version__}


def slug(device_name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': the file name for one device's records."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def user_dir() -> Path:
    return cache.cache_dir() / "tuning"


# The fields a record must have, and their types (``read`` skips a record that lacks one).
RECORD_FIELDS = {"device": str, "target": str, "tvm": str, "tvmflash": str, "schedule": str, "workload": dict,
                 "knobs": dict, "mean_ms": (int, float)}
WORKLOAD_FIELDS = {"head_dim": int, "dtype": str, "causal": bool}


def record_problem(record) -> str | None:
    """None for a well-formed record, else what is wrong with it."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    for fields, where in ((RECORD_FIELDS, record), (WORKLOAD_FIELDS, record.get("workload", {}))):
        for name, kind in fields.items():
            value = where.get(name)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                return f"field {name!r}: expected {getattr(kind, '__name__', 'a number')}, got {value!r}"
    if not (math.isfinite(record["mean_ms"]) and record["mean_ms"] > 0):
        return f"field 'mean_ms': expected a positive time, got {record['mean_ms']!r}"
    return None


def read(path: Path) -> list[dict]:
    """The well-formed records in one file (``record_problem``); [] with a warning if the file is
    missing a piece or is not JSON, and a warning for each record skipped."""
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or not isinstance(data.get("records"), list):
            raise ValueError(f"expected {{'format': {FORMAT}, 'records': [...]}}")
    except (OSError, ValueError, AttributeError) as err:
        warnings.warn(f"tvmflash: skipping unreadable tuning database {path}: {err}", stacklevel=2)
        return []
    records = []
    for n, record in enumerate(data["records"]):
        problem = record_problem(record)
        if problem:
            warnings.warn(f"tvmflash: skipping record {n} of tuning database {path}: {problem}", stacklevel=2)
        else:
            records.append(record)
    return records


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock beside ``path`` for a read-modify-write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(path.suffix + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write(path: Path, records: list[dict]) -> None:
    text = json.dumps({"format": FORMAT, "records": records}, indent=1, sort_keys=True)
    cache.atomic_write(path, lambda tmp: Path(tmp).write_text(text + "\n"))


def seqlen_bucket(seqlen_k: int) -> int:
    """The bucket of a key length: how many of ``SEQLEN_BUCKETS`` lie below it."""
    return sum(seqlen_k > bound for bound in SEQLEN_BUCKETS)


def bucket_seqlens() -> list[int]:
    """A key length in each bucket, in bucket order."""
    return [*SEQLEN_BUCKETS, SEQLEN_BUCKETS[-1] + 1]


def bucket_label(index: int) -> str:
    """'seqlen_k <= 1024', 'seqlen_k > 1024'."""
    return f"seqlen_k <= {SEQLEN_BUCKETS[index]}" if index < len(SEQLEN_BUCKETS) else f"seqlen_k > {SEQLEN_BUCKETS[-1]}"


def bucket(record: dict) -> int:
    """The seqlen bucket of the shape a record was tuned at."""
    return seqlen_bucket((record.get("shape") or {}).get("seqlen_k", _UNSHAPED_SEQLEN))


def _same_fields(a: dict, b: dict) -> bool:
    return all(a.get(f) == b.get(f) for f in KEY_FIELDS)


def same_key(a: dict, b: dict) -> bool:
    """Whether two records are for the same entry (``KEY_FIELDS`` and ``bucket``): one best record
    is kept per key."""
    return _same_fields(a, b) and bucket(a) == bucket(b)


def record_id(record: dict) -> str:
    """A short, stable name for a record's key (what ``tvmflash cache show`` takes)."""
    return cache.digest({**{f: record.get(f) for f in KEY_FIELDS}, "bucket": bucket(record)})[:12]


def add(record: dict, path: Path | None = None, replace: bool = False) -> Path:
    """Add a record to the user's database, in place of its key's record if faster, or whatever their
    times with ``replace`` (the tuner's, which timed the old record's knobs in the same run). Returns
    the file written."""
    path = path or user_dir() / f"{slug(record['device'])}.json"
    with locked(path):
        records = read(path)
        old = next((r for r in records if same_key(r, record)), None)
        if old is None or replace or record["mean_ms"] < old["mean_ms"]:
            records = [r for r in records if r is not old] + [record]
            write(path, records)
    return path


def lookup(target, schedule: str, workload: dict, seqlen_k: int | None = None, *,
           usable: Callable[[dict], bool]) -> dict | None:
    """The best record for this device, target, versions, schedule and workload, or None.

    The user's records are searched first, then the shipped ones. ``usable(knobs)``: whether a
    record's knobs are the schedule's as it is now (``KnobSet.accepts``). ``seqlen_k``: the record of
    its bucket where there is one; otherwise, and by default, that of the longest bucket.
    """
    found = known_records(target, schedule, workload, seqlen_k, usable=usable)
    return found[0] if found else None


def known_records(target, schedule: str, workload: dict, seqlen_k: int | None = None, *,
                  usable: Callable[[dict], bool]) -> list[dict]:
    """The best usable record of the user's database, then the shipped one's (each with its
    ``source``, the file): what a warm ``tvmflash tune`` starts from. A record whose knobs are not
    ``usable`` is passed over: tuned before one of the schedule's knobs existed, or with a value the
    schedule does not take, it measured a schedule that its knobs would not build now. Of a file's
    records, those of ``seqlen_k``'s bucket if it has any, else those of its longest bucket."""
    want = {**device_key(target), "schedule": schedule, "workload": workload}
    name = slug(want["device"]) + ".json"
    found = []
    for path in (user_dir() / name, SHIPPED_DIR / name):
        matches = [r for r in read(path) if _same_fields(r, want) and usable(r["knobs"])]
        buckets = {bucket(r) for r in matches}
        if matches:
            wanted = seqlen_bucket(seqlen_k) if seqlen_k is not None and seqlen_bucket(seqlen_k) in buckets \
                else max(buckets)
            matches = [r for r in matches if bucket(r) == wanted]
            found.append({**min(matches, key=lambda r: r["mean_ms"]), "source": str(path)})
    return found


def all_records() -> list[tuple[Path, dict]]:
    """Every record in the user's and the shipped databases, with its file."""
    out = []
    for folder in (user_dir(), SHIPPED_DIR):
        for path in sorted(folder.glob("*.json")):
            out += [(path, r) for r in read(path)]
    return out


def export_best(out_dir: Path | None = None) -> list[Path]:
    """Merge the user's records into ``out_dir`` (default: the shipped logs), keeping the best per key.

    Records already in ``out_dir`` for other keys (other workloads, versions) are kept.
    """
    out_dir = Path(out_dir or SHIPPED_DIR)
    written = []
    for path in sorted(user_dir().glob("*.json")):
        dest = out_dir / path.name
        with locked(dest):
            best: dict = {}
            for r in read(dest) + read(path):
                key = record_id(r)
                if key not in best or r["mean_ms"] < best[key]["mean_ms"]:
                    best[key] = r
            write(dest, list(best.values()))
        written.append(dest)
    return written


def new_record(target, schedule: str, workload: dict, knobs: dict, mean_ms: float, **extra) -> dict:
    """A record for this machine (``device_key(target)``); ``extra`` fields (shape, trials...) ride along."""
    return {**device_key(target), "schedule": schedule, "workload": workload, "knobs": knobs,
            "mean_ms": mean_ms, "created": time.strftime("%Y-%m-%d %H:%M:%S"), **extra}
