"""``psgrad.should_stop()`` in a torch DDP script (torchrun, ``psgrad.ddp_hook``): a SIGTERM is
saved, not lost. The ranks agree on a step, each saves its state after it, and the job ends as
the script ends.

1. The first call asks for it, on every rank after the same step: SIGTERM is noted from then on,
   not raised (stopsaving.NotedStop). A second one (2 s or more after the first: torchrun passes
   on the one a scheduler sent it), or no step agreed within ``PATIENCE`` seconds, runs the handler
   there was before: by default the process ends by the signal, as without saved stops.
2. Every call takes part in the ranks' votes (stopsaving.StopVotes): the signal this rank noted,
   written about every ``VOTE_SECONDS`` as a key of the store torch.distributed rendezvoused on,
   and read ``MIN_LAG`` calls later. By then every rank that calls has written it: a collective
   of the training (DDP's all-reduce) lies between two calls, and each rank made its call before
   its part of it. The store, not a collective, so that a rank that never calls is named:
   a vote still missing after ``VOTE_PATIENCE`` seconds plus two of the slowest steps names the
   ranks it lacks, in an error that ends the job. On a process group an all-gather would have
   waited on that rank until the group's timeout (30 min by default).
3. A vote with a signal in it is the agreed stop: after that step ``should_stop()`` is True on
   every rank, and each says so once.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import numpy as np
import torch.distributed as dist

from .comm.waiting import Backoff, Patience
from .metrics import say
from .stopsaving import MIN_LAG, NotedStop, StopVotes, named_ranks

VOTE_PATIENCE = 5.0
"""Seconds a rank waits for a vote every calling rank wrote two steps ago (module docstring, 2),
beyond two of the slowest steps it has timed, before it names the ranks whose votes are missing."""

_KEPT = 4 * MIN_LAG
"""Votes a rank keeps its key of: a rank is at most a call ahead of another, which reads a vote
``MIN_LAG`` calls after it was written; older keys are deleted."""


class StoreVotes:
    """The channel StopVotes votes on: vote ``n`` of rank ``r`` is the store's key
    ``psgrad/stop/<n>/<r>`` (module docstring, 2). ``patience()`` gives the seconds to wait for
    a vote's last key."""

    def __init__(self, store: dist.Store, *, rank: int, size: int, patience: Callable[[], float]) -> None:
        self.store, self.rank, self.size, self.patience = store, rank, size, patience
        self.written = 0

    def iallgather_sizes(self, value: int) -> tuple[_VoteRead, np.ndarray]:
        vote, self.written = self.written, self.written + 1
        self.store.set(_key(vote, self.rank), str(value))
        if vote >= _KEPT:
            self.store.delete_key(_key(vote - _KEPT, self.rank))
        out = np.zeros(self.size, dtype=np.int64)
        return _VoteRead(self, vote=vote, out=out), out


class _VoteRead:
    """One vote's reading (``StoreVotes``): ``wait`` fills its array, or names the ranks missing."""

    def __init__(self, votes: StoreVotes, *, vote: int, out: np.ndarray) -> None:
        self.votes, self.out = votes, out
        self.keys = [_key(vote, rank) for rank in range(votes.size)]

    def wait(self) -> None:
        store = self.votes.store
        deadline = time.monotonic() + self.votes.patience()
        backoff = Backoff(Patience(spins=0, max_sleep=0.05))
        while not store.check(self.keys):
            if time.monotonic() > deadline:
                missing = [rank for rank, key in enumerate(self.keys) if not store.check([key])]
                raise RuntimeError(
                    f"psgrad.should_stop() was called on rank {self.votes.rank}, not on {named_ranks(missing)}, "
                    "which would never vote on a stop: call it after each optimizer step on every rank"
                )
            backoff.idle()
        self.out[:] = [int(value) for value in store.multi_get(self.keys)]


def _key(vote: int, rank: int) -> str:
    return f"psgrad/stop/{vote}/{rank}"


class DDPStop:
    """One rank's part (module docstring)."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        store = dist.distributed_c10d._get_default_store()  # the rendezvous's: no public accessor
        if store is None:  # the mpi backend rendezvous without one
            raise RuntimeError(
                "psgrad.should_stop() in a torch.distributed script votes through the store the process group "
                f"was set up with, and the {dist.get_backend()} backend has none: use gloo or nccl"
            )
        channel = StoreVotes(store, rank=self.rank, size=dist.get_world_size(), patience=self._patience)
        self.votes = StopVotes(channel, lag=MIN_LAG)
        self.slowest, self._called = 0.0, time.monotonic()  # seconds between two calls, at most
        self.noted = NotedStop(self.rank, until="every rank agrees on: psgrad.should_stop() then says so")
        self.steps = 0  # calls since the first
        self.agreed = False
        before = signal.signal(signal.SIGTERM, self._note)
        self.before = signal.SIG_DFL if before is None else before  # None: a handler set outside Python

    def _note(self, signum: int, frame) -> None:
        """SIGTERM's handler: the first is noted; a stop at once runs the handler before (1)."""
        if self.noted.take(signum):
            return
        signal.signal(signum, self.before)
        if callable(self.before):
            self.before(signum, frame)
        else:
            signal.raise_signal(signum)

    def _patience(self) -> float:
        return VOTE_PATIENCE + MIN_LAG * self.slowest

    def stepped(self) -> bool:
        """After a step: read the vote due, start the next (2-3); whether to stop now."""
        if self.agreed:
            return True
        now = time.monotonic()
        self.slowest, self._called = max(self.slowest, now - self._called), now
        signals = self.votes.due(self.steps)
        if signals is not None and signals.any():
            self.agreed = True
            self.noted.agreed()
            ranks = named_ranks(np.flatnonzero(signals).tolist())
            name = signal.Signals(int(signals.max())).name
            say(
                f"[psgrad rank {self.rank}] {name} on {ranks}: every rank stops after this step "
                "(psgrad.should_stop() is True): save and end your loop"
            )
            return True
        self.steps += 1
        self.votes.start(self.steps, noted=self.noted.signum)
        return False


_STOP: DDPStop | None = None


def in_ddp() -> bool:
    """Whether this process is a rank of a torch.distributed job."""
    return dist.is_available() and dist.is_initialized()


def should_stop() -> bool:
    """Whether every rank stops after this step, its state to be saved: a SIGTERM reached the job
    (module docstring). Call it on every rank after each ``optimizer.step()``."""
    global _STOP
    if _STOP is None:
        _STOP = DDPStop()
    return _STOP.stepped()
