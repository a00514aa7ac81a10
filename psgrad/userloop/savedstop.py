"""``psgrad.should_stop()``: a SIGTERM in your own loop is saved, not lost. The workers agree on a
step, each saves its state after it, and the job ends as your script ends.

1. The first ``should_stop()`` on a worker (after a ``step()``) asks for it: from then on, the
   worker's first SIGTERM is noted, not raised (stopsaving.NotedStop: a second one, or none agreed
   within ``PATIENCE`` seconds, stops the job at once as before), and the serving-only ranks are
   told to note theirs too (userloop/stopping.py, 5): they serve on and tell the workers. The
   other workers are told too (``ASKED``).
2. At the end of every ``DistributedOptimizer.step()``, every worker that asked takes part in the
   workers' votes, as ``psgrad train``'s ranks do (stopsaving.StopVotes, on a communicator of the
   workers alone): a vote carries the signal this worker noted, or the one a serving rank noted,
   and is read ``MIN_LAG`` steps later, when every worker has started it (the workers step together).
   Before the first is read, every other worker has asked as well: the workers step together, so
   each asked steps ago (with local steps, up to H steps behind: they wait for one another only at
   exchanges). A worker whose notice has not come within ``ASK_PATIENCE`` seconds, plus H of the
   slowest steps seen, never asked, would never vote, and is named in an error, where this worker
   would wait on it for ever.
3. A vote with a signal in it is the agreed stop: after that step, ``should_stop()`` is True on
   every worker. Your loop saves (``state_dict()`` is whole after any ``step()``) and ends.
4. At ``shutdown`` the votes still in flight are read (every worker that asked, at the same step).
"""

from __future__ import annotations

import signal
import time

from ..comm.transport import Transport
from ..comm.waiting import Backoff, Patience
from ..metrics import say
from ..stopsaving import MIN_LAG, NotedStop, StopVotes, named_ranks
from .stopping import ARMED, ASKED, StopTogether
from .world import joined, world

ASK_PATIENCE = 5.0
"""Seconds a worker waits, before its first vote is read, for the other workers' notices that
they asked too: they did steps ago, and their notices take a listener's poll (50 ms) to arrive."""

_HEARD = 1 << 7  # a vote's flag: the signal is a serving rank's, not this worker's (signals < 128)


class AgreedStop:
    """One worker's part (module docstring); ``channel`` holds the workers alone, in the order of
    ``worker_ranks``; ``servers`` are the serving-only ranks."""

    def __init__(self, *, channel: Transport, stops: StopTogether, worker_ranks: list[int], servers: list[int]) -> None:
        self.channel, self.stops = channel, stops
        self.worker_ranks, self.servers = worker_ranks, servers
        self.noted = NotedStop(stops.rank, until="every worker agrees on: psgrad.should_stop() then says so")
        self.votes = StopVotes(channel, lag=MIN_LAG)
        self.steps = 0  # the DistributedOptimizer's steps since this worker asked
        self.agreed = False
        self.every_worker_asked = False

    def ask(self) -> None:
        """From now on, SIGTERM is saved (1)."""
        self.stops.absorb = self.noted.take
        self.stops.tell(ARMED, ranks=self.servers)
        self.stops.tell(ASKED, ranks=[r for r in self.worker_ranks if r != self.stops.rank])

    def stepped(self) -> None:
        """At the end of a step: read the vote due, start the next (2-3)."""
        if self.agreed:
            return
        if not self.every_worker_asked and self.votes.is_due(self.steps):
            self._await_the_others()
        signals = self.votes.due(self.steps)
        if signals is not None and signals.any():
            self._agree(signals)
            return
        self.steps += 1
        noted = self.noted.signum or (self.stops.noted_by_server and self.stops.noted_by_server | _HEARD)
        self.votes.start(self.steps, noted=noted)

    def _await_the_others(self) -> None:
        """Before the first vote is read: every other worker asked too, or it is named (2)."""
        others = set(self.worker_ranks) - {self.stops.rank}
        w = world()
        patience = ASK_PATIENCE + max(1, w.cfg.local_steps) * w.slowest_step
        deadline, backoff = time.monotonic() + patience, Backoff(Patience(spins=0, max_sleep=0.05))
        while not others <= set(self.stops.asked):
            if time.monotonic() > deadline:
                missing = ", ".join(map(str, sorted(others - set(self.stops.asked))))
                raise RuntimeError(
                    f"psgrad.should_stop() was called on this worker (rank {self.stops.rank}), not on worker "
                    f"rank {missing}, which would never vote on a stop: call it after each step() on every worker"
                )
            backoff.idle()
        self.every_worker_asked = True

    def _agree(self, signals) -> None:
        """The agreed stop: each worker says it, once (3)."""
        self.agreed = True
        self.noted.agreed()
        own = [self.worker_ranks[i] for i, s in enumerate(signals) if s and not s & _HEARD]
        name = signal.Signals(int(max(signals)) & ~_HEARD).name
        where = f"on {named_ranks(own)}" if own else "on a serving rank"
        say(
            f"[psgrad rank {self.stops.rank}] {name} {where}: every worker stops after this step "
            "(psgrad.should_stop() is True): save and end your loop"
        )

    def close(self) -> None:
        """At ``shutdown``: read the votes in flight (4)."""
        self.votes.drain()
        self.noted.agreed()
        if self.noted.signum and not self.agreed:
            say(f"[psgrad rank {self.stops.rank}] your loop ended before its stop: nothing to save beyond it")


def should_stop() -> bool:
    """Whether every worker stops after this step, its state to be saved: a SIGTERM reached the
    job (module docstring). Call it on every worker after each ``step()``; the first call asks
    for saved stops, and the job's SIGTERMs are noted from then on, not raised. In a torch DDP
    script (no ``psgrad.init``, torch.distributed set up) every rank votes instead (ddpstop.py)."""
    global _SAVED
    if _SAVED is None:
        from .. import ddpstop

        if not joined():
            if ddpstop.in_ddp():
                return ddpstop.should_stop()
            raise RuntimeError(
                "psgrad.should_stop() needs psgrad.init(...) first (your own loop), or torch.distributed "
                "set up (a DDP script), on every rank"
            )
        w = world()
        if w.workers is None or w.stops is None:
            raise RuntimeError("psgrad.should_stop() is for the workers, after psgrad.init")
        layout = w.layout
        servers = [r for r in layout.server_ranks if not layout.is_worker(r)]
        _SAVED = AgreedStop(channel=w.workers, stops=w.stops, worker_ranks=layout.worker_ranks, servers=servers)
        _SAVED.ask()
        w.closers.insert(0, _SAVED.close)  # at shutdown, before the optimizer's traffic ends
    return _SAVED.agreed


def stepped() -> None:
    """At the end of ``DistributedOptimizer.step()``: this worker's part of the vote, once it asked."""
    if _SAVED is not None:
        _SAVED.stepped()


_SAVED: AgreedStop | None = None
