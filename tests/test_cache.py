"""Built modules are cached on disk and a second process loads instead of rebuilding."""

import contextlib
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


TRUNCATE_SCRIPT = """
import os, warnings, torch, tvmflash
from tvmflash.kernels import build
kernel = tvmflash.compile(head_dim=32, dtype="float32", causal=True, target="cpu")
path = kernel.module(2, 1).path
q, k, v = torch.randn(1, 9, 2, 32), torch.randn(1, 7, 1, 32), torch.randn(1, 7, 1, 32)
for size in (1000, 4096, 20000):
    # cut short, as a full disk or a killed copy leaves it; a new file at the path, since this process
    # has the library it built mapped (cut in place, the next call through it would fault)
    with open(path, "rb") as f:
        head = f.read(size)
    with open(path + ".cut", "wb") as f:
        f.write(head)
    os.replace(path + ".cut", path)
    build._MODULES.clear()
    kernel.build.modules.clear()
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
    from tvmflash import kernels
    from tvmflash.kernels import build

    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_KERNELS", {})  # nothing built in another test's cache dir
    monkeypatch.setattr(build, "_MODULES", {})
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
        monkeypatch.setattr(build, "_MODULES", {})
        kernel.build.modules.clear()
        with pytest.warns(UserWarning, match="rebuilding cached module .*: its metadata"):
            assert kernel.module(1, 1).origin == "built"
    meta.write_text("garbage")
    assert cli.main(["cache", "clear"]) == 0
    assert "deleting 1 cached modules" in capsys.readouterr().out
    assert not os.path.exists(path)


def test_cross_compile_is_cached_on_disk(tmp_path, monkeypatch, caplog):
    """A cross-compile (no GPU to build a library for) took its 30-40 s every time, printing nothing,
    and was not written to the disk cache: its CUDA source is, and builds and loads are logged."""
    import logging

    from tvmflash import kernels
    from tvmflash.kernels import build

    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU, whatever this one is
    for fresh in range(2):  # a new process, as far as the kernels and modules in memory go
        monkeypatch.setattr(kernels, "_KERNELS", {})
        monkeypatch.setattr(build, "_MODULES", {})
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tvmflash"):
            kernel = tvmflash.compile(head_dim=32, dtype="float32", target="sm80", heads_q=2)
        module = kernel.module(2, 2)
        assert module.path and module.path.endswith("-source.cu") and "__global__" in module.source
        if fresh:
            assert module.origin == "disk cache" and module.source == source and "loaded" in caplog.text
        else:
            assert module.origin == "built" and "building d32 float32 hq2/hkv2 for cuda sm_80" in caplog.text
            source = module.source
    (entry,) = cache.list_modules()
    assert entry["path"] == module.path and "problem" not in entry


def test_cache_listing_tells_modules_apart(tmp_path, monkeypatch, capsys):
    """Modules of one spec built with other knobs (or targets, or code) were listed alike."""
    from tvmflash import cli
    from tvmflash import kernels
    from tvmflash.kernels import build

    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_KERNELS", {})
    monkeypatch.setattr(build, "_MODULES", {})
    for knobs in (None, {"block_m": 32}):
        tvmflash.compile(head_dim=32, dtype="float32", target="cpu", knobs=knobs, heads_q=3)
    assert cli.main(["cache", "ls"]) == 0
    lines = [line.split()[1:-3] for line in capsys.readouterr().out.splitlines() if " cpu " in line]
    assert len(lines) == 2 and lines[0] != lines[1], lines  # (key, size and date aside)


def test_in_memory_cache_returns_the_same_kernel():
    a = tvmflash.compile(head_dim=64, dtype=torch.float16, target="cpu")
    b = tvmflash.compile(head_dim=64, dtype="float16", target="cpu")
    assert a is b


def test_a_build_keeps_no_caller_tensors_alive(tmp_path, monkeypatch):
    """A module built during a call holds none of the call's tensors once it returns. TVMScript's
    parser keeps the Python stack where it parses in reference cycles (``inspect.stack()``), and
    with it every caller's frame: in training, the first step's activations stayed on the GPU until
    the next full garbage collection (+483 MiB of peak memory in examples/train_gpt.py at 2048
    tokens). ``tvmflash.tvmscript`` parses in a thread of its own, whose stack is its own."""
    import gc
    import weakref

    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    kernel = tvmflash.compile(head_dim=32, dtype=torch.float32, target="cpu", softcap=7.125)  # a key no other test builds

    def call():
        q = torch.randn(1, 8, 1, 32)
        kernel(q, q, q)
        return weakref.ref(q)

    gc.collect()
    gc.disable()  # only reference counting frees q now
    try:
        freed = call()() is None
    finally:
        gc.enable()
    assert kernel.module(1, 1).origin == "built" and freed


def test_a_packages_source_digest_covers_all_its_files(tmp_path):
    """A schedule split into a package (``schedules/sm90/``): editing any of its files, not only its
    ``__init__.py``, changes the build cache's key."""
    import types

    package = tmp_path / "schedule"
    (package / "part").mkdir(parents=True)
    for name in ("__init__.py", "knobs.py", "part/__init__.py", "part/forward.py"):
        (package / name).write_text(f"# {name}\n")
    module = types.ModuleType("schedule")
    module.__file__, module.__path__ = str(package / "__init__.py"), [str(package)]
    assert [p.relative_to(package).as_posix() for p in cache.source_files(module)] == [
        "__init__.py", "knobs.py", "part/__init__.py", "part/forward.py"]
    before = cache.source_digest(module)
    (package / "part" / "forward.py").write_text("# changed\n")
    assert cache.source_digest(module) != before
    plain = types.ModuleType("plain")
    plain.__file__ = str(package / "knobs.py")
    assert cache.source_files(plain) == [package / "knobs.py"]


