"""Per-step records: metrics.csv / eval.csv writers, optional TensorBoard, a progress bar on one rank."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import sys
import time
from collections import deque
from pathlib import Path

from .comm.protocol import TIME_KEYS

METRIC_COLUMNS = [
    "step", "epoch", "loss", "it_per_s", "bytes_up", "bytes_down", "lr", *TIME_KEYS, "step_time",
    "server_decode", "server_apply", "server_idle", "server_cpu", "nonfinite", "outer", "consensus", "wall",
]  # fmt: skip
EVAL_COLUMNS = ["epoch", "step", "test_loss", "test_acc", "dataset", "eval_seconds", "paused_seconds"]


class StepAggregator:
    """Collects one stats record per worker per step; returns the merged row when all are in.

    Loss and times are averaged over workers; bytes are summed (the traffic of the whole step).
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.parts: dict[int, list[dict]] = {}
        self.start = time.perf_counter()
        self.last = self.start

    def add(self, record: dict) -> dict | None:
        step = int(record["step"])
        parts = self.parts.setdefault(step, [])
        parts.append(record)
        if len(parts) < self.workers:
            return None
        del self.parts[step]
        now = time.perf_counter()
        row = {"step": step, "loss": sum(p["loss"] for p in parts) / len(parts)}
        row["bytes_up"] = int(sum(p["bytes_up"] for p in parts))
        row["bytes_down"] = int(sum(p["bytes_down"] for p in parts))
        row["nonfinite"] = int(sum(p["nonfinite"] for p in parts))
        row["outer"] = int(max(p.get("outer", 0) for p in parts))
        for key in (*TIME_KEYS, "step_time"):
            row[key] = sum(p[key] for p in parts) / len(parts)
        row["it_per_s"] = 1.0 / max(1e-9, now - self.last)
        row["wall"] = now - self.start
        self.last = now
        return row


TENSORBOARD_MISSING = (
    "--tensorboard needs tensorboardX: pip install 'psgrad[tensorboard]' (or pip install tensorboardX)"
)


def say(message: str) -> None:
    """Print a line on standard error above this process's progress bar, if one is showing
    (``tqdm.write``), rather than after the bar's text on its line. A standard error that is gone
    (the terminal hung up) is not a new error on the way down."""
    from tqdm import tqdm

    try:  # the line and its end in one write: ranks' lines through mpiexec otherwise run together
        tqdm.write(f"{message}\n", file=sys.stderr, end="")
    except OSError:
        pass


def tensorboard_problem() -> str | None:
    """Why ``--tensorboard`` cannot write here (neither tensorboardX nor tensorboard is
    installed), or None: rank 0 says so before anything is built (``train.run``)."""
    if any(importlib.util.find_spec(name) is not None for name in ("tensorboardX", "tensorboard")):
        return None
    return TENSORBOARD_MISSING


def tensorboard_writer(directory: Path):
    """A TensorBoard SummaryWriter: tensorboardX (light: protobuf only), else torch's (needs tensorboard)."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RuntimeError(TENSORBOARD_MISSING) from None
    return SummaryWriter(str(directory))


ROWS_KEPT = 2000
RATE_WINDOW = 10  # steps the progress bar's it/s is measured over


def _cut_at(path: Path, start_step: int) -> tuple[list[str], list[list[str]]]:
    """Ready a resumed run's CSV file for appending; return its own columns (an older psgrad may
    have written fewer; none for an empty file) and the rows it kept.

    1. Rows of the steps before ``start_step`` stay; later ones go (a run resumed from an older
       checkpoint trains those steps again), as does a row cut off when the job was killed.
    2. The file is rewritten under a temporary name and renamed over the old one."""
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        column = header.index("step") if "step" in header else None

        def before_start(row: list[str]) -> bool:
            try:
                return len(row) == len(header) and (column is None or int(row[column]) < start_step)
            except ValueError:
                return False

        kept = [row for row in reader if before_start(row)]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        if header:
            csv.writer(f).writerows([header, *kept])
    os.replace(tmp, path)
    return header, kept


def _last_wall(header: list[str], kept: list[list[str]]) -> float:
    """The ``wall`` clock of the last row kept (0 without one): where a resumed run's clock goes on."""
    try:
        return float(kept[-1][header.index("wall")]) if kept else 0.0
    except ValueError:  # no wall column (an older psgrad), or not a number
        return 0.0


DIVERGED = 1000.0
"""A training loss this many times the run's first step's says the run diverges (a loss that
only spikes stays far below: a thousandfold is orders of magnitude, not noise)."""


