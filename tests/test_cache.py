"""Built modules are cached on disk and a second process loads instead of rebuilding."""

import json
import os
import subprocess
import sys

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
