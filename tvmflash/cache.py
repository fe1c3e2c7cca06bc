"""Where built modules live on disk, and how they are named."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no lock, at worst two processes build the same module
    fcntl = None

logger = logging.getLogger("tvmflash")


def cache_dir() -> Path:
    """``$TVMFLASH_CACHE_DIR``, else ``~/.cache/tvmflash``."""
    return Path(os.environ.get("TVMFLASH_CACHE_DIR") or Path.home() / ".cache" / "tvmflash")


def module_dir() -> Path:
    return cache_dir() / "modules"


def digest(obj) -> str:
    """A stable hash of a JSON-able description."""
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def source_files(module) -> list[Path]:
    """A module's source: its file, or for a package (a schedule split by role) all of its .py
    files, sorted."""
    path = Path(module.__file__)
    if not hasattr(module, "__path__"):
        return [path]
    return sorted(path.parent.rglob("*.py"))


def source_digest(*modules) -> str:
    """Hash of Python modules' source, so editing a program or schedule invalidates its builds. A
    package's source is all its .py files, sorted: a schedule package's roles are separate files."""
    h = hashlib.sha256()
    for module in modules:
        for path in source_files(module):
            h.update(path.read_bytes())
    return h.hexdigest()[:20]


def atomic_write(path: Path, write) -> None:
    """Call ``write(tmp_path)``, then rename the result to ``path``: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# What a module's file may be: a built library, or the CUDA source of a cross-compile (no GPU here
# to build a library for).
MODULE_SUFFIXES = (".so", ".cu")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_module(path: Path, write, meta: dict) -> None:
    """Write a module's file (``write(tmp_path)``), then its metadata beside it (``.json``), last:
    ``meta`` plus the file's size and hash, which ``module_problem`` checks before the file is used."""
    atomic_write(path, write)
    meta = {**meta, "bytes": path.stat().st_size, "sha256": file_digest(path)}
    atomic_write(path.with_suffix(".json"), lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=1)))


@contextlib.contextmanager
def build_lock(key: str):
    """Held while the module ``key`` is built, by one process at a time: another process that needs it
    (a rank of the same job, a test process) waits here, then loads what the first built instead of
    building it again. A lock on a file (``.KEY.lock`` in the module folder), which the system releases
    if its holder dies."""
    if fcntl is None:
        yield
        return
    path = module_dir() / f".{key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to build %s...", key)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_meta(path: Path) -> tuple[dict | None, str | None]:
    """A module file's metadata and None, or None and what is wrong with it (missing, not JSON,
    without the size and hash ``write_module`` records)."""
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
    except FileNotFoundError:
        return None, "its metadata (.json) is missing"
    except (OSError, ValueError) as err:
        return None, f"its metadata (.json) is unreadable: {err}"
    if not (isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and isinstance(meta.get("sha256"), str)):
        return None, "its metadata (.json) lacks the file's size and hash"
    return meta, None


def module_problem(path: Path) -> str | None:
    """None if the module file at ``path`` is whole (the size and hash its metadata recorded), else
    why not. Loading a truncated shared library can kill the process (a bus error inside the loader),
    so nothing is loaded before this check passes."""
    meta, problem = read_meta(path)
    if problem:
        return problem
    try:
        size = path.stat().st_size
        if size != meta["bytes"]:
            return f"it has {size} bytes, its metadata says {meta['bytes']}"
        if file_digest(path) != meta["sha256"]:
            return "its hash differs from its metadata's"
    except OSError as err:
        return f"it is unreadable: {err}"
    return None


def list_modules() -> list[dict]:
    """Every module in the disk cache: its metadata, path and size; ``problem`` says what is wrong
    with a module whose file or metadata is missing, unreadable or mismatched (it is rebuilt when used)."""
    folder = module_dir()
    stems = sorted({p.stem for p in folder.glob("*") if p.suffix in (*MODULE_SUFFIXES, ".json")
                    and not p.name.startswith(".tmp-")}) if folder.is_dir() else []
    entries = []
    for stem in stems:
        files = [folder / f"{stem}{suffix}" for suffix in MODULE_SUFFIXES if (folder / f"{stem}{suffix}").exists()]
        meta, problem = read_meta(folder / f"{stem}.json")
        entry = {"key": stem, **(meta or {})}
        if not files:
            entry.update(path=None, bytes=0, problem="its module file is missing")
        else:
            entry.update(path=str(files[0]), bytes=files[0].stat().st_size)
            problem = problem or module_problem(files[0])
            if problem:
                entry["problem"] = problem
        entries.append(entry)
    return entries
