"""Every rank of a job in one process: the in-process transport behind ``psgrad simulate``.

``LocalTransport`` has the interface of ``transport.Transport``, so every role runs unchanged on
it, each rank in a thread of its own. The ranks share one ``LocalWorld``:
1. A send is buffered at once (it completes immediately); it fills the first receive the
   destination posted for that source and tag on that communicator (which then reads the
   sender's immutable bytes in place: no copy), or waits in the queue of
   unexpected messages for that (communicator, destination, source, tag), in arrival order. So
   messages between two ranks never overtake each other, as in MPI, and the bytes received are
   the bytes sent. (psgrad never receives from any source or with any tag, so matching is a
   dictionary lookup.)
2. A collective is the k-th collective call of each rank on a communicator; it completes once
   every rank made its k-th call. Results combine the ranks' parts in rank order.
3. A communicator is a name: ``dup`` of the k-th kind on every rank gives the same name, so no
   rank waits for another to duplicate one.
4. Failure: when a rank's thread fails, the world is marked failed and every other rank's next
   poll raises ``OtherRankFailed``, so no thread is left waiting for a rank that has gone.
5. Hangs: when no message or collective has completed for the stall timeout while every rank
   still running kept polling, they all wait for each other: every poll raises ``Stalled``.
6. Waiting sleeps until news: a rank blocks on its condition variable until a message is
   delivered to it or a collective completes (or, when its wait has idle work, a millisecond),
   instead of polling with back-off sleeps as the MPI transport must.
7. Core tokens: a rank runs only while it holds one of as many tokens as the process has cores
   (``enter``/``leave``), and gives it up while it sleeps. Seventeen threads running torch's
   small operations at once fought over the GIL: 95,000 futex calls a step, 40 % of the CPU
   in the kernel, on a 16-worker simulation.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..comm.channel import Channel, Handle, SharedStop
from ..comm.waiting import Idle, Patience, PeerFailure, SharedPass
from .world import BLOCK, IDLE_BLOCK, Collective, LocalWorld


@dataclass(eq=False)
class LocalHandle(Handle):
    """A pending local operation: a receive fills when a send matches it; a collective completes
    when the last rank joins it (``on_done`` then fills the caller's outputs)."""

    world: LocalWorld | None = None
    rank: int = 0
    arrived: int = -1  # a receive: how many bytes were delivered (set by the sender's thread)
    delivered: bytes | None = None  # a receive: the sender's bytes themselves (immutable: no copy)
    collective: tuple | None = None
    on_done: Callable[[dict], None] | None = None
    key_comm: tuple = ()  # a receive: the communicator it was posted on

    __eq__ = object.__eq__  # identity: a handle is found in the posted list by itself, not its fields
    __hash__ = object.__hash__

    def test(self) -> bool:
        if self.done:
            return True
        world = self.world
        if self.collective is not None:
            with world.lock:
                entry = world.collectives.get(self.collective)
                complete = entry is not None and len(entry.parts) == world.size
                if complete:
                    entry.readers += 1
                    if entry.readers == world.size:
                        del world.collectives[self.collective]
            if complete:
                self.on_done(entry.parts)
                self._complete()
                return True
        elif self.arrived >= 0:
            self.count = self.arrived
            self._complete()
            return True
        world.check(self.rank)
        return False

    def wait(self, idle: Idle | None = None, patience: Patience | None = None) -> Handle:
        """Block until done, asleep until news for this rank (``idle`` runs between polls)."""
        slept = self.world.wait_until(self.rank, self.test, idle)
        if self.transport is not None:
            self.transport.idle_seconds += slept
        return self

    def cancel(self) -> None:
        if not self.done:
            with self.world.lock:
                queue = self.world.posted.get((self.key_comm, self.rank, self.peer, self.tag), ())
                if self in queue:
                    queue.remove(self)
        self.finished = self.finished or time.perf_counter()

    def payload(self) -> memoryview:
        """The received bytes: a view of the bytes the sender handed over (``buffer``, the receive's
        capacity, is left untouched, as MPI would fill it)."""
        if self.delivered is not None:
            return memoryview(self.delivered)[: self.count]
        return super().payload()

    def _complete(self) -> None:
        self.finished = time.perf_counter()
        if self.arrived >= 0 and self.transport is not None:  # a receive
            self.transport.bytes_received += self.count


class Meeting:
    """Some ranks of a world meet, once a round: each brings a part, the last to come runs ``act``
    on every part (by rank) while the others sleep, and each gets its result.

    1. ``meet`` adds the caller's part; the ``members``-th part closes the round.
    2. The closing rank runs ``act`` on its core token and publishes the result; the round is
       news for every rank of the world.
    3. The others wait as a receive does: asleep without their core token, running ``idle``
       between polls (a colocated rank keeps serving), stopped by a failed or stalled job.
    """

    def __init__(self, world: LocalWorld, members: int) -> None:
        self.world, self.members = world, members
        self.parts: dict[int, object] = {}
        self.round = 0
        self.result: object = None

    def meet(self, rank: int, part: object, act: Callable[[dict], object], idle: Idle | None = None) -> object:
        world = self.world
        with world.lock:
            round_ = self.round
            self.parts[rank] = part
            last = len(self.parts) == self.members
        if last:
            result = act(dict(sorted(self.parts.items())))
            with world.lock:
                self.result, self.parts = result, {}
                self.round += 1
                world.notify(range(world.size))
            return result

        def closed() -> bool:
            with world.lock:
                if self.round != round_:
                    return True
            world.check(rank)
            return False

        world.wait_until(rank, closed, idle)
        return self.result


class LocalTransport(Channel):
    """Rank ``rank`` of ``world``: a ``Channel``, as the MPI transport is."""

    separate_processes = False

    def __init__(self, world: LocalWorld, rank: int, comm: tuple = ("world",)) -> None:
        self.world = world
        self.comm_name = comm
        self.rank = rank
        self.size = world.size
        self.bytes_sent = 0
        self.bytes_received = 0
        self.idle_seconds = 0.0
        self._collectives = 0
        self._dups = 0

    def shared_stop(self) -> SharedStop | None:
        return self.world.shared_stop

    def dup(self) -> LocalTransport:
        self._dups += 1
        return LocalTransport(self.world, self.rank, (*self.comm_name, "dup", self._dups))

    def free(self) -> None:
        """Nothing to release: a local communicator is a name."""

    def check_tag(self, tag: int) -> None:
        """Any tag fits: there is no MPI tag range here."""

    def library(self) -> str:
        return "none (psgrad simulate: every rank in one process)"

    def shared_pass(self) -> SharedPass | None:
        """This rank's part in the simulation's stacked compute (``sim.stacked``), if it has one."""
        stacked = self.world.stacked
        return None if stacked is None else stacked.member(self.rank)

    # ---------------------------------------------------------------- point to point
    def isend(self, data: bytes, dest: int, tag: int, key: object = None) -> Handle:
        world, key = self.world, (self.comm_name, dest, self.rank, tag)
        payload = data if type(data) is bytes else bytes(data)  # bytes cannot change after the send
        with world.lock:
            waiting = world.posted.get(key)
            if waiting:
                _deliver(waiting.popleft(), payload)
                world.notify([dest])
            else:
                world.unexpected.setdefault(key, deque()).append(payload)
        self.bytes_sent += len(payload)
        handle = LocalHandle(None, data, dest, tag, key, len(payload), self, world=world, rank=self.rank)
        handle.finished = time.perf_counter()
        return handle

    def irecv(
        self, nbytes: int, source: int, tag: int, *, key: object = None, buffer: bytearray | None = None
    ) -> Handle:
        self.world.stop_if_halted()  # a server posts a buffer for every layer of every worker in one go
        buf = buffer if buffer is not None and len(buffer) >= nbytes else bytearray(nbytes)
        handle = LocalHandle(None, buf, source, tag, key, -1, self, world=self.world, rank=self.rank)
        handle.key_comm = self.comm_name
        world, key = self.world, (self.comm_name, self.rank, source, tag)
        with world.lock:
            arrived = world.unexpected.get(key)
            if arrived:
                _deliver(handle, arrived.popleft())
            else:
                world.posted.setdefault(key, deque()).append(handle)
        return handle

    def test_some(self, handles: Sequence[Handle]) -> list[int]:
        # a server polls its hundreds of pending receives after every delivery: only the handles
        # that can have completed are tested (a receive something arrived for, a collective)
        done = [
            i
            for i, h in enumerate(handles)
            if not h.finished and (h.arrived >= 0 or h.collective is not None) and h.test()
        ]
        if not done and handles:
            self.world.check(self.rank)
        return done

    def wait_some(
        self,
        handles: Sequence[Handle],
        timeout: float | None = None,
        patience: Patience | None = None,
        idle: Idle | None = None,
    ) -> list[int]:
        """As the MPI transport's, asleep until news for this rank (``patience`` has no use here)."""
        start, done = time.perf_counter(), []
        while not all(handle.done for handle in handles):
            epoch = self.world.epoch[self.rank]
            done = self.test_some(handles)
            if done or (idle is not None and idle()):
                break
            left = BLOCK if timeout is None else timeout - (time.perf_counter() - start)
            if left <= 0:
                break
            self.idle_seconds += self.world.sleep(self.rank, epoch, min(left, BLOCK if idle is None else IDLE_BLOCK))
        return done

    # ---------------------------------------------------------------- collectives
    def _join(self, part: object, on_done: Callable[[dict], None]) -> LocalHandle:
        """This rank's next collective on this communicator, with its ``part``."""
        name = (self.comm_name, self._collectives)
        self._collectives += 1
        world = self.world
        with world.lock:
            entry = world.collectives.setdefault(name, Collective())
            entry.parts[self.rank] = part
            if len(entry.parts) == world.size:
                world.notify(range(world.size))
        return LocalHandle(
            None, b"", -1, -1, None, 0, self, world=world, rank=self.rank, collective=name, on_done=on_done
        )

    def _collect(self, part: object, idle: Idle | None = None) -> list:
        """Every rank's ``part``, in rank order (blocking)."""
        result: list = []
        self._join(part, lambda parts: result.extend(parts[r] for r in range(self.size))).wait(idle)
        return result

    def iallgather_sizes(self, nbytes: int) -> tuple[Handle, np.ndarray]:
        sizes = np.zeros(self.size, dtype=np.int64)

        def fill(parts: dict) -> None:
            sizes[:] = [parts[r] for r in range(self.size)]

        return self._join(int(nbytes), fill), sizes

    def iallgatherv_bytes(self, data: bytes, sizes: np.ndarray) -> tuple[Handle, bytearray, np.ndarray]:
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        out = bytearray(int(sizes.sum()))

        def fill(parts: dict) -> None:
            out[:] = b"".join(parts[r] for r in range(self.size))

        self.bytes_sent += len(data) * (self.size - 1)
        self.bytes_received += int(sizes.sum()) - len(data)
        return self._join(bytes(data), fill), out, offsets

    def allreduce_sum(self, values: Sequence[float], idle: Idle | None = None) -> np.ndarray:
        parts = self._collect(np.asarray(values, dtype=np.float64), idle)
        total = parts[0].copy()
        for part in parts[1:]:  # rank order: the same sum on every rank
            total += part
        return total

    def all_pids(self) -> list[int]:
        return self._collect(os.getpid())

    def barrier(self) -> None:
        self._collect(None)

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        return self._collect(bytes(data) if self.rank == root and data is not None else None)[root] or b""

    def local_rank(self, group: int = 0) -> int:
        groups = self._collect(group)
        return sum(1 for r in range(self.rank) if groups[r] == group)

    def abort(self, code: int = 1) -> None:
        """Stop the other ranks (their next poll raises); this rank's own error goes on up."""
        self.world.fail(f"rank {self.rank} failed")


def _deliver(receive: LocalHandle, payload: bytes) -> None:
    if len(payload) > len(receive.buffer):
        raise PeerFailure(
            f"a {len(payload)}-byte message for rank {receive.rank} (tag {receive.tag}) does not fit the "
            f"{len(receive.buffer)}-byte receive it matched"
        )
    # a send's bytes never change (isend makes them bytes), so the receiver reads them in place: no
    # copy, where a 16-worker simulation copied every model and gradient once more per message
    receive.delivered = payload
    receive.arrived = len(payload)
