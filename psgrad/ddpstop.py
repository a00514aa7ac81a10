"""``psgrad.should_stop()`` in a torch DDP script (torchrun, ``psgrad.ddp_hook``): a SIGTERM is
saved, not lost. The ranks agree on a step, each saves its state after it, and the job ends as
the script ends.

1. The first call asks for it, on every rank after the same step: SIGTERM is noted from then on,
   not raised (stopsaving.NotedStop). A second one (2 s or more after the first: torchrun passes
   on the one a scheduler sent it), or no step agreed within ``PATIENCE`` seconds, runs the handler
   there was before: by default the process ends by the signal, as without saved stops.
2. Every call takes part in the ranks' votes (stopsaving.StopVotes): the signal this rank noted,
   about every ``VOTE_SECONDS``, as a key of the store torch.distributed rendezvoused on, written
   and read by a helper thread (the training waits on no round trip to the store's host), and
   taken ``MIN_LAG`` calls later. By then every rank that calls has handed over its vote: a
   collective of the training (DDP's all-reduce) lies between two calls. The store, not a
   collective, so that a rank that never calls is named: a vote still missing ``VOTE_PATIENCE``
   seconds plus two of the slowest steps later names the ranks it lacks, in an error that ends
   the job, where an all-gather would wait on them until the group's timeout (30 min by default).
3. A vote with a signal in it is the agreed stop: after that step ``should_stop()`` is True on
   every rank, and each says so once.
"""

from __future__ import annotations

import atexit
import queue
import signal
import threading
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

CLOSE_SECONDS = 5.0
"""How long the process's end waits for the helper thread's store call in flight (``StoreVotes.close``)."""

_KEPT = 4 * MIN_LAG
"""Votes a rank keeps its key of: a rank is at most a call ahead of another, which reads a vote
``MIN_LAG`` calls after it was written; older keys are deleted."""


class StoreVotes:
    """The channel StopVotes votes on: vote ``n`` of rank ``r`` is the store's key
    ``psgrad/stop/<n>/<r>`` (module docstring, 2). A helper thread writes each vote and reads it
    back, so that the training waits on no round trip to the store's host (one a vote, each a
    link's latency away); ``patience()`` gives the seconds a reading waits for it."""

    def __init__(self, store: dist.Store, *, rank: int, size: int, patience: Callable[[], float]) -> None:
        self.store, self.rank, self.size, self.patience = store, rank, size, patience
        self.written, self.closing = 0, False
        self.queue: queue.SimpleQueue[_VoteRead | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._exchange, name="psgrad-stop-votes", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def iallgather_sizes(self, value: int) -> tuple[_VoteRead, np.ndarray]:
        read = _VoteRead(self, vote=self.written, value=value)
        self.written += 1
        self.queue.put(read)
        return read, read.out

    def _exchange(self) -> None:
        """The helper thread: each vote in turn, written, this rank's oldest kept key deleted, and
        read once every rank's key is there. It polls: a store's blocking get would hold the
        store's client, which naming the missing ranks needs (``_VoteRead.wait``)."""
        while (read := self.queue.get()) is not None:
            try:
                self.store.set(read.keys[self.rank], str(read.value))
                if read.vote >= _KEPT:
                    self.store.delete_key(_key(read.vote - _KEPT, self.rank))
                backoff = Backoff(Patience(spins=0, max_sleep=0.05))
                while not self.store.check(read.keys):
                    if self.closing:
                        return
                    backoff.idle()
                read.out[:] = [int(value) for value in self.store.multi_get(read.keys)]
            except Exception as error:  # the store's host gone: the reading raises it
                read.error = error
            read.done.set()

    def close(self) -> None:
        """At exit: the helper thread ends between two store calls (a call in flight while
        Python's end frees the store aborts the process)."""
        self.closing = True
        self.queue.put(None)
        self.thread.join(timeout=CLOSE_SECONDS)


class _VoteRead:
    """One vote (``StoreVotes``): ``wait`` returns once its array is filled, or names the ranks
    whose keys are missing after the patience."""

    def __init__(self, votes: StoreVotes, *, vote: int, value: int) -> None:
        self.votes, self.vote, self.value = votes, vote, value
        self.keys = [_key(vote, rank) for rank in range(votes.size)]
        self.out = np.zeros(votes.size, dtype=np.int64)
        self.done, self.error = threading.Event(), None

    def wait(self) -> None:
        while not self.done.wait(self.votes.patience()):
            missing = [rank for rank, key in enumerate(self.keys) if not self.votes.store.check([key])]
            if not missing:  # every key came, a moment after the patience
                continue
            raise RuntimeError(
                f"psgrad.should_stop() was called on rank {self.votes.rank}, not on {named_ranks(missing)}, "
                "which would never vote on a stop: call it after each optimizer step on every rank"
            )
        if self.error is not None:
            raise self.error


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
