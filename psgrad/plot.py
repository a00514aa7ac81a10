"""``psgrad plot``: loss and accuracy of several runs against step, wall time and bytes sent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .runlogs import read_run, run_dirs, run_label


def matplotlib_problem(what: str) -> str | None:
    """Why ``what`` cannot draw (matplotlib, psgrad's ``plot`` extra, is not installed), or None."""
    if importlib.util.find_spec("matplotlib") is not None:
        return None
    return f"{what} needs matplotlib: pip install 'psgrad[plot]' (or pip install matplotlib)"


def image_format_problem(out: Path) -> str | None:
    """Why matplotlib cannot write ``out``: its suffix names no image format it knows; or None."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() in formats:
        return None
    return f"{out}: the suffix names the image's format, one of {', '.join(sorted(formats))}"


def plot_runs(log_dirs: list[Path], out: Path) -> Path:
    """One figure, 2 rows (train loss, test accuracy) x 3 columns (step, wall seconds, MB sent)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), squeeze=False)
    xs = (("step", "step", 1.0), ("wall", "wall time (s)", 1.0), ("mb", "MB sent (up+down, cumulative)", 1e-6))
    for log_dir in run_dirs(log_dirs):
        metrics, evals = read_run(log_dir)
        sent = 0.0
        for row in metrics:
            sent += row.get("bytes_up", 0) + row.get("bytes_down", 0)
            row["mb"] = sent
        by_step = {int(r["step"]): r for r in metrics}
        label = run_label(log_dir)
        for col, (key, title, scale) in enumerate(xs):
            axes[0][col].plot([r[key] * scale for r in metrics], [r["loss"] for r in metrics], label=label)
            points = [(by_step.get(int(e["step"]), metrics[-1])[key] * scale, e["test_acc"]) for e in evals]
            if points:
                axes[1][col].plot(*zip(*points, strict=True), marker="o", label=label)
            axes[1][col].set_xlabel(title)
    axes[0][0].set_ylabel("training loss")
    axes[1][0].set_ylabel("test accuracy")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
