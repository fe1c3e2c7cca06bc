"""Where built modules live on disk, and how they are named."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """``$TVMFLASH_CACHE_DIR``, else ``~/.cache/tvmflash``."""
    return Path(os.environ.get("TVMFLASH_CACHE_DIR") or Path.home() / ".cache" / "tvmflash")


def module_dir() -> Path:
    return cache_dir() / "modules"


def digest(obj) -> str:
    """A stable hash of a JSON-able description."""
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def source_digest(*modules) -> str:
    """Hash of Python modules' source, so editing a program or schedule invalidates its builds."""
    h = hashlib.sha256()
    for module in modules:
        h.update(Path(module.__file__).read_bytes())
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


def list_modules() -> list[dict]:
    """Metadata of every module in the disk cache."""
    entries = []
    for meta in sorted(module_dir().glob("*.json")):
        try:
            entry = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        so = meta.with_suffix(".so")
        entry["path"] = str(so)
        entry["bytes"] = so.stat().st_size if so.exists() else 0
        entries.append(entry)
    return entries
