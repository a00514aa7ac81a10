"""How a rank stops: Ctrl-C and SIGTERM as ``KeyboardInterrupt``, the exit status a shell
reports for each, ending the rank by the signal, and what the MPI launcher's environment says of
the job before MPI starts (its size, this rank)."""

from __future__ import annotations

import _thread
import contextlib
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

INTERRUPTED = 130
"""Exit status after Ctrl-C (SIGINT), as a shell reports a command it interrupted (128 + 2)."""
STOP_SIGNALS = (signal.SIGTERM,)
"""Signals that stop psgrad as Ctrl-C does while ``stop_signals_raise`` is on: SIGTERM (a
scheduler's cancel or time limit, ``kill``, ``timeout``). Not SIGHUP: loading MPICH's UCX library
(libucs) takes SIGHUP over for its debug handler, so a handler set here would be gone."""

_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS")
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


class Terminated(KeyboardInterrupt):
    """One of ``STOP_SIGNALS`` arrived while ``stop_signals_raise`` is on. A KeyboardInterrupt, so
    that psgrad stops on it as on Ctrl-C, where every wait and every thread hand-off already
    expects one."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def stop_reason(err: KeyboardInterrupt) -> tuple[str, int]:
    """How a stop by signal is said, and the exit status a shell reports for it (128 + the signal)."""
    if isinstance(err, Terminated):
        return f"terminated ({signal.Signals(err.signum).name})", 128 + err.signum
    return "interrupted", INTERRUPTED


@contextlib.contextmanager
def stop_signals_to(handler: Callable[[int, object], None]) -> Iterator[None]:
    """Within, ``handler`` takes each of ``STOP_SIGNALS``, and a stop Python would drop is raised
    again (``_stops_kept``); the handlers before are back after. Elsewhere than in the main thread
    (which alone may set handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    unraisable, sys.unraisablehook = sys.unraisablehook, _stops_kept(sys.unraisablehook)
    try:
        yield
    finally:
        sys.unraisablehook = unraisable
        for sig, old in previous.items():
            signal.signal(sig, old)


_AGAIN_SECONDS = 0.01
"""How long after a stop was dropped its signal comes again: the main thread is out of the hook
by then (if it is in another that drops it, it comes again after that one)."""


def _stops_kept(previous: Callable) -> Callable:
    """A ``sys.unraisablehook`` that keeps stops: a Ctrl-C or SIGTERM raised where Python drops
    exceptions (an at-fork hook, as when a DataLoader forks its workers; a ``__del__``) would be
    lost, and the rank would train on. Its signal is raised again instead, for the handler to run
    at the main thread's next line, and nothing is printed. Any other drop goes to ``previous``."""
    if getattr(previous, "keeps_stops", False):
        return previous

    def hook(unraisable) -> None:
        stop = unraisable.exc_value
        if isinstance(stop, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
            # from another thread, a moment later: raised from here (signal.raise_signal, os.kill,
            # even _thread.interrupt_main) the handler runs before this hook returns, and its
            # exception is dropped again
            signum = getattr(stop, "signum", signal.SIGINT)  # Terminated's, or Ctrl-C's
            again = threading.Timer(_AGAIN_SECONDS, _thread.interrupt_main, args=(signum,))
            again.daemon = True  # the process may end meanwhile: the stop then happened anyway
            try:
                again.start()
                return
            except RuntimeError:  # no new thread while the interpreter shuts down
                pass
        previous(unraisable)

    hook.keeps_stops = True  # type: ignore[attr-defined]
    return hook


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


def is_psgrads_handler(handler: object) -> bool:
    """Whether ``handler`` (from ``signal.getsignal``) is one psgrad set: another library's or the
    user's own is left as it is."""
    return getattr(handler, "__module__", "").startswith("psgrad.")


def _forked_child_ends_by_stop_signals() -> None:
    """In a process forked from a rank (a DataLoader's worker): psgrad's handler of each of
    ``STOP_SIGNALS`` stays, but where it would raise, the process ends by the signal instead,
    quietly. A scheduler's SIGTERM reaches the whole process group; raised as ``Terminated`` in a
    worker just forked, before its loop could catch it, it printed a traceback beside the rank's
    one line. A stop the handler notes to be saved still only notes it."""
    for sig in STOP_SIGNALS:
        inherited = signal.getsignal(sig)
        if is_psgrads_handler(inherited):
            signal.signal(sig, functools.partial(_raising_ends_quietly, inherited))


def _raising_ends_quietly(inherited: Callable[[int, object], None], signum: int, frame: object) -> None:
    try:
        inherited(signum, frame)
    except KeyboardInterrupt:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


os.register_at_fork(after_in_child=_forked_child_ends_by_stop_signals)


def die_by_signal(signum: int) -> None:
    """End this process by ``signum``'s default action (the process manager then ends the job),
    after removing the MPI library's shared-memory segments it maps (runtime/segments.py)."""
    from . import segments

    segments.remove(segments.job_segments())
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _end_by_signal(signum: int, frame: object) -> None:
    die_by_signal(signum)


def stop_signals_raise() -> contextlib.AbstractContextManager[None]:
    """Within, each of ``STOP_SIGNALS`` raises ``Terminated`` in the main thread instead of ending
    the process at once: a rank then says what it was doing and which checkpoint resumes the run,
    where it would otherwise die without a word (and its sentinel blame it as killed or crashed),
    and ``psgrad bench`` ends its running job instead of leaving it behind. Elsewhere than in the
    main thread (which alone may set handlers) it does nothing."""
    return stop_signals_to(_raise_terminated)


def stop_signals_raise_from_now() -> None:
    """From now on, each of ``STOP_SIGNALS`` still at its default action raises ``Terminated`` in
    the main thread, as within ``stop_signals_raise`` (``psgrad.init``: for a script's whole run,
    so that a terminated rank says where it stopped instead of dying without a word, and the
    script's ``finally`` blocks run); a handler the script set itself stays. A stop Python would
    drop is raised again (``_stops_kept``). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _raise_terminated)
    sys.unraisablehook = _stops_kept(sys.unraisablehook)


def stop_signals_end_the_rank() -> contextlib.AbstractContextManager[None]:
    """Within, each of ``STOP_SIGNALS`` ends this process by the signal's default action, as
    without a handler, but first removes the MPI library's shared-memory segments it maps, which
    only ``MPI_Finalize`` would have removed (runtime/segments.py). For a rank of a multi-rank launch
    while it starts or ends, outside ``stop_signals_raise``: a rank leaving there by a normal exit
    hung the job, one killed by the signal is one the process manager ends the job for, but took
    the segment with it into /dev/shm for good. Main thread only, as every handler."""
    return stop_signals_to(_end_by_signal)


def ignore_further_stops() -> None:
    """On the way down after a stop by signal: a second Ctrl-C or SIGTERM must not cut the rest
    short (the rank's abort of the job). Main thread only, as every handler."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, *STOP_SIGNALS):
            signal.signal(sig, signal.SIG_IGN)


def launched_ranks() -> int:
    """How many ranks the MPI launcher started, from its environment (no MPI initialisation)."""
    size = _from_launcher(_SIZE_VARIABLES)
    return 1 if size is None else size


def launched_rank() -> int | None:
    """This process's rank as the MPI launcher set it in the environment (no MPI initialisation),
    or None when no launcher did."""
    return _from_launcher(_RANK_VARIABLES)


def _from_launcher(names: tuple[str, ...]) -> int | None:
    """The first of the environment variables ``names`` that holds a number, as a number."""
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def rank_said(what: str) -> str:
    """``what`` (a line's text after the tag) tagged as psgrad's in-run lines are, ``[psgrad rank N]
    what``, when the launcher says which rank this process is; else ``[psgrad] this rank what``.
    For the lines a rank prints before MPI can tell it: under mpiexec every rank's lines share one
    stream."""
    rank = launched_rank()
    return f"[psgrad] this rank {what}" if rank is None else f"[psgrad rank {rank}] {what}"
