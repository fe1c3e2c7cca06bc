"""What a run shows as it goes: :class:`Reporter`, the live status from the first build on (a bar on a
terminal, else a line a trial), and :class:`Progress`, the measure callback that keeps the results."""

from __future__ import annotations

import collections
import math
import time

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from tvmflash.tune.space import configurations, decided_knobs

FAILED = 1e9  # MetaSchedule's run time for a failed candidate is 1e10 s


class Reporter:
    """The run's live status, from the first build on: each candidate built, each measurement as it
    comes (trials done of the total, failures, best so far, elapsed and estimated remaining time).

    With ``stream`` (a terminal) the status is one progress bar redrawn in place, and other lines
    (``note``) are printed above it; without, each trial is a plain line through ``echo``, which is
    what a log file or a pipe wants."""

    BAR_WIDTH = 24

    def __init__(self, trials: int, echo=print, stream=None):
        self.trials, self.echo, self.stream = trials, echo, stream
        self.done = self.failed = 0
        self.best_ms = math.inf
        self.start = time.perf_counter()

    def status(self) -> str:
        elapsed = time.perf_counter() - self.start
        # The remaining time assumes the trials left cost what the trials so far did on average.
        left = f", ~{elapsed / self.done * max(0, self.trials - self.done):.0f} s left" if self.done else ""
        best = f"{self.best_ms:.4f} ms" if self.best_ms < math.inf else "none yet"
        return f"{self.done}/{self.trials} trials, {self.failed} failed, best {best}, {elapsed:.0f} s{left}"

    def trial(self, run_ms: float | None, what: str) -> None:
        """One candidate measured (``run_ms``) or failed (None); ``what`` says which, for the log."""
        self.done += 1
        if run_ms is None:
            self.failed += 1
        else:
            self.best_ms = min(self.best_ms, run_ms)
        if self.stream is not None:
            self._draw()
        else:
            self.echo(f"  trial {self.done}: {what} ({self.status()})")

    def note(self, text: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if self.stream is None:
            self.echo(text)
            return
        self.stream.write(f"\r\x1b[K{text}\n")
        self._draw()

    def close(self) -> None:
        """Leave the last bar on its line, so what is printed next starts on a new one."""
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self) -> None:
        filled = round(self.BAR_WIDTH * min(self.done, self.trials) / max(1, self.trials))
        self.stream.write(f"\r\x1b[K[{'#' * filled}{'.' * (self.BAR_WIDTH - filled)}] {self.status()}")
        self.stream.flush()


def reason_gist(problem: str) -> str:
    """What a pre-check's message (``space.candidate_problem``) says without one configuration's
    particulars, to count the configurations left out by reason: its first clause (up to the first
    ", " or "; "), without the "knobs: " that every knob-set message starts with."""
    gist = problem.removeprefix("knobs: ")
    for separator in (", ", "; "):
        gist = gist.split(separator, 1)[0]
    return gist


def left_out_line(problems: list[str], total: int | None = None, details: str | None = None) -> str:
    """One line for the configurations the pre-check left out before building (``problems``, a message
    each), counted by reason (``reason_gist``), the most common first: what ``tvmflash tune`` printed
    a line each for, with each configuration's full name. ``total``: the configurations
    pre-checked; ``details``: where each one's message is."""
    of = f" of {total}" if total is not None else ""
    if not problems:
        return (f"pre-checked {total} configurations: none left out" if total is not None
                else "none left out before building")
    counts = collections.Counter(reason_gist(problem) for problem in problems)
    reasons = ", ".join(f'{count} for "{gist}"' for gist, count in counts.most_common())
    noun = "configuration" if (total if total is not None else len(problems)) == 1 else "configurations"
    return (f"left out {len(problems)}{of} {noun} before building: {reasons}"
            + (f" (each in {details})" if details else ""))


def last_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[-1] if lines else str(text)


@derived_object
class Progress(ms.measure_callback.PyMeasureCallback):
    """Prints trials done and the best time so far; remembers the best candidate's knobs."""

    def __init__(self, tasks: list[dict], trials: int, echo):
        self.tasks, self.trials, self.echo = tasks, trials, echo
        self.done = self.failed = 0
        self.best_ms, self.best_knobs = math.inf, None
        self.measured: dict[str, tuple[float, dict]] = {}  # each configuration's fastest run
        self.task_best: dict[int, float] = {}  # task id -> its fastest run (ms), for PromisingTasksFirst
        # task id -> the configurations measured (failed ones too); a task is exhausted once it has
        # measured them all or a search round of it found nothing new (PromisingTasksFirst skips it)
        self.task_measured: dict[int, set] = {}
        self.exhausted: set[int] = set()
        self.on_join: list = []  # called with the task id each time a task's batch comes back
        self.start = time.perf_counter()

    def ranked(self, n: int) -> list[tuple[float, dict]]:
        """The n fastest configurations measured: (ms, knobs), fastest first."""
        return sorted(self.measured.values(), key=lambda entry: entry[0])[:n]

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        task = self.tasks[task_id]
        for hook in self.on_join:
            hook(task_id)
        if not measure_candidates:
            self.exhausted.add(task_id)
            return
        for cand, built, ran in zip(measure_candidates, builder_results, runner_results):
            self.done += 1
            knobs = decided_knobs(cand.sch.trace, task["fixed"], task["sampled"], task.get("structures"))
            key = repr(sorted(knobs.items()))
            self.task_measured.setdefault(task_id, set()).add(key)
            secs = [float(s) for s in (ran.run_secs or [])]
            error = built.error_msg or ran.error_msg
            if error or not secs or max(secs) >= FAILED:
                self.failed += 1
                if self.failed <= 3:  # say why, briefly; the full message is in the work dir's logs
                    lines = [line for line in str(error or "no run time").splitlines() if line.strip()]
                    self.echo(f"  candidate failed ({task['name']}): {lines[-1] if lines else error}")
                continue
            ms_ = 1e3 * sum(secs) / len(secs)
            if key not in self.measured or ms_ < self.measured[key][0]:
                self.measured[key] = (ms_, knobs)
            self.task_best[task_id] = min(ms_, self.task_best.get(task_id, math.inf))
            if ms_ < self.best_ms:
                self.best_ms, self.best_knobs = ms_, knobs
        if len(self.task_measured[task_id]) >= configurations(task):
            self.exhausted.add(task_id)
        best = f"{self.best_ms:.4f} ms {self.best_knobs}" if self.best_knobs else "none yet"
        self.echo(f"[{self.done}/{self.trials} trials, {self.failed} failed, {time.perf_counter() - self.start:.0f} s] "
                  f"task {task['name']}: best so far {best}")
