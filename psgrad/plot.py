"""``psgrad plot``: loss and accuracy of several runs against step, wall time and bytes sent."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def _read(path: Path) -> list[dict[str, float]]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        rows = []
        for row in csv.DictReader(f):
            rows.append({k: float(v) for k, v in row.items() if k != "dataset" and v not in ("", None)})
        return rows


def run_label(log_dir: Path) -> str:
    config = log_dir / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        fb = f"+{cfg['feedback']}" if cfg.get("feedback", "none") != "none" else ""
        return f"{cfg.get('codec', '?')}{fb} ({log_dir.name})"
    return log_dir.name


def plot_runs(log_dirs: list[Path], out: Path) -> Path:
    """One figure, 2 rows (train loss, test accuracy) x 3 columns (step, wall seconds, MB sent)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), squeeze=False)
    xs = (("step", "step", 1.0), ("wall", "wall time (s)", 1.0), ("mb", "MB sent (up+down, cumulative)", 1e-6))
    for log_dir in log_dirs:
        metrics = _read(log_dir / "metrics.csv")
        if not metrics:
            raise FileNotFoundError(f"{log_dir}: no metrics.csv (was it a psgrad --log-dir?)")
        evals = _read(log_dir / "eval.csv")
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
