"""A run's checkpoints as a job: when one is due, every rank's part of writing one (each rank its
file, then rank 0 the marker that makes it complete), the trained model, and reading a resumed
run's state back on every rank. The files themselves are ``psgrad.checkpoint``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import checkpoint
from .agreement import fail_together
from .runtime.exits import CHECKPOINT

if TYPE_CHECKING:  # the interface only
    from torch import nn

    from .comm.channel import Channel


class Checkpoints:
    """Checkpoints of one run on one rank: into ``log_dir`` (else ./checkpoints) every ``every``
    steps and after the last of ``total`` steps whenever there is a log dir."""

    def __init__(self, log_dir: str | None, *, transport: Channel, every: int, total: int, keep: int = 0) -> None:
        self.log_dir, self.transport, self.every, self.total, self.keep = log_dir, transport, every, total, keep
        self.stop_step: int | None = None  # the step after which the ranks agreed to stop (stopsaving.py)
        self.last_saved: Path | None = None  # the directory of the newest checkpoint this rank wrote

    @property
    def enabled(self) -> bool:
        """Whether this run writes checkpoints at all (into a log dir, or every N steps)."""
        return self.log_dir is not None or self.every > 0

    def is_due(self, step: int) -> bool:
        """Every ``--checkpoint-every-steps`` steps, after the last step whenever there is a log
        dir, and after the step the ranks agreed to stop at (engines settle before it: engine/local.py)."""
        last = step + 1 == self.total and self.log_dir is not None
        return (
            last
            or step == self.stop_step
            or (self.every > 0 and (step + 1) % self.every == 0 and step + 1 < self.total)
        )

    def save(self, step: int, state: dict) -> None:
        """Every rank writes its file (atomically); once all have (one allreduce: every rank is
        between steps, and the MPI progress it drives completes the sends still in flight), rank 0
        writes the marker that makes the checkpoint complete, then deletes the checkpoints older
        than the newest ``keep`` (``checkpoint.prune``; the log dir is shared by the ranks, as
        resuming needs)."""
        rank, size = self.transport.rank, self.transport.size
        where = self.log_dir or "checkpoints"
        directory = self.last_saved = checkpoint.step_dir(where, step)
        checkpoint.save_rank_state(directory, rank, {"step": step, **state})
        written = self.transport.allreduce_sum([1])[0]
        if rank == 0 and written == size:
            checkpoint.mark_complete(directory, step, size)
            checkpoint.prune(where, keep=self.keep)

    def save_model(self, model: nn.Module) -> Path | None:
        """``model.pt`` in the log dir, or None without one (train.py saves the model rank 0
        evaluated last)."""
        return checkpoint.save_model(self.log_dir, model) if self.log_dir else None


def load_resume(
    resume: str | None, *, transport: Channel, total: int, settings: dict
) -> tuple[dict | None, int, list[str]]:
    """This rank's state in the checkpoint ``resume`` names (None without ``--resume``), the
    step the run starts at (collective: every rank checks that all the files are of one step), and
    the ``settings`` (a RunConfig as a dict) that shape the training and changed since the run that
    wrote it (``checkpoint.changed_settings``). A checkpoint at or past ``total`` steps leaves
    nothing to train: CheckpointError says how to go on."""
    if not resume:
        return None, 0, []
    directory = checkpoint.resolve(resume)
    state = checkpoint.load_rank_state(directory, transport.rank, transport.size)
    start = int(state["step"])
    steps = transport.allreduce_sum([start, 1])
    problem = None
    if steps[0] != start * steps[1]:
        problem = f"--resume {directory}: the ranks' checkpoint files are from different steps"
    elif start >= total:
        problem = (
            f"--resume {resume} is at step {start}, nothing left of {total} steps: to train on, give "
            f"--steps (or --epochs) beyond it, e.g. --steps {start + total}"
        )
    if problem is not None:  # every rank read the same sum: said once for the job, not once per rank
        fail_together(problem, says=transport.rank == 0, kind="checkpoint error", status=CHECKPOINT)
    return state, start, checkpoint.changed_settings(resume, settings)
