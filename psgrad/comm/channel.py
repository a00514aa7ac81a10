"""The messaging interface every rank's transport has, free of MPI: a ``Handle`` for a pending
send, receive or collective, and a ``Channel``, the transport itself. ``comm.transport`` is the
MPI channel (each rank a process); ``sim.local`` the in-process one (each rank a thread). The
engines are written against this interface and never know which they have.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .waiting import Idle, Patience, SharedPass


class SharedStop(Protocol):
    """A stop signal noted once for several ranks (``stopsaving.NotedStop``)."""

    signum: int

    def agreed(self) -> None: ...


@dataclass(eq=False)
class Handle:
    """A pending send, receive or collective; keeps its request and buffer alive until done.
    Roles use ``test()``, ``wait()`` and ``cancel()``, and ``payload()`` once a receive is done."""

    _request: object
    buffer: bytes | bytearray
    peer: int
    tag: int
    key: object = None
    count: int = -1
    transport: Channel | None = None
    started: float = field(default_factory=time.perf_counter)
    finished: float = 0.0

    def payload(self) -> memoryview:
        """The received bytes (valid after completion of a receive)."""
        return memoryview(self.buffer)[: self.count]

    @property
    def done(self) -> bool:
        return self.finished != 0.0

    def test(self) -> bool:
        """True once the operation completed (and drives the transport's progress)."""
        raise NotImplementedError

    def wait(self, idle: Idle | None = None, patience: Patience | None = None) -> Handle:
        """Block until done; ``idle`` runs between tests."""
        raise NotImplementedError

    def cancel(self) -> None:
        """Cancel a posted receive that will never be matched."""
        raise NotImplementedError


class Channel:
    """Point-to-point and collective non-blocking messaging among ``size`` ranks; this is ``rank``.

    A transport implements the operations below that raise NotImplementedError; ``repost``,
    ``wait_all`` and ``progress`` are built on them."""

    separate_processes = True
    """Each rank is a process of its own (False: the ranks are threads of one process)."""
    rank: int
    size: int
    bytes_sent: int
    bytes_received: int
    idle_seconds: float

    def shared_pass(self) -> SharedPass | None:
        """The forward and backward this rank computes together with others, if any."""
        return None

    def shared_stop(self) -> SharedStop | None:
        """The stop signal this rank's process notes for every rank in it (simulated ranks: its
        main thread notes it), if any; None: the rank notes its own (stopsaving.py)."""
        return None

    def repost(self, handle: Handle) -> Handle:
        """Post the same receive again into the same buffer (after its payload was consumed)."""
        return self.irecv(len(handle.buffer), handle.peer, handle.tag, key=handle.key, buffer=handle.buffer)

    def wait_all(self, handles: Sequence[Handle], idle: Idle | None = None) -> None:
        for handle in handles:
            handle.wait(idle)

    def progress(self, handles: list[Handle]) -> list[Handle]:
        """Drive the transport's progress and drop the handles that are done (cheap; call often).

        Done, not just completed in this call: a handle completed earlier (a local send is done
        when made, a waited one by its wait) would otherwise stay in the caller's list, and with
        it its buffer, for the rest of the run."""
        if not handles:
            return handles
        self.test_some(handles)
        return [h for h in handles if not h.done]

    # ------------------------------------------------------------ what a transport implements
    def dup(self) -> Channel:
        raise NotImplementedError

    def free(self) -> None:
        raise NotImplementedError

    def library(self) -> str:
        raise NotImplementedError

    def check_tag(self, tag: int) -> None:
        raise NotImplementedError

    def isend(self, data: bytes, dest: int, tag: int, key: object = None) -> Handle:
        raise NotImplementedError

    def irecv(
        self, nbytes: int, source: int, tag: int, *, key: object = None, buffer: bytearray | None = None
    ) -> Handle:
        raise NotImplementedError

    def test_some(self, handles: Sequence[Handle]) -> list[int]:
        raise NotImplementedError

    def wait_some(
        self,
        handles: Sequence[Handle],
        timeout: float | None = None,
        patience: Patience | None = None,
        idle: Idle | None = None,
    ) -> list[int]:
        raise NotImplementedError

    def iallgather_sizes(self, nbytes: int) -> tuple[Handle, np.ndarray]:
        raise NotImplementedError

    def iallgatherv_bytes(self, data: bytes, sizes: np.ndarray) -> tuple[Handle, bytearray, np.ndarray]:
        raise NotImplementedError

    def allreduce_sum(self, values: Sequence[float], idle: Idle | None = None) -> np.ndarray:
        raise NotImplementedError

    def all_pids(self) -> list[int]:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        raise NotImplementedError

    def local_rank(self, group: int = 0) -> int:
        raise NotImplementedError

    def abort(self, code: int = 1) -> None:
        raise NotImplementedError
