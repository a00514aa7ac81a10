"""Your loop's job stops together: a rank stopped by a signal (Ctrl-C, SIGTERM) passes the signal
on to every other rank, and the job ends once every rank has run its ``finally`` blocks.

1. ``StopTogether(transport)`` (collective, in ``init``): a communicator of its own and a receive
   posted from every other rank; ``start``: a helper thread that tests them every 50 ms, and
   psgrad's own handlers of SIGINT and SIGTERM wrapped to note that this rank is stopping.
2. ``stop``, from the exception hook once the rank's ``finally`` blocks ran: it sends the signal's
   number to every other rank, then waits in a barrier.
3. A rank that hears of a stop, and is not stopping a second later, gets the same signal in its
   main thread: it stops as the first did (its ``finally`` blocks run, it says where and from which rank
   the stop came) and comes to the barrier too. A rank that got the signal itself is stopping
   already: the first notice is sent only after a rank's ``finally`` blocks, and a second signal
   there would cut them short.
4. The barrier's wait ends once every rank is in it, after ``grace`` seconds at most (a rank stuck
   in its ``finally`` blocks, or one whose own handler kept it going), or at a second Ctrl-C; the
   rank then aborts the job. Before, a rank with nothing to do on its way (a serving rank) aborted
   the job at once, and cut the others' ``finally`` blocks short: a worker's checkpoint save.
A rank that stops no longer hears of DataLoader workers killed by the same signal, and a library
thread's error report (``report_from_thread``) waits a moment and is left out once it stops.
5. A saved stop (``psgrad.should_stop``, userloop/savedstop.py) changes 3 for SIGTERM: a worker
   that asks (``absorb``) takes its first SIGTERM itself, and tells the serving-only ranks
   (``ARMED``); such a serving rank notes its own first SIGTERM, tells the workers that asked
   (``NOTED``), and serves on until they stop. A stop passed on by a rank still stops at once.
   A worker that asks also tells the other workers (``ASKED``): each waits on every other's vote,
   so one that never asks is named instead of leaving them waiting.
``where_it_stopped`` reads a stop's traceback for the line each rank says.
"""

from __future__ import annotations

import os
import signal
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable

from ..comm.transport import Transport
from ..comm.waiting import Backoff, Patience
from ..runtime import signals
from ..runtime.signals import STOP_SIGNALS
from ..stopsaving import NotedStop

GRACE_SECONDS = 30.0  # Slurm's default KillWait: its SIGKILL follows the SIGTERM 30 s later
_TAG = 9
_POLL_SECONDS = 0.05
_OWN_SIGNAL_FIRST_SECONDS = 1.0
ARMED = 1 << 8
"""A worker's notice to the serving-only ranks: it saves its stops (module docstring, 5)."""
NOTED = 2 << 8
"""A serving-only rank's notice to the workers that save their stops: ``NOTED | signal``."""
ASKED = 3 << 8
"""A worker's notice to the other workers: it asked too (module docstring, 5)."""
_SIGNAL = 0xFF
THREAD_REPORT_SECONDS = 0.5
"""How long a library thread's error report waits before it is printed (``report_from_thread``)."""


