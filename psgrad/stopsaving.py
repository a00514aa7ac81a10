"""A SIGTERM during ``psgrad train``'s steps is saved, not lost: the ranks agree on a step, write
a checkpoint after it, and stop. A scheduler's preemption or time limit then costs no training.

1. While the steps run, the first SIGTERM on a rank is noted, not raised, and the rank says so.
   A second one stops the rank at once, as Ctrl-C always does, and so does ``PATIENCE`` seconds
   without the agreed stop: a peer that is stuck or gone cannot keep the rank from stopping. One
   within ``SAME_STOP`` seconds of the first is the same stop, delivered twice: a scheduler signals
   every process of a job, and the launcher (srun, mpiexec, a supervisor) passes its own on.
2. Before step k, at the steps of a schedule every rank shares, every rank starts a vote on its
   own duplicate communicator: a non-blocking all-gather of the signal it noted (0 for none) and
   its mean step time since its last vote.
3. After step k + ``lag``, every rank reads the vote started before step k, waiting for it if a
   rank is that far behind: every rank reads the same vote after the same step. The lag covers
   how far ranks run apart (``--mode async``'s staleness) and how long the vote's few bytes may
   queue behind an overlapped exchange on a slow link, so that reading it rarely waits. From the
   slowest rank's step time every rank sets the same period for the next votes, about
   ``VOTE_SECONDS`` apart: a model whose steps take milliseconds does not pay a collective a step.
4. A vote with a signal in it makes a checkpoint due after step S, the first step after k + lag after
   which one may be written (every ``--local-steps``), so the engines settle before it as before
   any checkpoint (engine/local.py). After step S every rank writes its part and leaves the steps;
   the roles finish as at the run's end (the metrics rank logs the last steps' rows, so a resumed
   run's metrics.csv misses none), every rank waits until every rank has (rank 0 marked the
   checkpoint complete), and raises ``SavedStop``, which the failure path says
   (runtime/failure.py). A stop that would come at the run's last step lets the run finish instead.
5. Without a stop, the votes still in flight are read at the end, and the communicator freed.
``psgrad simulate``'s ranks are threads of one process, whose main thread alone takes signals: it
notes a SIGTERM for every rank (``Channel.shared_stop``), the ranks vote on it as above, and the
stop is said once, by rank 0.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from .metrics import say
from .runtime.signals import Terminated, stop_signals_to

if TYPE_CHECKING:  # the interfaces only
    import numpy as np

    from .checkpointing import Checkpoints
    from .comm.channel import Channel, Handle
    from .config import RunConfig

PATIENCE = 20.0
"""Seconds a rank waits for the agreed stop after its SIGTERM before it stops at once (a
scheduler's grace before SIGKILL is often 30 s)."""

SAME_STOP = 2.0
"""Seconds within which a second SIGTERM is the first one delivered again (module docstring, 1)."""

MIN_LAG = 2
"""Steps between a vote and its reading when ranks run in step: a rank is at most one step ahead."""

VOTE_SECONDS = 0.25
"""About how often the ranks vote: a stop waits this long at most for its vote to start."""
MAX_PERIOD = 10_000
_SIGNAL_BITS = 8  # a vote packs the signal (< 256) and the step time in microseconds above it


def vote_lag(cfg: RunConfig) -> int:
    """Steps between a vote and its reading (module docstring, 3)."""
    ahead = cfg.staleness + 1 if cfg.mode == "async" else 0
    in_flight = (cfg.overlap_steps or cfg.local_steps) if cfg.local_steps and cfg.overlap_exchange else 0
    return MIN_LAG + ahead + in_flight


class SavedStop(Terminated):
    """The job stops after ``step`` steps, every rank's state saved in the checkpoint ``saved``,
    because ``signalled`` (ranks) noted one of ``STOP_SIGNALS`` (module docstring, 4)."""

    def __init__(self, signum: int, *, step: int, saved: str, signalled: list[int]) -> None:
        super().__init__(signum)
        self.step, self.saved, self.signalled = step, saved, signalled

    def said(self, rank: int) -> str:
        """This rank's line on the way out."""
        name = signal.Signals(self.signum).name
        why = (
            f"terminated ({name})"
            if rank in self.signalled
            else f"stopped with the job ({name} on {named_ranks(self.signalled)})"
        )
        return f"{why} after step {self.step - 1}, every rank's state saved in {self.saved}"


def named_ranks(ranks: Sequence[int]) -> str:
    """``rank 2``, ``ranks 0, 1``: how a line names the ranks a signal reached."""
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


class NotedStop:
    """A rank's first SIGTERM noted, not raised (module docstring, 1): ``signum`` is the signal
    noted (0 for none). ``until`` says in the rank's line what the rank waits for; without
    ``patience`` (a serving rank, which others stop) no stop comes at once after ``PATIENCE``."""

    def __init__(self, rank: int | None, *, until: str, patience: bool = True) -> None:
        self.rank, self.until, self.patience = rank, until, patience  # rank None: psgrad simulate's ranks
        self.signum = 0
        self._at = 0.0
        self._timer: threading.Timer | None = None

    def note(self, signum: int, frame: object) -> None:
        """The signal handler: a second stop raises ``Terminated``."""
        if not self.take(signum):
            raise Terminated(signum)

    def take(self, signum: int) -> bool:
        """Note the first stop; False for a second one, which stops the rank at once."""
        if self.signum:
            return time.monotonic() - self._at < SAME_STOP  # within: the same stop delivered again
        self.signum, self._at = signum, time.monotonic()
        name = signal.Signals(signum).name
        who = "[psgrad]" if self.rank is None else f"[psgrad rank {self.rank}]"
        also = f", and so does a stop not agreed within {PATIENCE:.0f} s" if self.patience else ""
        say(f"{who} {name}: stopping after a step {self.until} ({name} again stops at once{also})")
        if not self.patience:
            return True
        # interrupt_main calls this handler again in the main thread, which then stops at once
        self._timer = threading.Timer(PATIENCE, _thread.interrupt_main, args=(signum,))
        self._timer.daemon = True
        self._timer.start()
        return True

    def agreed(self) -> None:
        """The stop is agreed: no stop at once after ``PATIENCE`` (a second signal still is one)."""
        if self._timer is not None:
            self._timer.cancel()


class StopVotes:
    """Every rank's votes on a stop, on a communicator of their own (module docstring, 2-3):
    ``start`` before a step, ``due`` after one; every rank must call both at every step."""

    def __init__(self, channel: Channel, *, lag: int) -> None:
        self.channel, self.lag = channel, lag
        self.votes: deque[tuple[int, Handle, np.ndarray]] = deque()  # (the step it started before, ...)
        self.next_vote, self.period = 0, 1  # every rank's schedule
        self._since: tuple[int, float] | None = None  # the step and time of this rank's last vote

    def start(self, step: int, *, noted: int) -> None:
        """Before ``step``: start a vote of the signal ``noted`` (0 for none) when the schedule says so."""
        if step < self.next_vote:
            return
        now = time.monotonic()
        mean = 0.0 if self._since is None else (now - self._since[1]) / max(1, step - self._since[0])
        self._since = (step, now)
        vote = noted | int(mean * 1e6) << _SIGNAL_BITS
        self.votes.append((step, *self.channel.iallgather_sizes(vote)))
        self.next_vote = step + self.period

    def is_due(self, step: int) -> bool:
        """Whether a vote is read after ``step``."""
        return bool(self.votes) and self.votes[0][0] + self.lag <= step

    def due(self, step: int) -> np.ndarray | None:
        """After ``step``: every rank's signal (0 for none) in the vote due now, None when none is;
        the next votes' period follows the slowest rank's step time."""
        if not self.is_due(step):
            return None
        votes = self._read()
        slowest = int(votes.max()) >> _SIGNAL_BITS
        if slowest > 0:  # 0: the first vote, before any step was timed
            self.period = max(1, min(MAX_PERIOD, int(VOTE_SECONDS / (slowest * 1e-6))))
        return votes & (1 << _SIGNAL_BITS) - 1

    def drain(self) -> None:
        """Read the votes still in flight (every rank, at a clean end)."""
        while self.votes:
            self._read()

    def _read(self) -> np.ndarray:
        _, handle, votes = self.votes.popleft()
        handle.wait()
        return votes


def first_stop_after(step: int, *, boundary: int) -> int:
    """The first step after ``step`` after which a checkpoint may be written (every ``boundary``)."""
    after = step + 1
    return after + (-(after + 1)) % boundary


class StopSaving:
    """One rank's part of saving a stop (module docstring), when ``wanted`` and the run writes
    checkpoints and has several ranks; otherwise it does nothing. The decision is the same on
    every rank (the votes are collectives)."""

    def __init__(self, transport: Channel, *, checkpoints: Checkpoints, cfg: RunConfig, wanted: bool) -> None:
        self.transport, self.checkpoints = transport, checkpoints
        self.active = wanted and checkpoints.enabled and transport.size > 1
        self.lag, self.boundary = vote_lag(cfg), max(1, cfg.local_steps)
        # simulated ranks share their process's noted stop: its main thread alone takes signals
        self.shared = transport.shared_stop()
        self.noted = self.shared or NotedStop(transport.rank, until="every rank agrees on, with a checkpoint")
        self.signum = 0  # the agreed stop's signal
        self.signalled: list[int] = []  # ... and the ranks that noted it
        self.votes: StopVotes | None = None

    @contextlib.contextmanager
    def during_steps(self) -> Iterator[StopSaving]:
        """Within, the first SIGTERM is noted (1); on a clean way out, the votes are read (5)."""
        if not self.active:
            yield self
            return
        channel = self.transport.dup()  # collective: every rank of the run is here
        self.votes = StopVotes(channel, lag=self.lag)
        try:
            with stop_signals_to(self._note):
                yield self
        finally:
            if not self.agreed:  # an agreed stop keeps its patience until ``stop``
                self.noted.agreed()
        self.votes.drain()  # not reached after an error: the job ends without its votes
        if self.noted.signum and not self.agreed and (self.shared is None or self.transport.rank == 0):
            say(f"[psgrad rank {self.transport.rank}] the run finished before its stop: nothing to save beyond it")
        channel.free()

    @property
    def agreed(self) -> bool:
        """Whether the ranks agreed to stop (at ``checkpoints.stop_step``)."""
        return self.checkpoints.stop_step is not None

    def _note(self, signum: int, frame: object) -> None:
        self.noted.note(signum, frame)

    def before(self, step: int) -> None:
        """Start a vote when the schedule says so (2)."""
        if self.votes is not None and not self.agreed:
            self.votes.start(step, noted=self.noted.signum)

    def after(self, step: int) -> bool:
        """Read the vote due (3); True after the agreed step, whose checkpoint is written: the
        steps end there (4). Called once the step's checkpoint, if due, is written."""
        stop = self.checkpoints.stop_step
        if stop is not None:
            return step == stop
        signals = self.votes.due(step) if self.votes is not None else None
        if signals is not None and signals.any():
            self.signum, self.signalled = int(signals.max()), [int(r) for r in signals.nonzero()[0]]
            after = first_stop_after(step, boundary=self.boundary)
            if after < self.checkpoints.total - 1:  # else the run ends first, with its own checkpoint
                self.checkpoints.stop_step = after
        return False

    def stop(self) -> None:
        """After the agreed stop's checkpoint and the roles' finish: raise ``SavedStop`` (4)."""
        self.transport.barrier()  # rank 0 has marked the checkpoint complete before any rank aborts
        signalled = self.signalled
        if self.noted.signum and self.shared is None:
            # this rank's own signal counts though it came after the vote that agreed the stop: a
            # scheduler that signals every rank reaches one a moment later than another
            signalled = sorted({*signalled, self.transport.rank})
        raise SavedStop(
            self.signum,
            step=self.checkpoints.stop_step + 1,
            saved=str(self.checkpoints.last_saved),
            signalled=signalled,
        )