class MetricsLog:
    """Writes rows to ``log_dir`` (metrics.csv, eval.csv) and TensorBoard; shows a progress bar.

    Rows stream to disk; only the last ``ROWS_KEPT`` stay in memory (``rows``), so a long run's
    rank 0 does not grow with every step — unless ``keep_all_rows`` (``psgrad bench``'s runs, whose
    time to accuracy reads every row up to the target). Evaluation rows are few and all kept."""

    def __init__(
        self,
        log_dir: str | None,
        *,
        total_steps: int,
        start_step: int,
        steps_per_epoch: int,
        label: str,
        tensorboard: bool = False,
        progress: bool = True,
        keep_all_rows: bool = False,
    ) -> None:
        self.dir = Path(log_dir) if log_dir else None
        self.steps_per_epoch = steps_per_epoch
        self.rows: deque[dict] = deque(maxlen=None if keep_all_rows else ROWS_KEPT)
        self.evals: list[dict] = []
        self._files = {}
        self._writers = {}
        # a resumed run's clock goes on from the last step kept, so that wall time (and time to
        # accuracy) counts training only, not the time the job was down or the steps done twice
        self._wall_before = 0.0
        if self.dir:
            self.dir.mkdir(parents=True, exist_ok=True)
            append = start_step > 0
            for name, cols in (("metrics", METRIC_COLUMNS), ("eval", EVAL_COLUMNS)):
                path = self.dir / f"{name}.csv"
                appending = append and path.exists()
                if appending:
                    header, kept = _cut_at(path, start_step)
                    cols = header or cols
                    if name == "metrics":
                        self._wall_before = _last_wall(header, kept)
                f = open(path, "a" if appending else "w", newline="")
                writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
                if f.tell() == 0:
                    writer.writeheader()
                self._files[name], self._writers[name] = f, writer
        self.tb = None
        if tensorboard and self.dir:
            self.tb = tensorboard_writer(self.dir / "tb")
        self.bar = None
        self._recent: deque[float] = deque(maxlen=RATE_WINDOW + 1)  # the last rows' wall clocks
        self.first_loss: float | None = None
        self.diverged_at: int | None = None  # the first step whose loss was DIVERGED x the first's
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc=label,
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                mininterval=0.5,
            )

    def step(self, row: dict) -> None:
        row["epoch"] = (row["step"] + 1) / max(1, self.steps_per_epoch)  # epochs done after the step
        if "wall" in row:
            row["wall"] += self._wall_before
        self.rows.append(row)
        self._write("metrics", row)
        self._watch_divergence(row)
        if self.tb:
            for key in ("loss", "it_per_s", "bytes_up", "bytes_down", "lr"):
                if key in row:
                    self.tb.add_scalar(f"train/{key}", row[key], row["step"])
        if self.bar:
            mb = (row["bytes_up"] + row["bytes_down"]) / 1e6
            self.bar.set_postfix_str(
                f"epoch {row['epoch']:.2f} loss {row['loss']:.3f} {self._recent_rate(row):.2f} it/s {mb:.2f} MB/step",
                refresh=False,
            )
            self.bar.update(1)

    def _watch_divergence(self, row: dict) -> None:
        """Say once when the loss has grown ``DIVERGED``-fold over the first step's: a run that
        diverges without overflowing (a NaN stops it, docs/training.md) would otherwise end as if
        it had trained."""
        loss = row["loss"]
        if self.first_loss is None:
            self.first_loss = loss if math.isfinite(loss) and loss > 0 else None
        elif self.diverged_at is None and loss > DIVERGED * self.first_loss:
            self.diverged_at = row["step"]
            say(
                f"[psgrad] warning: the training loss is {loss:.3g} at step {row['step']}, over "
                f"{DIVERGED:.0f}x the first step's {self.first_loss:.3g}: the run diverges (lower --lr, or warm "
                "up with --warmup-epochs)"
            )

    def _write(self, name: str, row: dict) -> None:
        """Append ``row`` to ``name``.csv, if logging; a failed write (a full disk) names the file."""
        if name not in self._writers:
            return
        try:
            self._writers[name].writerow(row)
            self._files[name].flush()
        except OSError as err:
            raise OSError(err.errno, err.strerror, self._files[name].name) from err

    def _recent_rate(self, row: dict) -> float:
        """Steps per second over the last ``RATE_WINDOW`` rows: one step's own rate swings when
        the workers' records reach the metrics rank in bursts (many simulated workers, async)."""
        if "wall" not in row:
            return row["it_per_s"]
        self._recent.append(row["wall"])
        span = self._recent[-1] - self._recent[0]
        return (len(self._recent) - 1) / span if span > 0 else row["it_per_s"]

    def evaluation(self, row: dict) -> None:
        self.evals.append(row)
        self._write("eval", row)
        if self.tb:
            self.tb.add_scalar("test/loss", row["test_loss"], row["step"])
            self.tb.add_scalar("test/acc", row["test_acc"], row["step"])
        message = f"[eval] epoch {row['epoch']:.2f} step {row['step']}: test loss {row['test_loss']:.4f}, accuracy {row['test_acc']:.4f} ({row['dataset']})"
        say(message)

    def summary(self, *, steps: int, data: str) -> str | None:
        """The run's done line (None without rows): ``steps`` trained, the last loss, it/s and
        MB/step over the rows kept (their first fifth left out as warm-up), the last test accuracy."""
        rows = list(self.rows)
        if not rows:
            return None
        tail = rows[len(rows) // 5 :] or rows
        its = len(tail) / max(1e-9, sum(1 / r["it_per_s"] for r in tail))
        mb = sum(r["bytes_up"] + r["bytes_down"] for r in tail) / len(tail) / 1e6
        acc = f", test accuracy {self.evals[-1]['test_acc']:.4f}" if self.evals else ""
        diverged = f" (diverged from step {self.diverged_at})" if self.diverged_at is not None else ""
        return (
            f"[psgrad] done: {steps} step{'' if steps == 1 else 's'}, final loss {rows[-1]['loss']:.4g}{diverged}, {its:.2f} it/s, "
            f"{mb:.3f} MB/step (up+down, all workers){acc} [{data}]"
        )

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        for f in self._files.values():
            f.close()
        if self.tb:
            self.tb.close()
