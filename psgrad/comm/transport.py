"""Non-blocking MPI messaging of wire bytes. THE ONLY module that imports mpi4py's MPI.

Only buffer-based (upper-case) MPI calls are used: mpi4py's lower-case calls pickle, and nothing
pickled ever goes on psgrad's network. Waiting never busy-polls a core: MPI implementations spin
while they wait, and with three ranks on two cores a spinning server steals a worker's core, so
every wait here is a Test loop with an exponential sleep back-off.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mpi4py
import numpy as np

if "mpi4py.MPI" not in sys.modules:
    # MPI starts with the first transport (``start_mpi``), not when this module is imported:
    # ``psgrad simulate`` and the command line import it and need no MPI, and where a lone process
    # cannot start MPI (UCX misconfigured, an MPI that needs its launcher) starting it at import
    # aborted them. mpi4py then finalizes at exit only an MPI that was started.
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = True
from mpi4py import MPI  # noqa: E402 -- after mpi4py's settings above

from .channel import Channel, Handle
from .waiting import WAITING, WORKER_PATIENCE, Backoff, Idle, Patience, PeerFailure


def _peer_failure(err: Exception, peer: int | None) -> PeerFailure:
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    if peer is None:
        return PeerFailure(f"an operation with another rank failed ({first}): a rank has most likely died")
    if peer < 0:
        return PeerFailure(f"a collective operation failed ({first}): one of the ranks has most likely died")
    return PeerFailure(f"communication with rank {peer} failed ({first}): rank {peer} has most likely died")


@dataclass(eq=False)
class MPIHandle(Handle):
    """A pending MPI send, receive or collective; the MPI request and status stay in here."""

    status: MPI.Status = field(default_factory=MPI.Status)

    def test(self) -> bool:
        """True once the operation completed (drives MPI's progress engine)."""
        if not self.done:
            try:
                finished = self._request.Test(self.status)
            except MPI.Exception as err:
                raise _peer_failure(err, self.peer) from None
            if finished:
                self._complete()
        return self.done

    def wait(self, idle: Idle | None = None, patience: Patience | None = None) -> Handle:
        """Block with back-off until done; ``idle`` runs between tests (its work resets the back-off)."""
        backoff = Backoff(patience or Patience())
        with WAITING:
            while not self.test():
                if idle is not None and idle():
                    backoff.reset()
                else:
                    backoff.idle()
        if self.transport is not None:
            self.transport.idle_seconds += backoff.slept
        return self

    def cancel(self) -> None:
        """Cancel a posted receive that will never be matched."""
        if not self.done and self._request != MPI.REQUEST_NULL:
            self._request.Cancel()
            self._request.Wait()
        self.finished = self.finished or time.perf_counter()

    def _complete(self) -> None:
        self.finished = time.perf_counter()
        if self.count < 0:  # a receive
            self.count = self.status.Get_count(MPI.BYTE)
            if self.count == MPI.UNDEFINED or self.count < 0:
                self.count = 0
            if self.transport is not None:
                self.transport.bytes_received += self.count


# The server waits for dozens of messages spread over a step, while the workers compute on the
# cores it shares with them. Each wake-up costs ~25 us of CPU on this VM and evicts a worker, so it
# wakes rarely: on WRN-16-4 (sign, 2 workers) going from 50 us..1 ms to 200 us..4 ms cut the
# server's CPU from ~45 to ~30 ms per step and raised the step rate ~7 %. A wake-up up to 4 ms late
# costs far less than that, and only on the step's last layer.


class Transport(Channel):
    """Point-to-point and collective non-blocking messaging on one communicator."""

    def __init__(self, comm: MPI.Comm | None = None) -> None:
        start_mpi()
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.idle_seconds = 0.0
        # per thread: a colocated rank's serving thread polls beside its worker (--serve-thread)
        self._scratch = threading.local()

    def dup(self) -> Transport:
        """A transport on a duplicate of this communicator (its own matching space for collectives)."""
        return Transport(self.comm.Dup())

    def split(self, *, member: bool) -> Transport | None:
        """A transport over the ranks that are ``member``, in this one's order (collective over
        every rank of this communicator; None on the others)."""
        comm = self.comm.Split(0 if member else MPI.UNDEFINED, key=self.rank)
        return Transport(comm) if member else None

    def free(self) -> None:
        """Release a communicator made by ``dup`` (collective over its ranks, like ``dup``)."""
        if self.comm != MPI.COMM_WORLD:
            self.comm.Free()

    def library(self) -> str:
        """What carries the messages (for config.json)."""
        return mpi_library()

    def check_tag(self, tag: int) -> None:
        if tag > self.comm.Get_attr(MPI.TAG_UB):
            raise ValueError(f"MPI tag {tag} exceeds this MPI's tag range: too many layers for --granularity layer")

    def _handle(
        self, request: MPI.Request, buffer, peer: int, tag: int, *, key: object = None, count: int = -1
    ) -> Handle:
        return MPIHandle(request, buffer, peer, tag, key, count, transport=self)

    # ---------------------------------------------------------------- point to point
    def isend(self, data: bytes, dest: int, tag: int, key: object = None) -> Handle:
        request = self.comm.Isend([data, MPI.BYTE], dest=dest, tag=tag)
        self.bytes_sent += len(data)
        return self._handle(request, data, dest, tag, key=key, count=len(data))

    def irecv(
        self, nbytes: int, source: int, tag: int, *, key: object = None, buffer: bytearray | None = None
    ) -> Handle:
        buf = buffer if buffer is not None and len(buffer) >= nbytes else bytearray(nbytes)
        request = self.comm.Irecv([buf, nbytes, MPI.BYTE], source=source, tag=tag)
        return self._handle(request, buf, source, tag, key=key)

    def test_some(self, handles: Sequence[Handle]) -> list[int]:
        """Indices of the handles that completed now (each is reported once)."""
        if not handles:
            return []
        pool = self._scratch.__dict__.setdefault("statuses", [])
        while len(pool) < len(handles):
            pool.append(MPI.Status())
        statuses = pool[: len(handles)]  # reused: a poll allocates no Status objects
        try:
            done = MPI.Request.Testsome([h._request for h in handles], statuses)
        except MPI.Exception as err:
            for handle in handles:  # find the request that failed: its peer is the one to name
                handle.test()
            raise _peer_failure(err, None) from None
        if not done:
            return []
        for position, i in enumerate(done):
            handles[i].status = MPI.Status(statuses[position])  # completion order, not request order
            handles[i]._complete()
        return list(done)

    def wait_some(
        self,
        handles: Sequence[Handle],
        timeout: float | None = None,
        patience: Patience = WORKER_PATIENCE,
        idle: Idle | None = None,
    ) -> list[int]:
        """Block (with ``patience``'s back-off) until a handle completes; [] on timeout, if none is
        active, or once ``idle`` did some work (so the caller can look at what changed)."""
        if not handles:
            return []
        backoff = Backoff(patience)
        start = time.perf_counter()
        with WAITING:
            while True:
                done = self.test_some(handles)
                if done or (idle is not None and idle()):
                    self.idle_seconds += backoff.slept
                    return done
                if all(h._request == MPI.REQUEST_NULL for h in handles):
                    return []
                if timeout is not None and time.perf_counter() - start > timeout:
                    self.idle_seconds += backoff.slept
                    return []
                backoff.idle()

    # ---------------------------------------------------------------- collectives
    def iallgather_sizes(self, nbytes: int) -> tuple[Handle, np.ndarray]:
        """Start gathering every rank's ``nbytes``; the array fills in when the handle is done."""
        sizes = np.zeros(self.size, dtype=np.int64)
        request = self.comm.Iallgather([np.array([nbytes], dtype=np.int64), MPI.INT64_T], [sizes, MPI.INT64_T])
        return self._handle(request, sizes, -1, -1, count=0), sizes

    def iallgatherv_bytes(self, data: bytes, sizes: np.ndarray) -> tuple[Handle, bytearray, np.ndarray]:
        """Start gathering every rank's ``data`` (of the gathered ``sizes``) into one buffer."""
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        out = bytearray(int(sizes.sum()))
        request = self.comm.Iallgatherv([data, MPI.BYTE], [out, (sizes.tolist(), offsets.tolist()), MPI.BYTE])
        self.bytes_sent += len(data) * (self.size - 1)
        self.bytes_received += int(sizes.sum()) - len(data)
        return self._handle(request, (data, out), -1, -1, count=0), out, offsets

    def _wait_request(self, request: MPI.Request, idle: Idle | None = None) -> None:
        self._handle(request, b"", -1, -1, count=0).wait(idle)

    def allreduce_sum(self, values: Sequence[float], idle: Idle | None = None) -> np.ndarray:
        """Sum floats over all ranks (waits with back-off, running ``idle`` meanwhile)."""
        send = np.asarray(values, dtype=np.float64)
        out = np.zeros_like(send)
        self._wait_request(self.comm.Iallreduce([send, MPI.DOUBLE], [out, MPI.DOUBLE], op=MPI.SUM), idle)
        return out

    def all_pids(self) -> list[int]:
        """Every rank's process id (so MPI's "PID n killed" messages can be mapped to ranks)."""
        pids = np.zeros(self.size, dtype=np.int64)
        self._wait_request(
            self.comm.Iallgather([np.array([os.getpid()], dtype=np.int64), MPI.INT64_T], [pids, MPI.INT64_T])
        )
        return pids.tolist()

    def barrier(self) -> None:
        self._wait_request(self.comm.Ibarrier())

    def ibarrier(self) -> Handle:
        """A barrier to test or wait for, or to give up on (``barrier`` waits for ever)."""
        return self._handle(self.comm.Ibarrier(), b"", -1, -1, count=0)

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """Broadcast a byte string (length first, then the bytes)."""
        size = np.array([len(data) if data is not None else 0], dtype=np.int64)
        self._wait_request(self.comm.Ibcast([size, MPI.INT64_T], root=root))
        buf = bytearray(data) if self.rank == root and data is not None else bytearray(int(size[0]))
        self._wait_request(self.comm.Ibcast([buf, MPI.BYTE], root=root))
        return bytes(buf)

    # ---------------------------------------------------------------- topology and failure
    def local_rank(self, group: int = 0) -> int:
        """This rank's index among the ranks on its node that pass the same ``group`` (for picking
        a GPU: workers count only workers, so a server beside them takes no GPU's index).
        Collective over every rank."""
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            same = node.Split(group, key=self.rank)
            try:
                return same.Get_rank()
            finally:
                same.Free()
        finally:
            node.Free()

    def abort(self, code: int = 1) -> None:
        """End the whole MPI job now (every rank), with ``code``."""
        sys.stdout.flush()
        sys.stderr.flush()
        # mpiexec forwards each rank's output through its proxies, and an abort can end them before
        # the last lines (the error that caused it) are through: give them a moment
        time.sleep(0.5)
        _run_hooks(_BEFORE_ABORT)
        self.comm.Abort(code)
        os._exit(code)  # Abort does not return; this is for MPI stubs that do


_BEFORE_ABORT: list[Callable[[], None]] = []
_AFTER_FINALIZE: list[Callable[[], None]] = []


def on_job_end(*, before_abort: Callable[[], None], after_finalize: Callable[[], None]) -> None:
    """What this process does beside MPI as its job ends: ``before_abort`` right before
    ``MPI_Abort`` (which leaves the MPI library's shared-memory files behind), ``after_finalize``
    right after ``MPI_Finalize``. psgrad's runtime sets these (``psgrad.runtime.job_end_hooks``);
    a hook set twice runs once."""
    for hooks, hook in ((_BEFORE_ABORT, before_abort), (_AFTER_FINALIZE, after_finalize)):
        if hook not in hooks:
            hooks.append(hook)


def _run_hooks(hooks: list[Callable[[], None]]) -> None:
    for hook in hooks:
        hook()


def mpi_library() -> str:
    """The MPI library's name and version (its first line)."""
    return MPI.Get_library_version().strip().splitlines()[0]


def start_mpi() -> None:
    """Initialise MPI at thread level multiple, unless it runs already (a process that imported
    mpi4py's MPI before this module had mpi4py start it then)."""
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)


