"""Run the GPU tests (``pytest -m gpu``) in several pytest processes at once, so that their kernels
build on every core of the GPU machine (built one after another they take over 9 minutes on a fresh
H200 machine), then print each process's summary as it ends, and one total.

    python benchmarks/gpu_tests.py [--jobs 8] [--log-dir DIR] [--timeout S] [PYTEST ARGS ...]   # e.g. tests/test_gpu.py

The processes share one module cache (``TVMFLASH_CACHE_DIR``, a fresh temporary folder unless set), so
a kernel that two tests need is mostly built once. Exit status: 0 if every process passed.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--log-dir", default=None, help="where each process's log goes (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=0,
                        help="seconds after which the processes still running are killed and their tests listed")
    args, pytest_args = parser.parse_known_args()
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu", *pytest_args],
                               capture_output=True, text=True)
    ids = [line for line in collected.stdout.splitlines() if "::" in line]
    if not ids:
        print(collected.stdout + collected.stderr)
        return 1
    os.environ.setdefault("TVMFLASH_CACHE_DIR", tempfile.mkdtemp(prefix="tvmflash-gpu-tests-"))
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="tvmflash-gpu-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    groups = [ids[i::args.jobs] for i in range(min(args.jobs, len(ids)))]
    print(f"{len(ids)} GPU tests in {len(groups)} processes; logs in {logs}", flush=True)
    start = time.time()
    pytest = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu"]  # -v: a line a test
    running = [(i, subprocess.Popen([*pytest, *group], stdout=open(logs / f"group{i}.log", "w"),
                                    stderr=subprocess.STDOUT))
               for i, group in enumerate(groups)]
    totals, failed, unfinished = {}, False, []
    while running:  # report each process as it ends
        time.sleep(1)
        over = args.timeout and time.time() - start > args.timeout
        for i, process in list(running):
            if process.poll() is None and not over:
                continue
            running.remove((i, process))
            if process.poll() is None:  # past --timeout: its tests did not all run
                process.kill()
                process.wait()
                text = (logs / f"group{i}.log").read_text()
                passed = [test for test in groups[i] if f"{test} PASSED" in text]
                unfinished += [test for test in groups[i] if test not in passed]
                totals["passed"] = totals.get("passed", 0) + len(passed)
                failed = True
                print(f"group {i}: killed after {args.timeout:.0f} s, {len(passed)} of its {len(groups[i])} passed")
                continue
            failed |= process.returncode != 0
            text = (logs / f"group{i}.log").read_text()
            summary = text.strip().splitlines()[-1] if text.strip() else "(no output)"
            print(f"group {i}: {summary}", flush=True)
            for line in text.splitlines():
                if line.startswith(("FAILED", "ERROR")):
                    print("   ", line)
            for count, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary):
                totals[what] = totals.get(what, 0) + int(count)
    print(", ".join(f"{count} {what}" for what, count in totals.items()), f"in {time.time() - start:.0f} s")
    if unfinished:  # passed or not: their processes' logs say how far they got
        print(f"{len(unfinished)} tests of the killed processes did not finish or did not pass:", *unfinished,
              sep="\n    ")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
