"""Run the GPU tests (``pytest -m gpu``; with ``--nvcc`` the tests of nvcc's whole compile of a kernel too, which
need nvcc and no GPU, so that any machine with nvcc runs them: ``TVMFLASH_NVCC_TESTS=1 pytest -m nvcc``) on
every core of the GPU machine: one pytest whose pytest-xdist
workers take tests as they free up (``--dist worksteal``), so that the kernels build in parallel (built
one after another they take over 9 minutes on a fresh H100) and no worker sits idle while another has a
queue of builds left. Then print the summary, the failures, and with ``--timeout`` the tests that did not
finish in time.

    python benchmarks/gpu_tests.py [--jobs 16] [--log FILE] [--timeout S] [--slowest N] [--nvcc] [PYTEST ARGS ...]

Each finished test's seconds, and the modules it built in them, go to the log's ``.times`` file (also
when the run is stopped), and the slowest are listed; each failing test's report goes to its
``.failures`` file as the test fails (a stopped run never prints pytest's own). With ``--save-times`` the
seconds go into tests/gpu_test_times.txt too, from which the suite starts its longest tests first
(tests/conftest.py).

The workers share one module cache (``TVMFLASH_CACHE_DIR``, a fresh temporary folder unless set), and a
module two of them need is built once (``cache.build_lock``). Exit status: 0 if every test ran and passed.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# "[gw3] [ 45%] PASSED tests/test_x.py::test_y[64-(8, 2)]": a test's id may hold spaces, up to the line's end
OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\s+(tests/.*?)\s*$", re.MULTILINE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--log", default=None, help="pytest's whole output (default: a temporary file)")
    parser.add_argument("--timeout", type=float, default=0, help="seconds after which the run is stopped")
    parser.add_argument("--slowest", type=int, default=15, help="how many of the slowest tests to list")
    parser.add_argument("--save-times", action="store_true",
                        help="merge the finished tests' seconds into tests/gpu_test_times.txt, the order in which "
                             "the suite starts its tests (the longest first); from a run on a fresh machine")
    parser.add_argument("--nvcc", action="store_true", help="also the tests marked nvcc (ptxas's reports)")
    args, pytest_args = parser.parse_known_args()
    marks = "gpu or nvcc" if args.nvcc else "gpu"
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", marks, *pytest_args],
                               capture_output=True, text=True)
    ids = [line for line in collected.stdout.splitlines() if "::" in line]
    if not ids:
        print(collected.stdout + collected.stderr)
        return 1
    os.environ.setdefault("TVMFLASH_CACHE_DIR", tempfile.mkdtemp(prefix="tvmflash-gpu-tests-"))
    log = Path(args.log or tempfile.mkstemp(prefix="tvmflash-gpu-tests-", suffix=".log")[1])
    times = log.with_suffix(".times")  # a line a finished test (tests/conftest.py): seconds, builds
    times.unlink(missing_ok=True)
    failures = log.with_suffix(".failures")  # each failing test's report as it fails (tests/conftest.py)
    failures.unlink(missing_ok=True)
    os.environ["TVMFLASH_TEST_TIMES"] = str(times)
    jobs = min(args.jobs, len(ids))
    # The cores shared out: thread pools (OpenMP's, torch's) of the machine's size in every worker
    # oversubscribe it jobs-fold, and the module builds then take several times as long (BENCHMARKS.md).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    print(f"{len(ids)} GPU tests on {jobs} workers; log in {log}", flush=True)
    start = time.time()
    with open(log, "w") as out:
        process = subprocess.Popen(pytest_command(jobs, len(ids), pytest_args, marks),
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            process.wait(timeout=args.timeout or None)
            stopped = False
        except subprocess.TimeoutExpired:  # the workers too: they are in its process group
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            stopped = True
    text = log.read_text()
    print_times(times, args.slowest)
    if args.save_times and times.exists():
        save_times(times, Path(__file__).resolve().parent.parent / "tests" / "gpu_test_times.txt")
    if failures.exists():
        print(f"failing tests' reports in {failures}")
    outcomes = {test: outcome for outcome, test in OUTCOME.findall(text)}
    for test, outcome in outcomes.items():
        if outcome in ("FAILED", "ERROR"):
            print(f"    {outcome} {test}")
    if not stopped:
        tail = text.strip().splitlines()
        print(tail[-1] if tail else "(no output)")
        return process.returncode
    counts = {}
    for outcome in outcomes.values():
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    unfinished = [test for test in ids if test not in outcomes]
    print(f"stopped after {args.timeout:.0f} s: "
          + ", ".join([*(f"{n} {what}" for what, n in counts.items()), f"{len(unfinished)} not finished"]))
    for test in unfinished:
        print(f"    {test}")
    print(f"in {time.time() - start:.0f} s")
    return 1


def pytest_command(jobs: int, tests: int, pytest_args: list, marks: str = "gpu") -> list:
    """The run of ``tests`` GPU tests on ``jobs`` workers. A worker that meets a sticky CUDA error ends after
    that test (tests/conftest.py) and pytest-xdist starts another: as many restarts as tests, since past its
    default (4 a worker) xdist stops the whole run, and the tests still queued never run nor show as failed."""
    return [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", marks, "-n", str(jobs),
            "--dist", "worksteal", "--max-worker-restart", str(tests), *pytest_args]


def read_times(times: Path) -> list:
    """The lines of a .times file (tests/conftest.py writes them) as (seconds, builds, build seconds, test
    id, the line); none if there is no file."""
    rows = []
    for line in (times.read_text().splitlines() if times.exists() else []):
        if line.strip():
            seconds, _, builds, _, build_seconds, _, test = line.split(None, 6)  # a test's id may hold spaces
            rows.append((float(seconds), int(builds), float(build_seconds), test, line))
    return rows


def print_times(times: Path, slowest: int) -> None:
    """Where the finished tests' time went: in all, in module builds, and the slowest tests."""
    rows = read_times(times)
    if not rows:
        return
    print(f"finished tests: {sum(r[0] for r in rows):.0f} worker-seconds, {sum(r[2] for r in rows):.0f} of them "
          f"building {sum(r[1] for r in rows)} modules; the slowest:")
    for seconds, builds, build_seconds, test, _ in sorted(rows, reverse=True)[:slowest]:
        print(f"    {seconds:6.1f} s ({builds} builds, {build_seconds:5.1f} s)  {test}")


def save_times(times: Path, saved: Path) -> None:
    """The run's .times lines over those of ``saved`` (one line a test, the run's where both have it)."""
    rows = {row[3]: row for path in (saved, times) for row in read_times(path)}
    saved.write_text("".join(f"{row[4]}\n" for row in sorted(rows.values(), key=lambda row: -row[0])))
    print(f"the tests' seconds merged into {saved}")


if __name__ == "__main__":
    sys.exit(main())
