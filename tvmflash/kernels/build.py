"""A kernel's modules: the cache key, the in-memory and disk caches, loading and building. Each kernel
owns one ``Build``, to which it passes what differs between kernels: which programs to build and
how they are scheduled, the functions to call in a module, and the key's extra fields."""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

# TVM's CPU thread pool starts with one thread per two cores; use every core torch uses, unless
# the user chose (TVM reads this when its pool starts, at the first CPU kernel call).
os.environ.setdefault("TVM_NUM_THREADS", str(torch.get_num_threads()))

import tvm  # noqa: E402

from tvmflash import (cache, lowering, program, program_backward, program_backward_tiles,  # noqa: E402
                      program_block_sparse, program_decode, program_dropout, program_e4m3, program_flex,
                      program_flex_gradient, program_forward, tvmscript)
from tvmflash import target as targets  # noqa: E402
from tvmflash.kernels.checks import check_strides, needs_int64  # noqa: E402
from tvmflash.schedules.contract import Schedule  # noqa: E402

# The programs' sources, in every module's key (``Build.code``): an edit to any of them rebuilds the modules
# (the programs call into one another, so each kernel's key covers them all)
PROGRAMS = (program, program_forward, program_backward, program_backward_tiles, program_decode, program_dropout,
            program_e4m3, program_flex, program_flex_gradient, program_block_sparse, tvmscript)

# Builds and loads are logged at INFO (the CLI shows them): a GPU build takes tens of seconds on a CPU.
logger = logging.getLogger("tvmflash")


@dataclass
class Module:
    """One built (or loaded) module: a spec with fixed head counts, for one target."""

    function: Any  # what to call (``Build``'s ``entry`` of the module); None if it can't run here
    source: str | None  # the generated CUDA source; None for the CPU or a module loaded from disk
    origin: str  # "built" or "disk cache"
    path: str | None  # where it is on disk, if anywhere
    seconds: float  # time to build or load


_MODULES: dict[str, Module] = {}  # in-memory cache: key -> module
_LOCK = threading.Lock()


def runnable_here(target: tvm.target.Target) -> bool:
    return not targets.is_cuda(target) or torch.cuda.is_available()


def version() -> str:
    """tvmflash's version (in every module's key)."""
    from tvmflash.version import __version__

    return __version__


