"""A run's log dir as numbers: its metrics.csv and eval.csv rows, its label, the runs a folder
holds (a ``psgrad bench --log-dir`` among them), and its time to an accuracy. ``psgrad plot``,
``psgrad compare`` and ``psgrad bench`` read runs through it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

NAN = float("nan")


class MetricsFileError(ValueError):
    """A metrics.csv or eval.csv that is not what a psgrad run writes."""


def read_rows(path: Path, needed: tuple[str, ...]) -> list[dict[str, float]]:
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


def read_run(log_dir: Path) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """A run's metrics.csv and eval.csv rows (``read_rows``). Raises ``FileNotFoundError``
    without a metrics.csv and ``MetricsFileError`` for one that holds no steps."""
    rows = read_rows(log_dir / "metrics.csv", ("step", "loss", "wall"))
    if not rows:
        if (log_dir / "metrics.csv").is_file():
            raise MetricsFileError(f"{log_dir / 'metrics.csv'}: no steps logged yet")
        raise FileNotFoundError(f"{log_dir}: no metrics.csv (was it a psgrad --log-dir?)")
    return rows, read_rows(log_dir / "eval.csv", ("step", "test_acc"))


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
    """The codec (with its feedback, and the down-link's codec), the topology other than ps and
    the local steps of the run's config.json, and the folder's name, e.g. ``sign:bucket=32+ef,
    down qsgd:levels=16, colocated, 32 local steps (runs/a)``; a bench row's whole spec (its
    row.txt) in place of them; the name alone when there is no readable config.json."""
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
    topology = f", {cfg['topology']}" if cfg.get("topology", "ps") != "ps" else ""
    local = f", {cfg['local_steps']} local steps" if cfg.get("local_steps") else ""
    return f"{cfg.get('codec', '?')}{fb}{down}{topology}{local} ({log_dir.name})"


def to_target(rows: list[dict], evals: list[dict], target: float) -> dict:
    """Time to accuracy from a run's metrics rows (one per step, in order) and evaluations.

    1. The first evaluation with test accuracy >= ``target`` names the step s it followed
       (0-based, as every ``step`` column): s + 1 steps to target.
    2. Seconds to target = the wall clock at the end of step s minus the seconds evaluation held
       training up before it (``paused``: a row that evaluates more often must not pay for it).
    3. Bytes to target = every byte sent in steps 0..s. Final accuracy = the last evaluation's.
    A run that never reaches the target has NaN for the first three.
    """
    out = {"target_steps": NAN, "target_seconds": NAN, "target_mb": NAN}
    out["final_acc"] = float(evals[-1]["test_acc"]) if evals else NAN
    by_step = {int(r["step"]): r for r in rows}
    held = 0.0
    for e in evals:
        if e["test_acc"] >= target:
            s = int(e["step"])
            if any(step not in by_step for step in range(s + 1)):
                raise ValueError(f"time to accuracy needs the metrics rows of steps 0..{s}; some are missing")
            out["target_steps"] = s + 1
            out["target_seconds"] = by_step[s]["wall"] - held
            out["target_mb"] = sum(by_step[i]["bytes_up"] + by_step[i]["bytes_down"] for i in range(s + 1)) / 1e6
            break
        held += paused(e)
    return out


def paused(evaluation: dict) -> float:
    """Seconds ``evaluation`` held training up (``paused_seconds``, else ``eval_seconds``: bench
    runs evaluate in the foreground, so that is all of it)."""
    return float(evaluation.get("paused_seconds", evaluation.get("eval_seconds", 0.0)))
