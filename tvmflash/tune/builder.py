"""The builder: Kernel's build in MetaSchedule's workers (``ms_build``), each batch reported as it
goes and the one-configuration tasks built ahead at once (:class:`ProgressBuilder`)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder.local_builder import default_export
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

from tvmflash import lowering
from tvmflash.tune.progress import Reporter, last_line


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity: ``taskset`` splits a machine between
    several ``tvmflash tune`` processes, whose thread pools would otherwise each take every core)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def ms_build(mod, target, _params, **options):
    """MetaSchedule's f_build: the same build as Kernel's (runs in a builder worker process).

    Returns the runtime module: MetaSchedule's exporter takes that, not tvm.compile's Executable.
    """
    return lowering.build(mod, target, **options).mod


class PooledBuilder:
    """MetaSchedule's ``LocalBuilder`` (its ``build``), with its worker processes kept from batch to batch.

    ``LocalBuilder`` starts new workers for every batch, against a memory leak of long-lived ones; a
    worker imports TVM and tvmflash first, about 3 s on 2 CPU cores, as long as a CPU candidate's build,
    so a CPU tuning run spent most of its time starting processes. Here the pool is started again every
    ``restart_after`` batches, which bounds the leak, and at ``close``. Start it inside
    ``workers_import_this_tvmflash`` (its workers unpickle ``ms_build`` by reference)."""

    def __init__(self, max_workers: int, timeout_sec: float, f_build, restart_after: int = 8):
        self.max_workers, self.timeout_sec, self.f_build = max_workers, timeout_sec, f_build
        self.restart_after, self.pool, self.batches = restart_after, None, 0

    def build(self, build_inputs: list) -> list:
        if self.pool is None or self.batches >= self.restart_after:
            self.close()
            self.pool = PopenPoolExecutor(max_workers=self.max_workers, timeout=self.timeout_sec)
        self.batches += 1
        results = []
        jobs = [(self.f_build, b.mod, b.target) for b in build_inputs]
        for done in self.pool.map_with_error_catching(lambda job: _build_in_worker(*job), jobs):
            if done.status == StatusKind.COMPLETE:
                results.append(ms.builder.BuilderResult(done.value, None))
            elif done.status == StatusKind.TIMEOUT:
                results.append(ms.builder.BuilderResult(None, f"LocalBuilder: Timeout, killed after "
                                                              f"{self.timeout_sec} seconds"))
            else:
                results.append(ms.builder.BuilderResult(None, f"LocalBuilder: An exception occurred\n{done.value}"))
        return results

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        self.pool, self.batches = None, 0


def _build_in_worker(f_build, mod, target) -> str:
    """A builder worker's job, as ``LocalBuilder``'s: build ``mod`` and export it to a file (MetaSchedule's
    default export), whose path the runner loads."""
    return default_export(f_build(mod, target, None))


@contextlib.contextmanager
def workers_import_this_tvmflash():
    """Builder workers are fresh processes that unpickle ``ms_build`` by reference: make them
    import this tvmflash (a source checkout may not be the installed one)."""
    root = str(Path(__file__).resolve().parents[2])  # above tvmflash/ (not ``import tvmflash``: a floor above)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([root] + ([old] if old else []))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


@derived_object
class ProgressBuilder(ms.builder.PyBuilder):
    """MetaSchedule's builder, saying how many candidates are built as it goes. MetaSchedule runs
    the measure callbacks (``Progress``) only once every task's first batch is built and run, which
    with one configuration a task is most of a tuning run: without this it would be silent.

    MetaSchedule asks for one task's candidates at a time, so with one configuration a task the
    builds ran one after the other. ``build_ahead`` builds such tasks' modules all at once, on the
    inner builder's parallel workers, and ``build`` then hands each over when it is asked for."""

    def __init__(self, inner, reporter: Reporter):
        self.inner, self.reporter = inner, reporter
        self.built = self.failed = 0
        self.ahead: dict[int, list] = {}  # structural hash -> [(module, BuilderResult)]

    def build_ahead(self, mods: list, target) -> None:
        results = self._build([ms.builder.BuilderInput(mod, target) for mod in mods])
        for mod, result in zip(mods, results):
            self.ahead.setdefault(tvm_ffi.structural_hash(mod), []).append((mod, result))

    def build(self, build_inputs):
        results = [self._take_ahead(b.mod) for b in build_inputs]
        rest = iter(self._build([b for b, r in zip(build_inputs, results) if r is None]))
        results = [r if r is not None else next(rest) for r in results]
        for result in results:  # a candidate that failed to build never reaches the runner: its trial ends here
            if result.error_msg:
                self.reporter.trial(None, f"failed to build: {last_line(result.error_msg)}")
        return results

    def _take_ahead(self, mod):
        entries = self.ahead.get(tvm_ffi.structural_hash(mod), [])
        for i, (built_mod, result) in enumerate(entries):
            if tvm_ffi.structural_equal(built_mod, mod):
                return entries.pop(i)[1]
        return None

    def _build(self, inputs):
        if not inputs:
            return []
        # Said before the batch starts too: a GPU build takes seconds a candidate, on every core.
        self.reporter.note(f"  building {len(inputs)} candidates, {time.perf_counter() - self.reporter.start:.0f} s")
        results = self.inner.build(inputs)
        self.built += len(results)
        self.failed += sum(1 for r in results if r.error_msg)
        failed = f", {self.failed} failed to build" if self.failed else ""
        self.reporter.note(f"  built {self.built}/{self.reporter.trials} candidates{failed}, "
                           f"{time.perf_counter() - self.reporter.start:.0f} s")
        return results