class StopTogether:
    """One per rank of your loop's job; ``passed_from`` is the rank whose stop this rank heard."""

    def __init__(self, transport: Transport) -> None:
        self.comm = transport.dup()
        self.rank, self.size = transport.rank, transport.size
        self.stopping = False
        self.passed_from: int | None = None
        self.absorb: Callable[[int], bool] | None = None  # a worker's saved stop: whether it took a SIGTERM
        self.saving: list[int] = []  # on a serving-only rank, the workers that save their stops (ARMED)
        self.noted_by_server = 0  # on a worker, a serving-only rank's noted signal (NOTED)
        self.asked: list[int] = []  # on a worker, the other workers that asked too (ASKED)
        # a serving-only rank's own SIGTERM, which it serves on after: the workers stop it
        self._noted = NotedStop(
            self.rank, until="the workers agree on (psgrad.should_stop()); serving until then", patience=False
        )
        self._sent: list = []  # notices on their way: an MPI send's buffer must outlive it
        peers = [r for r in range(self.size) if r != self.rank]
        self._notices = [self.comm.irecv(8, source=r, tag=_TAG) for r in peers]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="psgrad-stop", daemon=True)

    def start(self) -> StopTogether:
        """Note this rank's own stops (main thread: after ``init`` set its handlers), and listen."""
        for sig in (signal.SIGINT, *STOP_SIGNALS) if threading.current_thread() is threading.main_thread() else ():
            handler = signal.getsignal(sig)
            if handler is signal.default_int_handler or signals.is_psgrads_handler(handler):
                signal.signal(sig, self._noting(handler))
        if self._notices:
            self._thread.start()
        return self

    def _noting(self, handler):
        def noted(signum: int, frame) -> None:
            if signum in STOP_SIGNALS and self.passed_from is None and self._takes(signum):
                return  # to be saved (module docstring, 5)
            # torch's SIGCHLD handler may yet raise a loader worker's death here, at any call or
            # loop jump (where Python runs a pending handler): every call until the handler is
            # replaced is inside a try, with room for two deaths (a loop there raised on its range())
            try:
                _stop_hearing_loader_workers()
            except RuntimeError:
                try:
                    _stop_hearing_loader_workers()
                except RuntimeError:
                    _stop_hearing_loader_workers()
            self.stopping = True
            handler(signum, frame)

        return noted

    def _listen(self) -> None:
        heard = None  # the first notice: (rank, signal, when)
        while not self._done.wait(_POLL_SECONDS):
            for i in self.comm.test_some(self._notices):
                notice = self._notices[i]
                value = int.from_bytes(notice.payload(), "little")
                kind = value & ~_SIGNAL
                if kind in (ARMED, NOTED, ASKED):  # a saved stop's: more notices may follow
                    self._notices[i] = self.comm.irecv(8, source=notice.peer, tag=_TAG)
                    if kind == NOTED:
                        self.noted_by_server = value & _SIGNAL
                    else:
                        (self.saving if kind == ARMED else self.asked).append(notice.peer)
                    continue
                heard = heard or (notice.peer, value, time.monotonic())
            # a Ctrl-C reached every rank at once, but a rank inside a long torch call runs its
            # handler only after it: given a moment, it stops by its own signal, not one passed on
            if heard and not self.stopping and time.monotonic() - heard[2] >= _OWN_SIGNAL_FIRST_SECONDS:
                self.stopping, self.passed_from = True, heard[0]
                signal.pthread_kill(threading.main_thread().ident, heard[1])

    def tell(self, value: int, *, ranks: list[int]) -> None:
        """Send ``value`` (``ARMED``, ``NOTED | signal``) to each of ``ranks``."""
        notice = value.to_bytes(8, "little")
        self._sent = [h for h in self._sent if not h.test()]
        self._sent += [self.comm.isend(notice, r, _TAG) for r in ranks]

    def _takes(self, signum: int) -> bool:
        """Whether this rank takes a SIGTERM itself, to be saved (module docstring, 5): a worker
        that asked, or a serving-only rank the workers asked to note its first one."""
        if self.absorb is not None:
            return self.absorb(signum)
        if not self.saving:
            return False
        first = not self._noted.signum
        taken = self._noted.take(signum)
        if taken and first:
            self.tell(NOTED | signum, ranks=self.saving)
        return taken

    def stop(self, signum: int, *, grace: float = GRACE_SECONDS) -> None:
        """Tell every other rank of this rank's stop by ``signum`` (unless it heard of it from one),
        then wait until every rank got here, ``grace`` seconds at most, or a second Ctrl-C."""
        self.stopping = True
        sends = []  # kept to the end: an MPI send's buffer must outlive it
        if self.passed_from is None:
            notice = signum.to_bytes(8, "little")
            sends = [self.comm.isend(notice, r, _TAG) for r in range(self.size) if r != self.rank]
        together, deadline = self.comm.ibarrier(), time.monotonic() + grace
        backoff = Backoff(Patience(spins=0, min_sleep=1e-3, max_sleep=_POLL_SECONDS))
        try:
            while not together.test() and time.monotonic() < deadline:
                backoff.idle()
        except KeyboardInterrupt:
            pass
        del sends

    def close(self) -> None:
        """At a clean end, before MPI is left: stop listening (the thread ends, the receives are cancelled)."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        for handle in self._notices:
            handle.cancel()


def _stop_hearing_loader_workers() -> None:
    """A scheduler's SIGTERM reaches every process of the job, torch's DataLoader workers too, and
    they die of it while this rank, kept alive to run your ``finally`` blocks, stops. torch's
    SIGCHLD handler then raises each death as an error in the main thread, wherever it is: the
    stop became a RuntimeError (status 1), or two tracebacks a rank from the loader's ``__del__``.
    A rank that stops has no use for that news: SIGCHLD gets a handler that does nothing (not the
    default action: a SIGCHLD already pending would then be reported as "ignored due to race
    condition")."""
    if getattr(signal.getsignal(signal.SIGCHLD), "__module__", "").startswith("torch.utils.data"):
        signal.signal(signal.SIGCHLD, _ignore)


def _ignore(signum: int, frame) -> None:
    pass


def report_from_thread(previous: Callable, error: tuple, *, stops: StopTogether | None) -> None:
    """A library's thread reporting its own error through ``sys.excepthook`` (multiprocessing's
    resource sharer does): not the script's end, so printed as Python prints it (``previous``),
    unless this rank is stopping by then. A stop that reaches the whole job closes the rank's
    connections to its DataLoader workers' sharers, which report it a moment before the workers'
    own SIGTERM ends them: the report waits that moment. Python's own printing goes out in one
    write: line by line, a process ended in the middle left a bare "Traceback" line behind."""
    time.sleep(THREAD_REPORT_SECONDS)
    if stops is not None and stops.stopping:
        return
    if previous is not sys.__excepthook__:
        previous(*error)
        return
    sys.stderr.write("".join(traceback.format_exception(*error)))
    sys.stderr.flush()


def where_it_stopped(trace) -> tuple[str, bool]:
    """The script's line a stop's traceback went through last (``train.py:42``: where your code
    was), and whether the code it ends in is psgrad's (a wait for the servers, say).

    1. Of the traceback's frames, Python's own and the installed libraries' (torch's) are neither
       yours nor psgrad's; code Python generated (``<string>``: a dataclass's ``__init__``) is
       nobody's file.
    2. The signal handlers' frames at its end are left out: the handler runs wherever the main
       thread was, and is not psgrad's code at work (a Ctrl-C in your ``time.sleep`` ended in it).
    """
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    libraries = tuple({sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")})
    handlers = {os.path.abspath(__file__), os.path.abspath(signals.__file__)}
    frames = [(os.path.abspath(f.filename), f.lineno) for f in traceback.extract_tb(trace) if f.filename[:1] != "<"]
    while frames and frames[-1][0] in handlers:
        frames.pop()
    code = [(name, line) for name, line in frames if not name.startswith(libraries) or name.startswith(package)]
    inside = bool(code) and code[-1][0].startswith(package)
    yours = [(name, line) for name, line in code if not name.startswith(package)]
    return (f"{os.path.basename(yours[-1][0])}:{yours[-1][1]}" if yours else "psgrad's code"), inside
