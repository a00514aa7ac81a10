"""How a rank waits: the work it may do meanwhile (``Idle``), how long it spins and then sleeps
between looks (``Patience``, ``Backoff``; MPI busy-polls inside blocking calls, so psgrad never
blocks in MPI), the clock of its time spent waiting (``WaitClock``), the shared pass a rank may
hand its forward and backward to (``SharedPass``), and the error a dead peer leaves (``PeerFailure``).
Pure Python: no MPI, so the in-process transport shares it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

_SPIN_TESTS = 20  # tests before the first sleep: replies often land within microseconds
_MIN_SLEEP = 50e-6
_MAX_SLEEP = 1e-3

Idle = Callable[[], bool]
"""Work to do while a wait has nothing to show (a colocated server's polling); True when it did some."""


class SharedPass(Protocol):
    """A forward and backward that a rank hands over to be computed together with other ranks'
    (the transport decides whether it has one: ``Transport.shared_pass``). ``run`` returns the
    batch's loss once this rank's gradients are set, or None when the pass cannot take the batch
    (the rank then computes it itself)."""

    share: float  # seconds: this rank's share of the last pass (the rest of its time there was waiting)

    def join(self, model, loss_fn: Callable) -> None: ...

    def run(self, images, labels, idle: Idle | None = None) -> float | None: ...


class PeerFailure(RuntimeError):
    """An MPI operation with another rank failed: that rank has most likely died. The text names it
    (its sentinel names it too, runtime/sentinel.py)."""


class WaitClock:
    """Since when the main thread has been inside a transport wait (None: it is not waiting).

    The watchdog reads it from its own thread: a job whose every rank has been waiting for longer
    than ``--timeout`` is stuck. Waits on helper threads (serving, the watchdog) do not count."""

    def __init__(self) -> None:
        self.since: float | None = None

    def __enter__(self) -> None:
        if self.since is None and threading.current_thread() is threading.main_thread():
            self._outer = True
            self.since = time.monotonic()
        else:
            self._outer = False

    def __exit__(self, *exc) -> None:
        if self._outer:
            self.since = None

    def seconds(self) -> float:
        since = self.since
        return 0.0 if since is None else time.monotonic() - since


WAITING = WaitClock()


@dataclass(frozen=True)
class Patience:
    """How a wait polls: ``spins`` tests, then sleeps from ``min_sleep`` doubling to ``max_sleep``."""

    spins: int = _SPIN_TESTS
    min_sleep: float = _MIN_SLEEP
    max_sleep: float = _MAX_SLEEP


WORKER_PATIENCE = Patience()
"""A worker's waits are on the step's critical path: spin, then short sleeps."""
SERVER_PATIENCE = Patience(spins=2, min_sleep=200e-6, max_sleep=4e-3)


class Backoff:
    """Sleep a little longer each time nothing happened; reset when something did."""

    def __init__(self, patience: Patience = WORKER_PATIENCE) -> None:
        self.patience = patience
        self.tries = 0
        self.delay = patience.min_sleep
        self.slept = 0.0

    def idle(self) -> None:
        self.tries += 1
        if self.tries <= self.patience.spins:
            return
        time.sleep(self.delay)
        self.slept += self.delay
        self.delay = min(self.delay * 2, self.patience.max_sleep)

    def reset(self) -> None:
        self.tries, self.delay = 0, self.patience.min_sleep
