"""The progress watchdog (``--timeout``): a job that stops making progress ends, naming the rank.

A helper thread on every rank, on its own duplicate communicator:
1. Every ``period`` seconds it sends a heartbeat: rank 0 (the monitor) to every rank, every other
   rank to rank 0. A heartbeat is a small msgpack map: what the rank's main thread is doing, how long that thread has been inside a transport wait, and its slowest step so far.
   A stopped (SIGSTOP), dead or cut-off process sends none: its threads do not run.
2. Rank 0 aborts the job when a rank sent nothing for the timeout, naming the rank, its role and
   what it last reported, with what every other rank was waiting for. Every other rank aborts
   when rank 0 was silent for the timeout plus a grace period, 10 s or the timeout if shorter (so
   rank 0's more precise verdict on a silent worker comes first).
3. Rank 0 also aborts when every rank has been inside a wait for longer than the timeout: each
   waits for another, so none ever will progress (a rank computing, e.g. evaluating, is not waiting).
   A rank that said goodbye counts as waiting: it waits in ``stop`` for every other rank's goodbye,
   so the ranks still watched, rank 0 alone included, can only wait for one another.
   When only some ranks have waited that long, rank 0 says once which ranks hold them up and what
   those last reported (a DataLoader stuck on one rank, a long evaluation), and lets the job go on:
   a busy rank may yet finish. It says so again only after the waits have ended.
4. The timeout: ``--timeout`` seconds, or by default ``max(FLOOR, FACTOR x the slowest step seen
   on any rank)``, so a model whose steps take minutes is not cut off, and a hang on a fast model
   ends within about a minute.
5. On a clean end each rank says goodbye, and is watched no longer; the ranks then wait for one
   another, so no rank exits while a peer's thread may still send it a heartbeat.
6. A rank that dies outright takes the job down with it at once (the launcher's cleanup), faster
   than any heartbeat: its sentinel process names it (runtime/sentinel.py).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgpack

from ..comm.channel import Handle
from ..comm.transport import Transport
from ..comm.waiting import WAITING
from ..metrics import say
from . import segments
from .sentinel import FAILURES, Sentinel, adopt_early

FLOOR = 60.0
FACTOR = 10.0
GRACE = 10.0  # extra seconds a rank gives rank 0 before naming it (at most the timeout itself)
_TAG = 7
_MAX_BYTES = 1024


@dataclass
class Report:
    """What the main thread of this rank is up to (read by the watchdog thread)."""

    doing: str = "setting up"
    slowest_step: float = 0.0


@dataclass
class _Seen:
    at: float
    doing: str = "setting up"
    waiting: float = 0.0
    slowest_step: float = 0.0


class Watchdog:
    """Start with ``start()`` on every rank at the same point (it duplicates the communicator);
    ``stop()`` at the end. ``names(rank)`` gives a rank's role for the messages."""

    def __init__(
        self,
        transport: Transport,
        *,
        report: Callable[[], Report],
        names: Callable[[int], str],
        timeout: float = 0.0,
        claim_dir: str | None = None,
        setting: str = "--timeout {:.0f}",
    ) -> None:
        self.world = transport
        self.report = report
        self.names = names
        self.fixed_timeout = timeout
        self.setting = setting  # how its verdict names the timeout: the command line's flag, or init's keyword
        self.rank, self.size = transport.rank, transport.size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="psgrad-watchdog", daemon=True)
        self.comm: Transport | None = None
        self.seen: dict[int, _Seen] = {}
        self.claim_dir = claim_dir
        self.sentinel: Sentinel | None = None
        self._held_up_said = False  # rank 0 said which ranks hold the others up, and they still wait

    # ---------------------------------------------------------------- main thread
    def start(self) -> Watchdog:
        if self.size > 1 and self.world.separate_processes:
            # one name per job for the sentinels' first-death claim: rank 0's pid and clock
            job = self.world.broadcast_bytes(f"{os.getpid()}-{time.time_ns()}".encode()).decode()
            directory = Path(self.claim_dir) if self.claim_dir else Path(tempfile.gettempdir())
            directory.mkdir(parents=True, exist_ok=True)
            claim_path, role, mapped = directory / f".psgrad-{job}.died", self.names(self.rank), segments.job_segments()
            record = Path(self.claim_dir) / FAILURES if self.claim_dir else None  # only into a log dir
            told = dict(rank=self.rank, role=role, segments=mapped, record=record)
            self.sentinel = adopt_early(claim_path, **told) or Sentinel(claim_path, **told)
            self.comm = self.world.dup()
            now = time.monotonic()
            peers = range(1, self.size) if self.rank == 0 else [0]
            self.seen = {r: _Seen(now) for r in peers}
            self._recvs = [self.comm.irecv(_MAX_BYTES, r, _TAG) for r in peers]
            self._sends: list[Handle] = []
            self._thread.start()
        return self

    def claim(self, reason: str) -> bool | None:
        """This rank is about to abort the job: its victims' sentinels must not blame them.
        Whether this rank claimed before any other; None without a sentinel (one process)."""
        return None if self.sentinel is None else self.sentinel.claim(reason)

    def at_step(self, step: int) -> None:
        """This rank starts training step ``step``: its sentinel keeps it for a failure record."""
        if self.sentinel is not None:
            self.sentinel.at_step(step)

    def stop(self, *, together: bool = True) -> None:
        """Say goodbye (peers stop watching this rank), end the thread, and with ``together``
        (every rank stops: a run's clean end) wait until every rank's thread has ended.

        Waiting for the others matters on slow links: a rank that left at once could exit while a
        peer's thread, not yet past that rank's goodbye, sent it a heartbeat, and an MPI send to
        a process that has gone never returns (a 1 Mbit/s run's rank 0, evaluating last, hung so)."""
        if self.sentinel is not None:
            self.sentinel.bye()
        if self.comm is None:
            return
        self._stop.set()
        self._thread.join()
        for handle in self._recvs:
            handle.cancel()
        self._heartbeat(bye=True)
        deadline = time.monotonic() + 5.0
        while self._sends and time.monotonic() < deadline:
            self._sends = self.comm.progress(self._sends)
            time.sleep(0.001)
        if together:
            self.comm.barrier()  # no thread sends any more heartbeats once every rank is here
        self.comm.free()
        self.comm = None

    # ---------------------------------------------------------------- the thread
    def timeout(self) -> float:
        if self.fixed_timeout > 0:
            return self.fixed_timeout
        slowest = max([self.report().slowest_step, *(s.slowest_step for s in self.seen.values())])
        return max(FLOOR, FACTOR * slowest)

    def _loop(self) -> None:
        try:
            next_beat = 0.0
            while not self._stop.wait(min(0.25, self.timeout() / 20)):
                now = time.monotonic()
                if now >= next_beat:
                    self._heartbeat()
                    next_beat = now + min(5.0, self.timeout() / 5)
                self._receive(now)
                self._check(time.monotonic())
        except Exception as err:  # noqa: BLE001  the watchdog must never take a healthy job down silently
            say(f"[psgrad rank {self.rank}] watchdog stopped: {type(err).__name__}: {err}")

    def _heartbeat(self, bye: bool = False) -> None:
        mine = self.report()
        data = msgpack.packb(
            {
                "doing": mine.doing[:200],
                "waiting": WAITING.seconds(),
                "slowest": mine.slowest_step,
                "bye": bye,
            }
        )
        for peer in self.seen if not bye else (range(1, self.size) if self.rank == 0 else [0]):
            self._sends.append(self.comm.isend(data, peer, _TAG))
        self._sends = self.comm.progress(self._sends)

    def _receive(self, now: float) -> None:
        for i in self.comm.test_some(self._recvs):
            handle = self._recvs[i]
            try:
                beat = msgpack.unpackb(handle.payload(), raw=False, max_str_len=256, max_map_len=8)
                seen = _Seen(now, str(beat["doing"]), float(beat["waiting"]), float(beat["slowest"]))
            except Exception:  # noqa: BLE001  a garbled heartbeat still shows the rank is alive
                seen = _Seen(now)
                beat = {}
            if beat.get("bye"):
                self.seen.pop(handle.peer, None)
            else:
                self.seen[handle.peer] = seen
                self._recvs[i] = self.comm.repost(handle)

    def _check(self, now: float) -> None:
        timeout = self.timeout()
        for peer, seen in self.seen.items():
            limit = timeout if self.rank == 0 else timeout + min(GRACE, timeout)
            if now - seen.at > limit:
                self._abort(
                    f"no heartbeat from rank {peer} ({self.names(peer)}) for {now - seen.at:.0f} s: the process is "
                    f"stopped, dead or cut off. It last reported: {seen.doing!r}.",
                    timeout,
                )
        if self.rank == 0:
            waits = {
                0: WAITING.seconds(),
                **{r: s.waiting + (now - s.at) if s.waiting else 0.0 for r, s in self.seen.items()},
            }
            if min(waits.values()) > timeout:  # the peers no longer seen said goodbye: they wait in stop()
                done = sorted(set(range(1, self.size)) - set(self.seen))
                ended = f" (rank{'s' * (len(done) > 1)} {', '.join(map(str, done))} ended, waiting for the rest)"
                self._abort(
                    f"every rank has been waiting for over {timeout:.0f} s{ended if done else ''}: none can progress.",
                    timeout,
                )
            self._say_who_holds_up(waits, timeout)

    def _say_who_holds_up(self, waits: dict[int, float], timeout: float) -> None:
        """Rank 0, once per stall (a rank has waited longer than the timeout): the ranks waiting,
        and the ranks not waiting that they wait for, with what those last reported."""
        if max(waits.values()) <= timeout:
            self._held_up_said = False
            return
        busy = sorted(r for r, w in waits.items() if not w)
        if self._held_up_said or not busy:  # none busy: every rank waits, and the abort above comes
            return
        self._held_up_said = True
        doing = {0: self.report().doing, **{r: s.doing for r, s in self.seen.items()}}
        waiters = ", ".join(f"rank {r} ({self.names(r)}) {w:.0f} s" for r, w in sorted(waits.items()) if w)
        holders = "; ".join(f"rank {r} ({self.names(r)}), last reported {doing[r]!r}" for r in busy)
        say(
            f"[psgrad watchdog] a wait passed {timeout:.0f} s: {waiters} so far; busy meanwhile: {holders}. The job goes "
            f"on: it ends only when every rank waits or a rank goes silent ({self.setting.format(timeout)}). "
            "A rank busy for this long is slow, or stuck in its own code (a data loader, a lock)."
        )

    def _abort(self, verdict: str, timeout: float) -> None:
        mine = self.report()
        lines = [f"  rank {self.rank} ({self.names(self.rank)}): {mine.doing} (waiting {WAITING.seconds():.0f} s)"]
        now = time.monotonic()
        for peer, seen in sorted(self.seen.items()):
            lines.append(
                f"  rank {peer} ({self.names(peer)}): {seen.doing} (heard {now - seen.at:.0f} s ago, waiting {seen.waiting:.0f} s then)"
            )
        say(
            f"[psgrad watchdog] rank {self.rank}: {verdict} Ending the job ({self.setting.format(timeout)}).\n"
            + "\n".join(lines)
        )
        self.claim(verdict)
        self.world.abort(1)
