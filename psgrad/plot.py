"""``psgrad plot``: loss and accuracy of several runs against step, wall time and bytes sent."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path


class MetricsFileError(ValueError):
    """A metrics.csv or eval.csv that is not what a psgrad run writes."""


def _read(path: Path, needed: tuple[str, ...]) -> list[dict[str, float]]:
    """The rows of a run's CSV file as numbers (the ``dataset`` label aside); [] if it is not
    there. Raises ``MetricsFileError`` naming the file and line when a ``needed`` column is
    missing or a value is not a number."""
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [name for name in needed if name not in (reader.fieldnames or [])]
        if missing:
            raise MetricsFileError(f"{path}: missing column(s) {', '.join(missing)} (is it a psgrad run's file?)")
        rows = []
        for row in reader:
            try:
                rows.append({k: float(v) for k, v in row.items() if k != "dataset" and v not in ("", None)})
            except (TypeError, ValueError):
                raise MetricsFileError(f"{path}, line {reader.line_num}: a value is not a number") from None
        return rows


def run_dirs(given: list[Path]) -> list[Path]:
    """The runs to draw: each given folder that holds a metrics.csv, and in place of one that
    does not, the folders in it that do (a ``psgrad bench --log-dir``: its rows that trained,
    not its DDP and compute-only rows, which log no steps); a folder with neither stays, for
    ``plot_runs`` to refuse."""
    runs: list[Path] = []
    for folder in given:
        inside = [] if (folder / "metrics.csv").exists() else sorted(folder.glob("*/metrics.csv"))
        runs += [path.parent for path in inside] or [folder]
    return runs


def rows_not_drawn(given: list[Path]) -> list[str]:
    """The rows of a ``psgrad bench --log-dir`` among ``given`` that ``run_dirs`` leaves out: those
    with a row.txt (or job.log) and no metrics.csv (DDP and compute-only rows, and rows through
    your own loop, log no steps)."""
    return [
        inside.name
        for folder in given
        if not (folder / "metrics.csv").exists()
        for inside in sorted(folder.iterdir() if folder.is_dir() else [])
        if inside.is_dir() and not (inside / "metrics.csv").exists()
        and ((inside / "row.txt").exists() or (inside / "job.log").exists())
    ]  # fmt: skip


def run_label(log_dir: Path) -> str:
    """The codec (with its feedback, and the down-link's codec) of the run's config.json and the
    folder's name, e.g. ``sign:bucket=32+ef, down qsgd:levels=16 (runs/a)``; a bench row's whole
    spec (its row.txt) in place of the codec; the name alone when there is no readable config.json."""
    if (row := log_dir / "row.txt").is_file():
        return f"{row.read_text().strip()} ({log_dir.name})"
    config = log_dir / "config.json"
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError):
        return log_dir.name
    if not isinstance(cfg, dict):
        return log_dir.name
    fb = f"+{cfg['feedback']}" if cfg.get("feedback", "none") != "none" else ""
    down = f", down {cfg['down_codec']}" if cfg.get("down_codec", "none") != "none" else ""
    return f"{cfg.get('codec', '?')}{fb}{down} ({log_dir.name})"


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
        metrics = _read(log_dir / "metrics.csv", ("step", "loss", "wall"))
        if not metrics:
            if (log_dir / "metrics.csv").is_file():
                raise MetricsFileError(f"{log_dir / 'metrics.csv'}: no steps logged yet")
            raise FileNotFoundError(f"{log_dir}: no metrics.csv (was it a psgrad --log-dir?)")
        evals = _read(log_dir / "eval.csv", ("step", "test_acc"))
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
