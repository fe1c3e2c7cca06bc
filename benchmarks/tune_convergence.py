"""Best-so-far against trials, from the logs of ``tvmflash tune`` runs, drawn as one PNG.

    python benchmarks/tune_convergence.py warm.txt=warm cold.txt=cold --reference 0.879=defaults --out plot.png

Each LOG[=LABEL] is what ``tvmflash tune`` printed to a file or pipe (plain lines, one a trial:
``trial N: ... (N/M trials, F failed, best X ms, ...)``); a run cut short plots the trials it logged.
The times are MetaSchedule's, at the tuning shape. ``--reference MS=LABEL`` draws a horizontal line
(say, the defaults' time in the same run). Needs matplotlib, which tvmflash itself does not.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

TRIAL = re.compile(r"trial (\d+): .*\((\d+)/\d+ trials, (\d+) failed, best ([\d.]+) ms")


def best_so_far(text: str) -> list[tuple[int, float]]:
    """(trials done, best ms so far) for each logged trial that has a best."""
    return [(int(m.group(2)), float(m.group(4))) for m in TRIAL.finditer(text)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="LOG or LOG=LABEL")
    parser.add_argument("--reference", action="append", default=[], help="MS=LABEL: a horizontal line")
    parser.add_argument("--title", default="tvmflash tune: best so far")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for spec in args.logs:
        path, _, label = spec.partition("=")
        points = best_so_far(Path(path).read_text())
        if not points:
            raise SystemExit(f"{path}: no trial lines")
        ax.step(*zip(*points), where="post", marker=".", label=label or Path(path).stem)
        print(f"{label or path}: {points[-1][0]} trials, best {points[-1][1]:.4f} ms")
    for spec in args.reference:
        ms, _, label = spec.partition("=")
        ax.axhline(float(ms), linestyle="--", color="gray", linewidth=1)
        ax.annotate(label, (ax.get_xlim()[1], float(ms)), ha="right", va="bottom", color="gray")
    ax.set_xlabel("trials measured")
    ax.set_ylabel("best so far, ms (MetaSchedule, tuning shape)")
    ax.set_title(args.title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