class Build:
    """The modules of one kernel, one per (heads_q, heads_kv) and index width: from memory, else from
    disk, else built now.

    kind: what the modules compute ("forward", "backward", "decode"; the disk cache's metadata says
    it). spec(heads_q, heads_kv): the program's spec for these head counts. programs(spec): the
    programs for a spec, scheduled (a ``tvm.s_tir.Schedule``). entry(module): what a built or loaded
    module gives to call. code: the modules whose source shapes the build (their digest is in the
    key). options: what ``lowering.build`` takes. key_fields: more fields of the key (kept out where
    empty, so that other kernels' keys stay). outer: where given, the key is the digest of these
    fields and of the forward-like key (``"like the forward's"``), so another pass's kernel never
    shares a key with the forward's.
    """

    def __init__(self, *, kind: str, target: tvm.target.Target, schedule: Schedule, knobs: dict, variant: dict,
                 spec: Callable, programs: Callable, entry: Callable, code: tuple, options: dict,
                 key_fields: dict | None = None, outer: dict | None = None):
        self.kind, self.target, self.schedule, self.knobs, self.variant = kind, target, schedule, knobs, variant
        self.spec, self.programs, self.entry, self.code, self.options = spec, programs, entry, code, options
        self.key_fields, self.outer = key_fields or {}, outer
        self.modules: dict[tuple, Module] = {}  # by ``slot``
        self.last: tuple[int, int] | None = None  # the head counts of the last module asked for
        self.target_name = targets.describe(target)

    def code_digest(self) -> str:
        return cache.source_digest(*self.code)

    def key(self, spec, wide: bool = False) -> str:
        """The key of a spec's module (wide: the one that indexes in int64) in the caches."""
        key = cache.digest(
            {
                "tvmflash": version(),
                "tvm": tvm.__version__,
                "code": self.code_digest(),
                "spec": asdict(spec),
                "knobs": self.knobs,
                "target": str(self.target),
                **self.key_fields,
                **({"index_bits": 64} if wide else {}),  # an int64 module's own key; int32 ones keep theirs
            }
        )
        return key if self.outer is None else cache.digest({**self.outer, "like the forward's": key})

    @staticmethod
    def slot(heads_q: int, heads_kv: int, wide: bool = False) -> tuple:
        """A module's place in ``modules``: (heads_q, heads_kv), and "int64" for a wide one."""
        return (heads_q, heads_kv, "int64") if wide else (heads_q, heads_kv)

    def module(self, heads_q: int, heads_kv: int, wide: bool = False) -> Module:
        """The module for these head counts: from memory, else from disk, else built now. wide: the
        module that indexes its tensors in int64, for tensors of more than 2**31 elements
        (``needs_int64``); a module of its own, built on first use."""
        found = self.modules.get(self.slot(heads_q, heads_kv, wide))
        if found is not None:
            return found
        spec = self.spec(heads_q, heads_kv)
        key = self.key(spec, wide)
        with _LOCK:
            found = _MODULES.get(key)
            if found is None:
                found = self._load(key)
                if found is None:
                    found = self._build_once(spec, key, wide)
                logger.info("%s %s in %.1f s%s", "built" if found.origin == "built" else "loaded", found.path or "it",
                            found.seconds, "" if found.function else " (CUDA source only: no GPU here to build for)",
                            extra={"build_seconds": found.seconds if found.origin == "built" else 0.0})
                _MODULES[key] = found
        self.modules[self.slot(heads_q, heads_kv, wide)] = found
        self.last = (heads_q, heads_kv)
        return found

    def module_for(self, heads_q: int, heads_kv: int, **tensors) -> Module:
        """The module to run on these named tensors: built (or loaded) for the head counts, indexing in
        int64 where one holds more than 2**31 elements (``needs_int64``; their strides checked), and
        not cross-compiled."""
        wide = needs_int64(*tensors.values())
        if wide:
            check_strides(**tensors)
        return self.runnable(self.modules.get(self.slot(heads_q, heads_kv, wide)) or self.module(heads_q, heads_kv, wide))

    def runnable(self, module: Module) -> Module:
        """``module``, unless it was cross-compiled (an error: there is nothing to run)."""
        if module.function is None:
            raise RuntimeError(f"this {self.target_name} kernel was cross-compiled: there is no GPU here to run it on")
        if not self.schedule.prepare():  # once a process (cached): AMX's permission for the tile state
            raise RuntimeError(f"the {self.schedule.name} schedule's modules cannot run in this process: the host "
                               "refused what they need (AMX: Linux's permission for the tile state)")
        return module

    def _path(self, key: str) -> Path:
        """Where a module is cached: its library, or the CUDA source of a cross-compile (a file of its own:
        a GPU machine that shares the cache dir builds the library)."""
        return cache.module_dir() / (f"{key}.so" if runnable_here(self.target) else f"{key}-source.cu")

    def _load(self, key: str) -> Module | None:
        path = self._path(key)
        if not path.exists():
            return None
        problem = cache.module_problem(path)
        if problem:  # checked first: a truncated library can crash the loader (a bus error)
            warnings.warn(f"tvmflash: rebuilding cached module {path}: {problem}", stacklevel=4)
            return None
        start = time.perf_counter()
        if path.suffix == ".cu":
            return Module(None, path.read_text(), "disk cache", str(path), time.perf_counter() - start)
        try:
            function = self.entry(tvm.runtime.load_module(str(path)))
        except Exception as err:  # noqa: BLE001 - a broken cache file must not be fatal
            warnings.warn(f"tvmflash: ignoring unreadable cached module {path}: {err}", stacklevel=4)
            return None
        return Module(function, None, "disk cache", str(path), time.perf_counter() - start)

    def _build_once(self, spec, key: str, wide: bool) -> Module:
        """The module built under its key's lock (``cache.build_lock``), or loaded if another process
        built it while this one waited for the lock."""
        with cache.build_lock(key):
            found = self._load(key)
            if found is not None:
                return found
            variant = "".join(f" {name}={getattr(value, 'describe', value)}" for name, value in self.variant.items())
            what = (f"d{spec.head_dim} {spec.dtype}{' causal' if spec.causal else ''}{variant} "
                    f"hq{spec.heads_q}/hkv{spec.heads_kv}{' int64' if wide else ''}")
            logger.info("building %s for %s (%s schedule)...", what, self.target_name, self.schedule.name)
            return self._build(spec, key, wide)

    def _build(self, spec, key: str, wide: bool = False) -> Module:
        start = time.perf_counter()
        sch = self.programs(spec)
        executable = lowering.build(sch.mod, self.target, **self.options, wide_indices=wide)
        source = executable.mod.imports[0].inspect_source() if targets.is_cuda(self.target) else None
        seconds = time.perf_counter() - start
        runnable = runnable_here(self.target)
        path = self._path(key)
        try:
            meta = {"key": key, "pass": self.kind, "spec": asdict(spec), "knobs": self.knobs, "target": str(self.target),
                    "schedule": self.schedule.name, "tvm": tvm.__version__,
                    "tvmflash": version(), "code": self.code_digest(), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                    **({"index_bits": 64} if wide else {})}
            cache.write_module(path, executable.export_library if runnable else lambda tmp: Path(tmp).write_text(source),
                               meta)
        except Exception as err:  # noqa: BLE001 - caching is an optimisation, never a failure
            warnings.warn(f"tvmflash: could not write {path} to the disk cache: {err}", stacklevel=4)
            path = None
        return Module(self._runnable_entry(executable, path) if runnable else None, source, "built",
                      str(path) if path else None, seconds)

    def _runnable_entry(self, executable, path: Path | None):
        """The entry of the module just built: from the library just written (a dlopen), else from the
        executable in memory, whose first function lookup compiles its LLVM code once more (0.1-0.3 s
        of a 1-2 s CPU build)."""
        if path is not None:
            try:
                return self.entry(tvm.runtime.load_module(str(path)))
            except Exception:  # noqa: BLE001 - the executable in memory serves as well
                pass
        return self.entry(executable)

    def source(self, heads_q: int | None = None, heads_kv: int | None = None, wide: bool = False) -> str:
        """The generated CUDA source, built for these head counts (default: the last used, or 1/1);
        wide: of the module that indexes in int64 (``module``)."""
        if not targets.is_cuda(self.target):
            raise ValueError(f"source(): only CUDA targets have CUDA source; this kernel targets {self.target}")
        if heads_q is None:
            heads_q, heads_kv = self.last or (1, 1)
        module = self.module(heads_q, heads_kv if heads_kv is not None else heads_q, wide)
        if module.source is None:  # loaded from disk: build once more to see the source
            spec = self.spec(heads_q, heads_kv if heads_kv is not None else heads_q)
            module.source = self._build(spec, self.key(spec, wide), wide).source
        return module.source

    def scheduled_tir(self, heads_q: int = 1, heads_kv: int | None = None) -> str:
        """The scheduled TensorIR (TVMScript) for these head counts, before lowering."""
        return self.programs(self.spec(heads_q, heads_kv or heads_q)).mod.script()

    def info(self) -> dict:
        """Where each module came from, by head counts."""
        return {
            f"heads_q={slot[0]},heads_kv={slot[1]}{',int64' if len(slot) > 2 else ''}":
            {"origin": m.origin, "path": m.path, "seconds": round(m.seconds, 3)}
            for slot, m in self.modules.items()
        }


def describe(kernel, extra: dict | None = None, after: dict | None = None) -> dict:
    """A kernel's ``info()``: what it is (workload, variant, target, schedule and knobs, and where each
    came from), ``extra`` fields, where each of its modules came from (``Build.info``), then ``after``
    (a field already there keeps its place, with this value)."""
    described = {
        "head_dim": kernel.head_dim,
        "dtype": kernel.dtype,
        "causal": kernel.causal,
        **kernel.variant,
        "target": targets.describe(kernel.target),
        "schedule": kernel.schedule.name,
        "schedule_source": kernel.schedule_source,
        "knobs": dict(kernel.knobs),
        "knobs_source": kernel.knobs_source,
        **(extra or {}),
        "modules": kernel.build.info(),
    }
    described.update(after or {})
    return described