def test_processes_that_need_one_module_build_it_once_and_a_corrupt_file_is_rebuilt(tmp_path, monkeypatch):
    """Two processes that need a module no one has built (the ranks of one job): the first to take its
    build lock builds it, the other waits and loads it from disk. The lock is held here until both wait
    for it. The cache's listing of the module says its spec and schedule; once its file is corrupt, it is
    rebuilt (here, nothing in memory: each new process imports TVM and torch, some 4 s of CPU)."""
    kernel = tvmflash.compile(head_dim=32, dtype="float32", causal=True, target="cpu", heads_q=2, heads_kv=1)
    key = kernel.build.key(kernel.spec(2, 1))
    env = dict(os.environ, TVMFLASH_CACHE_DIR=str(tmp_path))
    script = "import logging; logging.basicConfig(level=logging.INFO)\n" + SCRIPT
    with cache_dir_set(tmp_path), cache.build_lock(key):
        processes = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for _ in range(2)]
        waiting = [process.stderr.readline() for process in processes]  # each process's first log line
        assert all("waiting for another process to build" in line for line in waiting), waiting
    results = []
    for process in processes:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    modules = sorted((next(iter(r["info"]["modules"].values())) for r in results), key=lambda m: m["origin"])
    assert [m["origin"] for m in modules] == ["built", "disk cache"] and all(r["finite"] for r in results)
    path = modules[0]["path"]
    assert modules[1]["path"] == path and os.path.exists(path)

    monkeypatch.setenv("TVMFLASH_CACHE_DIR", str(tmp_path))
    (entry,) = cache.list_modules()
    assert entry["spec"] == {"head_dim": 32, "dtype": "float32", "causal": True, "heads_q": 2, "heads_kv": 1,
                             "window_left": -1, "window_right": -1, "softcap": 0.0, "alibi": False,
                             "varlen": False, "dropout": False, "flex": None, "sinks": False}
    assert entry["schedule"] == "cpu" and entry["bytes"] > 0 and entry["path"] == path

    with open(path, "wb") as f:
        f.write(b"not a shared library")
    from tvmflash import kernels
    from tvmflash.kernels import build

    monkeypatch.setattr(kernels, "_KERNELS", {})  # here, as a new process: nothing in memory
    monkeypatch.setattr(build, "_MODULES", {})
    q, k, v = torch.randn(1, 9, 2, 32), torch.randn(1, 7, 1, 32), torch.randn(1, 7, 1, 32)
    with pytest.warns(UserWarning, match="rebuilding cached module .*: it has 20 bytes"):
        kernel = tvmflash.compile(head_dim=32, dtype="float32", causal=True, target="cpu", heads_q=2, heads_kv=1)
        assert torch.isfinite(kernel(q, k, v)).all()
    (module,) = kernel.info()["modules"].values()
    assert module["origin"] == "built" and module["path"] == path


@contextlib.contextmanager
def cache_dir_set(path):
    previous = os.environ.get("TVMFLASH_CACHE_DIR")
    os.environ["TVMFLASH_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TVMFLASH_CACHE_DIR"]
        else:
            os.environ["TVMFLASH_CACHE_DIR"] = previous


def test_every_kernels_key_covers_every_program_source(monkeypatch):
    """A module's key digests the programs' sources (``kernels.build.PROGRAMS``), whichever kernel builds it:
    an edit to any program file (program_forward.py, the block-sparse walk) rebuilds the modules, never
    serves the old ones from the disk cache."""
    from pathlib import Path

    from tvmflash.kernels.build import PROGRAMS
    from tvmflash.kernels.fp8 import Fp8Kernel

    files = {f"tvmflash.{path.stem}" for path in Path(tvmflash.__file__).parent.glob("program*.py")}
    assert files | {"tvmflash.tvmscript"} == {module.__name__ for module in PROGRAMS}
    monkeypatch.setenv("TVMFLASH_GPU_UNCHECKED", "1")  # (the FP8 forward awaits its GPU check)
    kernels = [tvmflash.compile(head_dim=32, dtype="float32", target="cpu"),
               tvmflash.compile_backward(head_dim=32, dtype="float32", target="cpu"),
               tvmflash.compile_decode(head_dim=32, dtype="float32", target="cpu"), Fp8Kernel(64, False, "sm90")]
    for kernel in kernels:
        assert set(PROGRAMS) <= set(kernel.build.code), kernel
