"""The world every simulated rank shares (``LocalWorld``): message queues and posted receives,
collectives by call count, failure and stall detection, the core tokens, and the memory watch.
psgrad.sim.local states the rules; ``LocalTransport`` is each rank's view of this world.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..comm.waiting import Idle, PeerFailure
from ..metrics import say

if TYPE_CHECKING:  # the interface only: importing the MPI transport loads MPI
    from ..comm.channel import Handle, SharedStop

_RECENT_POLL = 2.0  # seconds: a rank that polled this recently is waiting, not computing


BLOCK = 0.5  # seconds a wait sleeps without news before it polls again (and checks for a stall)


IDLE_BLOCK = 1e-3  # the same for a wait with idle work to do between polls


_WATCH_EVERY = 0.02  # seconds between two looks at the memory (one costs about 30 us)


class OtherRankFailed(PeerFailure):
    """Another simulated rank failed first: it reported its error; this rank just stops."""

    reported_elsewhere = True


class Stalled(PeerFailure):
    """Every simulated rank has been waiting for the others for the whole stall timeout."""


@dataclass
class Collective:
    parts: dict[int, object] = field(default_factory=dict)
    readers: int = 0


class LocalWorld:
    """What the ranks of one simulated job share: mailboxes, collectives and their fate."""

    def __init__(self, size: int, stall_timeout: float = 60.0, cores: int | None = None) -> None:
        self.size = size
        self.core_count = cores or len(os.sched_getaffinity(0))
        self.cores = threading.Semaphore(self.core_count)
        self.holds = [False] * size
        self.stall_timeout = stall_timeout
        self.lock = threading.Lock()
        # (comm, destination, source, tag) -> messages in arrival order / receives in post order
        self.unexpected: dict[tuple, deque[bytes]] = {}
        self.posted: dict[tuple, deque[Handle]] = {}
        self.collectives: dict[tuple, Collective] = {}  # (comm, k) -> the parts so far
        self.failure: str | None = None
        self.halted = False  # see ``halt``
        self.shared_stop: SharedStop | None = None  # a SIGTERM the process noted for every rank
        # () -> why the job must stop now (the machine is out of memory), or None; see ``watch``
        self.memory_check: Callable[[], str | None] | None = None
        self.memory_short: str | None = None
        self._watched_at = 0.0
        self.progress_at = time.monotonic()
        self.polled = [0.0] * size
        self.running = set(range(size))
        self.news = [threading.Condition(self.lock) for _ in range(size)]
        self.stacked = None  # psgrad.sim.stacked.StackedWorkers, when simulate computes the workers as one
        self.epoch = [0] * size  # per rank: how many times news came for it

    def notify(self, ranks: range | list[int]) -> None:
        """News for ``ranks`` (call with the lock held): a delivery or a completed collective."""
        self.progress_at = time.monotonic()
        for rank in ranks:
            self.epoch[rank] += 1
            self.news[rank].notify_all()

    def sleep(self, rank: int, epoch: int, timeout: float) -> float:
        """Block until news for ``rank`` newer than ``epoch`` came, at most ``timeout`` seconds; the
        seconds slept. A rank that runs on a core token gives it up meanwhile."""
        start = time.perf_counter()
        token = self.holds[rank]
        if token:
            self.leave(rank)
        with self.lock:
            if self.epoch[rank] == epoch and self.failure is None:
                self.news[rank].wait(timeout)
        if token:
            self.enter(rank)
        return time.perf_counter() - start

    def wait_until(self, rank: int, done: Callable[[], bool], idle: Idle | None = None) -> float:
        """Poll ``done`` (which raises through ``check`` when the job failed or stalled) until it
        holds, asleep between polls until news for ``rank``, running ``idle`` between them; the
        seconds slept."""
        slept = 0.0
        while True:
            self.stop_if_halted()  # even if ``done``: no rank builds or trains any further
            epoch = self.epoch[rank]
            if done():
                return slept
            if idle is not None and idle():
                continue
            slept += self.sleep(rank, epoch, BLOCK if idle is None else IDLE_BLOCK)

    def enter(self, rank: int) -> None:
        """Rank ``rank`` starts to run: it takes a core token (waits for one), and the memory is
        looked at (``watch``) before it builds or computes anything more."""
        self.cores.acquire()
        self.holds[rank] = True
        self.watch()

    def watch(self) -> None:
        """At most every ``_WATCH_EVERY`` seconds, ask ``memory_check``; when it gives a reason,
        say it once and ``halt``. Every rank taking a core looks, not only a watcher thread: with
        ranks building large models side by side, memory can run out between two looks 0.2 s
        apart."""
        now = time.monotonic()
        if self.memory_check is None or self.halted or now - self._watched_at < _WATCH_EVERY:
            return
        self._watched_at = now
        reason = self.memory_check()
        if reason is None:
            return
        with self.lock:
            if self.memory_short is not None:
                return
            self.memory_short = reason
        say(f"[psgrad] stopping: {reason}")
        self.halt(f"out of memory: {reason}")

    def leave(self, rank: int) -> None:
        """Rank ``rank`` stops running (it waits or ended): its core token goes to another rank."""
        self.holds[rank] = False
        self.cores.release()

    def borrow_cores(self) -> int:
        """Take every core token no rank holds now, without waiting (a rank that runs a pass for
        others uses their cores); how many it took. Give them back with ``return_cores``."""
        taken = 0
        while taken < self.core_count - 1 and self.cores.acquire(blocking=False):
            taken += 1
        return taken

    def return_cores(self, taken: int) -> None:
        for _ in range(taken):
            self.cores.release()

    def fail(self, reason: str) -> None:
        """The job failed (``reason``, e.g. "rank 2 failed: ..."): every rank stops at its next poll."""
        with self.lock:
            if self.failure is None:
                self.failure = reason
            self.notify(range(self.size))

    def halt(self, reason: str) -> None:
        """Stop every rank at its next wait, even one whose message or collective has come (``fail``
        lets that one go on: a rank that has a usage error to print must still print it)."""
        self.halted = True
        self.fail(reason)

    def stop_if_halted(self) -> None:
        if self.halted:
            raise OtherRankFailed(f"stopping: {self.failure}")

    def finished(self, rank: int) -> None:
        with self.lock:
            self.running.discard(rank)

    def check(self, rank: int) -> None:
        """Raise if the job failed or stalled (called by every poll that found nothing)."""
        if self.failure is not None:
            raise OtherRankFailed(f"stopping: {self.failure}")
        now = time.monotonic()
        self.polled[rank] = now
        if now - self.progress_at > self.stall_timeout and all(
            now - self.polled[r] < _RECENT_POLL for r in list(self.running)
        ):
            self.fail("the job stalled")
            raise Stalled(
                f"no message or collective completed for {self.stall_timeout:.0f} s while every rank was "
                "waiting for another: the simulated job hangs"
            )
