"""Built modules are cached on disk and a second process loads instead of rebuilding."""

import json
import os
import subprocess
import sys

import pytest
import torch

import tvmflash
from tvmflash import cache

SCRIPT = """
import json, torch, tvmflash
kernel = tvmflash.compile(head_dim=32, dtype="float32", causal=True, target="cpu", heads_q=2, heads_kv=1)
q, k, v = torch.randn(1, 9, 2, 32), torch.randn(1, 7, 1, 32), torch.randn(1, 7, 1, 32)
out = kernel(q, k, v)
print(json.dumps({"info": kernel.info(), "finite": bool(torch.isfinite(out).all())}))
"""


def run_in_new_process(cache_dir):
    env = dict(os.environ, TVMFLASH_CACHE_DIR=str(cache_dir))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_loads_from_disk(tmp_path):
    first = run_in_new_process(tmp_path)
    second = run_in_new_process(tmp_path)
    (module_1,) = first["info"]["modules"].values()
    (module_2,) = second["info"]["modules"].values()
    assert module_1["origin"] == "built" and module_2["origin"] == "disk cache"
    assert module_1["path"] == module_2["path"] and os.path.exists(module_2["path"])
    assert first["finite"] and second["finite"]


def test_corrupt_cache_file_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    first = run_in_new_process(tmp_path)
    (module,) = first["info"]["modules"].values()
    with open(module["path"], "wb") as f:
        f.write(b"not a shared library")
    again = run_in_new_process(tmp_path)
    (module,) = again["info"]["modules"].values()
    assert module["origin"] == "built"


TRUNCATE_SCRIPT = """
import warnings, torch, tvmflash
from tvmflash import kernel as kernels
kernel = tvmflash.compile(head_dim=32, dtype="float32", causal=True, target="cpu")
path = kernel.module(2, 1).path
q, k, v = torch.randn(1, 9, 2, 32), torch.randn(1, 7, 1, 32), torch.randn(1, 7, 1, 32)
for size in (1000, 4096, 20000):
    with open(path, "r+b") as f:  # cut in place, as a full disk or a killed copy leaves it
        f.truncate(size)
    kernels._MODULES.clear()
    kernel._modules.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = kernel.module(2, 1)
    assert module.origin == "built", module
    assert any(f"rebuilding cached module {path}: it has {size} bytes" in str(w.message) for w in caught), caught
    assert torch.isfinite(kernel(q, k, v)).all()
print("ok")
"""


def test_truncated_module_is_rebuilt_not_loaded(tmp_path):
    """A cached library cut short crashed the loader (a bus error, exit 135) in every later process:
    its size and hash are checked against its metadata before it is loaded."""
    env = dict(os.environ, TVMFLASH_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", TRUNCATE_SCRIPT], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_module_with_broken_metadata_is_listed_cleared_and_rebuilt(tmp_path, monkeypatch, capsys):
    """A module whose .json is garbage or missing is not loaded unchecked: it is rebuilt, and until
    then ``cache ls`` lists it as unusable and ``cache clear`` counts it."""
    from tvmflash import cli
    from tvmflash import kernel as kernels

    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_KERNELS", {})  # nothing built in another test's cache dir
    monkeypatch.setattr(kernels, "_MODULES", {})
    kernel = tvmflash.compile(head_dim=32, dtype="float32", target="cpu")
    path = kernel.module(1, 1).path
    meta = tmp_path / "modules" / (os.path.basename(path)[:-3] + ".json")
    for broken in ("garbage", None):
        if broken is None:
            meta.unlink()
        else:
            meta.write_text(broken)
        assert cli.main(["cache", "ls"]) == 0
        listed = capsys.readouterr().out
        assert "cached modules: 1" in listed and "unusable: its metadata" in listed, listed
        monkeypatch.setattr(kernels, "_MODULES", {})
        kernel._modules.clear()
        with pytest.warns(UserWarning, match="rebuilding cached module .*: its metadata"):
            assert kernel.module(1, 1).origin == "built"
    meta.write_text("garbage")
    assert cli.main(["cache", "clear"]) == 0
    assert "deleting 1 cached modules" in capsys.readouterr().out
    assert not os.path.exists(path)


def test_cache_listing(tmp_path, monkeypatch):
    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    run_in_new_process(tmp_path)
    (entry,) = cache.list_modules()
    assert entry["spec"] == {"head_dim": 32, "dtype": "float32", "causal": True, "heads_q": 2, "heads_kv": 1}
    assert entry["schedule"] == "cpu" and entry["bytes"] > 0


def test_in_memory_cache_returns_the_same_kernel():
    a = tvmflash.compile(head_dim=64, dtype=torch.float16, target="cpu")
    b = tvmflash.compile(head_dim=64, dtype="float16", target="cpu")
    assert a is b
