"""``tvmflash bench --plot``: a figure of what one bench run measured. matplotlib is an optional
dependency (``pip install 'tvmflash[plot]'``), imported only here and only when a figure is drawn."""

from __future__ import annotations

import math
from pathlib import Path

# What matplotlib's Agg, SVG and PDF backends write: with no display and no GUI toolkit, as on a GPU server.
FORMATS = (".png", ".svg", ".pdf")

MISSING = ("--plot needs matplotlib, which is not installed: pip install 'tvmflash[plot]' (or pip install "
           "matplotlib); or save the run with --json FILE and draw it where matplotlib is: "
           "tvmflash bench --from-json FILE --plot OUT.png")


def check(path) -> None:
    """ValueError unless a figure can be drawn to ``path``: matplotlib present and a format it writes.
    Called before a run, so that minutes of measuring do not end in this error."""
    if Path(path).suffix.lower() not in FORMATS:
        raise ValueError(f"--plot: expected a file name ending in {', '.join(FORMATS)}, got {str(path)!r}")
    try:
        import matplotlib  # noqa: F401 - whether it is there
    except ImportError:
        raise ValueError(MISSING) from None


def plot(report, path) -> None:
    """Draw ``report`` (a ``bench.Report``) to ``path``: TFLOP/s against the sequence length, a panel
    per (head_dim, causal) the run covered, a line per backend (tvmflash's bold, a red x where its
    output failed the error check) and the square matmul's TFLOP/s of the same run as a dashed line;
    the title says the device, dtype, date, version and the copy bandwidth measured."""
    check(path)
    panels = sorted({(r.shape["head_dim"], r.shape["causal"]) for r in report.results})
    if not panels:
        raise ValueError("--plot: the report has no results to draw")
    figure, axes = _grid(len(panels), columns=4, width=4.2)
    ceilings = report.ceilings
    for (head_dim, causal), ax in zip(panels, axes):  # panels first: zip would take, and lose, one more ax
        results = sorted((r for r in report.results if (r.shape["head_dim"], r.shape["causal"]) == (head_dim, causal)),
                         key=lambda r: r.shape["seqlen"])
        seqlens = [r.shape["seqlen"] for r in results]
        for backend in results[0].times_ms:
            tflops = [r.flops / r.times_ms[backend] / 1e9 if r.times_ms.get(backend) else math.nan for r in results]
            ours = backend.startswith("tvmflash")
            ax.plot(seqlens, tflops, marker="o", linewidth=2.5 if ours else 1.2, label=backend)
        failed = [r for r in results if r.error > r.tolerance]
        if failed:
            ax.plot([r.shape["seqlen"] for r in failed], [r.flops / r.times_ms["tvmflash"] / 1e9 for r in failed],
                    "x", color="red", markersize=10, label="tvmflash over the error tolerance")
        n = ceilings.matmul_size
        ax.axhline(ceilings.matmul_tflops, color="gray", linestyle="--", label=f"{n}x{n} matmul, same run")
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens, labels=[str(s) for s in seqlens])
        ax.set_ylim(bottom=0)
        ax.set(title=f"d{head_dim}, {results[0].shape['heads']} heads, {'causal' if causal else 'non-causal'}",
               xlabel="sequence length", ylabel="TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes):  # a grid's unused cells
        ax.set_visible(False)
    figure.axes[0].legend(fontsize="small")
    figure.suptitle(f"tvmflash {report.version} against PyTorch SDPA, {report.dtype}, {report.date}\n{report.device}; "
                    f"in the same run: {ceilings.matmul_tflops:.1f} TFLOP/s matmul, copy {ceilings.copy_gbps:.0f} GB/s "
                    f"(read + write)")
    _save(figure, path)


def _grid(panels: int, columns: int, width: float):
    """(figure, its axes in reading order) for ``panels`` panels, at most ``columns`` a row."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state touched

    columns = min(columns, panels)
    rows = math.ceil(panels / columns)
    figure = Figure(figsize=(width * columns, 3.6 * rows + 0.8), layout="constrained")
    return figure, figure.subplots(rows, columns, squeeze=False).flat


def _save(figure, path) -> None:
    try:
        figure.savefig(path)
    except OSError as err:
        raise ValueError(f"--plot: cannot write {path}: {err.strerror or err}") from None


def plot_bandwidth(panels: dict, ceiling_gbps: float, title: str, path, xlabel: str = "keys a sequence") -> None:
    """A memory-bound kernel's figure (decode's: ``benchmarks/decode_bench.py --plot``): GB/s against a
    length, a panel per key of ``panels`` ({panel title: {line label: [(length, GB/s), ...]}}), a line per
    label (those starting "tvmflash" bold), and ``ceiling_gbps`` (a copy's GB/s in the same run, bytes
    read plus written) as a dashed line; ``title`` above all."""
    check(path)
    if not panels:
        raise ValueError("--plot: nothing measured to draw")
    figure, axes = _grid(len(panels), columns=3, width=4.4)
    for (name, lines), ax in zip(panels.items(), axes):
        lengths = sorted({length for points in lines.values() for length, _ in points})
        for label, points in lines.items():
            points = sorted(points)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                    linewidth=2.5 if label.startswith("tvmflash") else 1.2, label=label)
        ax.axhline(ceiling_gbps, color="gray", linestyle="--", label="copy, same run (read + write)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, labels=[f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
        ax.set_ylim(bottom=0)
        ax.set(title=name, xlabel=xlabel, ylabel="GB/s")
        ax.grid(alpha=0.3)
    for ax in list(axes):
        ax.set_visible(False)
    figure.axes[0].legend(fontsize="small")
    figure.suptitle(title)
    _save(figure, path)