def _mpi_running() -> bool:
    """Started (``start_mpi`` or mpi4py's import) and not yet finalized."""
    return MPI.Is_initialized() and not MPI.Is_finalized()


def world_size() -> int:
    start_mpi()
    return MPI.COMM_WORLD.Get_size()


def world_rank() -> int:
    start_mpi()
    return MPI.COMM_WORLD.Get_rank()


def abort_if_running(code: int) -> None:
    """End every rank of the job with ``code`` if MPI runs (started and not finalized)."""
    if _mpi_running():
        _run_hooks(_BEFORE_ABORT)
        MPI.COMM_WORLD.Abort(code)
        # MPICH's Abort returns when another rank's abort is under way and this process outlives
        # it (stop signals ignored): the rest of the script, its exit handlers included, must not run
        os._exit(code)


def finalize() -> None:
    """Finalize MPI (if it was started), then run the hooks for after it (``on_job_end``: psgrad's
    runtime lets this process's sentinels hear their goodbye, so a rank that dies before that, in
    MPI_Finalize, is named by its sentinel). Once is enough."""
    if _mpi_running():
        MPI.Finalize()
    _run_hooks(_AFTER_FINALIZE)


def finalize_together() -> None:
    """The barrier ``finalize_and_exit`` holds (blocking: a nonblocking collective never matches a
    blocking one), then ``finalize``: a rank that goes on living after MPI, beside ranks that leave."""
    if _mpi_running():
        MPI.COMM_WORLD.Barrier()
    finalize()


def finalize_and_exit(code: int = 0) -> None:
    """Finalize MPI, flush, and leave the process through the C library's ``exit``, skipping the
    interpreter's teardown.

    1. A barrier: every rank is done with MPI before any leaves (on a shaped run a leaving rank
       takes its network namespace with it).
    2. ``MPI_Finalize`` and the sentinels' goodbye (``finalize``).
    3. Python's streams are flushed.
    4. ``exit(code)`` from the C library: it runs the C ``atexit`` handlers but not the
       interpreter's teardown. Both halves matter:
       - MPICH tells its process manager that the rank is done (PMI ``finalize``) in a C
         ``atexit`` handler, not in ``MPI_Finalize``. A rank that leaves without it (``os._exit``)
         looks to hydra as if it had crashed, and hydra SIGKILLs every rank of the job still
         alive: a slower rank still on its way out dies by signal 9 after a job that succeeded.
       - After a torch.distributed (gloo) job, the interpreter's teardown can destroy a gloo
         thread still joinable and abort the process ("terminate called without an active
         exception") after all the work was done.
    """
    if _mpi_running():
        MPI.COMM_WORLD.Barrier()
    finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).exit(code)
    os._exit(code)  # not reached: exit does not return
