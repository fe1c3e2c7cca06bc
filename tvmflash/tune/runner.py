"""The runner: MetaSchedule's, each measurement reported as it comes (:class:`ReportingRunner`), its
GPU timings taken one process at a time (``gpu_timing_lock``)."""

from __future__ import annotations

import os

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from tvmflash import cache, database
from tvmflash.tune.progress import FAILED, Reporter, last_line


def gpu_timing_lock():
    """Held while timing on this process's GPU(s): several ``tvmflash tune`` processes on one GPU
    then build their candidates in parallel but time them one at a time (a file lock under the
    cache dir, one per ``CUDA_VISIBLE_DEVICES`` value)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "-") or "none"
    return database.locked(cache.cache_dir() / f"gpu-timing-{visible}")


def timed_alone(rt_mod, device, evaluator_config, repeated_args):
    """MetaSchedule's f_run_evaluator (in a runner worker): the default one, under gpu_timing_lock."""
    with gpu_timing_lock():
        return ms.runner.local_runner.default_run_evaluator(rt_mod, device, evaluator_config, repeated_args)


@derived_object
class ReportedFuture(ms.runner.PyRunnerFuture):
    """A runner future that tells the Reporter about its measurement once, when MetaSchedule first
    sees it finished (it polls ``done`` between tasks) or asks for it."""

    def __init__(self, inner, reporter: Reporter):
        self.inner, self.reporter, self.reported = inner, reporter, None

    def done(self) -> bool:
        finished = self.inner.done()
        if finished:
            self.result()
        return finished

    def result(self):
        if self.reported is None:
            self.reported = result = self.inner.result()
            secs = [float(s) for s in (result.run_secs or [])]
            if result.error_msg or not secs or max(secs) >= FAILED:
                self.reporter.trial(None, f"failed to run: {last_line(result.error_msg or 'no run time')}")
            else:
                run_ms = 1e3 * sum(secs) / len(secs)
                self.reporter.trial(run_ms, f"{run_ms:.4f} ms")
        return self.reported


@derived_object
class ReportingRunner(ms.runner.PyRunner):
    """MetaSchedule's runner, each measurement reported as it comes (``ReportedFuture``): its
    measure callbacks see a whole batch at once, and only once it is joined."""

    def __init__(self, inner, reporter: Reporter):
        self.inner, self.reporter = inner, reporter

    def run(self, runner_inputs):
        return [ReportedFuture(future, self.reporter) for future in self.inner.run(runner_inputs)]
