"""``psgrad compare``: runs side by side, ranked by their time to one test accuracy.

1. Each run's figures come from its log dir (``runlogs``): the steps logged, the wall clock at
   the last one, the mean MB sent per step, the last and the best test accuracy, the data scored.
2. The target is the accuracy asked for, or else the highest one every evaluated run reached (the
   lowest of their best accuracies), so that every such run has a time to it.
3. Each run's steps, seconds and MB to the target come from ``runlogs.to_target``, which leaves
   evaluation pauses out of the clock.
4. The runs are ranked by seconds to the target, each with its time as a multiple of the fastest
   run's; the runs that never reached it come last, then the runs never evaluated.
5. A default target that lies ``LOW_TARGET_GAP`` or more below another run's best accuracy is
   said (``low_target_note``): there a run that stops learning early can rank first.
"""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from .runlogs import read_run, run_label, to_target


@dataclass(frozen=True)
class RunFigures:
    """One run's figures (accuracies NaN when it was never evaluated)."""

    log_dir: str
    label: str
    data: str
    steps: int
    seconds: float
    mb_per_step: float
    last_acc: float
    best_acc: float
    evals: tuple[dict, ...]
    rows: tuple[dict, ...]

    @property
    def evaluated(self) -> bool:
        return bool(self.evals)


def _data_label(log_dir: Path) -> str:
    """The data the run was scored on, as its eval.csv names it ("synthetic", "proxy (synthetic)",
    "digits", ...); "?" without an evaluation."""
    path = log_dir / "eval.csv"
    if not path.is_file():
        return "?"
    with open(path, newline="") as f:
        names = [row.get("dataset") or "?" for row in csv.DictReader(f)]
    return names[-1] if names else "?"


def figures(log_dir: Path) -> RunFigures:
    """The figures of the run logged in ``log_dir``. Raises ``FileNotFoundError`` without a
    metrics.csv and ``MetricsFileError`` for one that holds no steps or is not psgrad's."""
    rows, evals = read_run(log_dir)
    sent = sum(r.get("bytes_up", 0.0) + r.get("bytes_down", 0.0) for r in rows)
    accuracies = [e["test_acc"] for e in evals]
    return RunFigures(
        log_dir=str(log_dir),
        label=run_label(log_dir),
        data=_data_label(log_dir),
        steps=len(rows),
        seconds=rows[-1]["wall"],
        mb_per_step=sent / len(rows) / 1e6,
        last_acc=accuracies[-1] if accuracies else math.nan,
        best_acc=max(accuracies, default=math.nan),
        evals=tuple(evals),
        rows=tuple(rows),
    )


def common_target(runs: list[RunFigures]) -> float | None:
    """The highest test accuracy every evaluated run reached; None when none was evaluated."""
    best = [run.best_acc for run in runs if run.evaluated]
    return min(best) if best else None


LOW_TARGET_GAP = 0.02
"""Two points of accuracy: more than rounding alone moved one run on the proxy (up to 1.6 points,
docs/benchmarks.md, "How these are measured"), so the runs learned differently."""


def low_target_note(records: list[dict], target: float | None) -> str | None:
    """A note when ``target`` (the default: the weakest run's best) lies ``LOW_TARGET_GAP`` or more
    below the best run's best accuracy, naming both runs; None otherwise."""
    evaluated = [r for r in records if not math.isnan(r["best_acc"])]
    if target is None or len(evaluated) < 2:
        return None
    weakest = min(evaluated, key=lambda r: r["best_acc"])
    strongest = max(evaluated, key=lambda r: r["best_acc"])
    if strongest["best_acc"] - target < LOW_TARGET_GAP:
        return None
    return (
        f"note: {weakest['label']} set the target, its best accuracy, while {strongest['label']} reached "
        f"{strongest['best_acc']:.3f}: this ranks who got to {target:.3f} first, not who learned most. "
        "--target-accuracy ranks the runs at an accuracy you choose (a run that never gets there: not reached)"
    )


def ranked(runs: list[RunFigures], target: float | None) -> list[dict]:
    """One record per run: its figures (rows and evaluations left out) with its time to
    ``target`` (``target_steps``, ``target_seconds``, ``target_mb``: NaN when not reached, or when
    ``rows_missing``: its metrics.csv lacks steps before the target) and ``of_fastest``, ranked as
    the module says."""
    records = []
    for run in runs:
        record = {k: v for k, v in asdict(run).items() if k not in ("evals", "rows")} | {"rows_missing": False}
        try:
            reached = to_target(list(run.rows), list(run.evals), target) if target is not None and run.evaluated else {}
        except ValueError:  # steps missing from its metrics.csv (a job killed before it logged them)
            reached, record["rows_missing"] = {}, True
        record.update({key: reached.get(key, math.nan) for key in ("target_steps", "target_seconds", "target_mb")})
        records.append(record)
    fastest = min((r["target_seconds"] for r in records if not math.isnan(r["target_seconds"])), default=math.nan)
    for record in records:
        record["of_fastest"] = record["target_seconds"] / fastest if fastest > 0 else math.nan

    def order(record: dict) -> tuple:
        never, missed = math.isnan(record["best_acc"]), math.isnan(record["target_seconds"])
        return (never, missed, 0.0 if missed else record["target_seconds"], 0.0 if never else -record["best_acc"])

    return sorted(records, key=order)


def _number(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


def _seconds(value: float) -> str:
    """Three significant digits, without an exponent: runs of a second and of hours both read."""
    if math.isnan(value):
        return "-"
    return format(value, ".0f" if value >= 100 else ".1f" if value >= 10 else ".2f" if value >= 1 else ".3f")


def table(records: list[dict], target: float | None) -> str:
    """The ranked runs as text, widest label first column."""
    to = f"to {target:.3f}" if target is not None else "to target"
    head = [
        "run",
        "data",
        "steps",
        "seconds",
        "MB/step",
        "last acc",
        "best acc",
        f"{to}: steps",
        "seconds",
        "MB",
        "time",
    ]
    lines = [head]
    for r in records:
        if not math.isnan(r["of_fastest"]):
            time_ = f"{r['of_fastest']:.2f}x"
        elif math.isnan(r["best_acc"]):
            time_ = "never evaluated"
        elif r["rows_missing"]:
            time_ = "steps missing"
        else:
            time_ = "-" if target is None else "not reached"
        lines.append(
            [
                r["label"],
                r["data"],
                str(r["steps"]),
                _seconds(r["seconds"]),
                _number(r["mb_per_step"], ".3f"),
                _number(r["last_acc"], ".3f"),
                _number(r["best_acc"], ".3f"),
                _number(r["target_steps"], ".0f"),
                _seconds(r["target_seconds"]),
                _number(r["target_mb"], ".1f"),
                time_,
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in lines
    )
