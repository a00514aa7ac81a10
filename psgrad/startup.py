"""What every rank agrees on before training: nobody has a usage error, and all run one config.

An MPMD launch (``psgrad server … : psgrad worker …``) or a typo in one rank's command line can
give ranks different settings; run on anyway, they would send each other messages of the wrong
codec or stop at different steps. And a usage error that every rank hits prints once per rank.
So the first thing every rank does under MPI is ``agree``:
1. One allreduce of a one-hot vector: which ranks have a usage error. If any, the lowest of them
   prints its error (once for the whole job) and every rank raises ``AgreementError``.
2. Rank 0 broadcasts its config; every rank compares it with its own, leaving out the settings
   that may differ per rank (``PER_RANK``).
3. One more one-hot allreduce: which ranks differ. The lowest of them prints one error naming
   each differing option with its value there and on rank 0; every rank raises ``AgreementError``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from .choices import option_flag

if TYPE_CHECKING:  # importing the transport loads numpy and MPI: not for --help
    from .comm.transport import Transport
    from .config import RunConfig

PER_RANK = frozenset({"device", "threads", "progress"})
"""Settings a rank may have of its own (a GPU worker beside a CPU server, the bar on rank 0)."""

INTERRUPTED = 130
"""Exit status after Ctrl-C (SIGINT), as a shell reports a command it interrupted (128 + 2)."""
STOP_SIGNALS = (signal.SIGTERM,)
"""Signals that stop psgrad as Ctrl-C does while ``stop_signals_raise`` is on: SIGTERM (a
scheduler's cancel or time limit, ``kill``, ``timeout``). Not SIGHUP: loading MPICH's UCX library
(libucs) takes SIGHUP over for its debug handler, so a handler set here would be gone."""

_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS")
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


class AgreementError(ValueError):
    """The ranks do not agree; the message was printed once, by one rank."""


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
def _stop_signals_to(handler: Callable[[int, object], None]) -> Iterator[None]:
    """Within, ``handler`` takes each of ``STOP_SIGNALS``; the handlers before are back after.
    Elsewhere than in the main thread (which alone may set handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


def die_by_signal(signum: int) -> None:
    """End this process by ``signum``'s default action (the process manager then ends the job),
    after removing the MPI library's shared-memory segments it maps (comm/segments.py)."""
    from .comm import segments

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
    return _stop_signals_to(_raise_terminated)


def stop_signals_end_the_rank() -> contextlib.AbstractContextManager[None]:
    """Within, each of ``STOP_SIGNALS`` ends this process by the signal's default action, as
    without a handler, but first removes the MPI library's shared-memory segments it maps, which
    only ``MPI_Finalize`` would have removed (comm/segments.py). For a rank of a multi-rank launch
    while it starts or ends, outside ``stop_signals_raise``: a rank leaving there by a normal exit
    hung the job, one killed by the signal is one the process manager ends the job for, but took
    the segment with it into /dev/shm for good. Main thread only, as every handler."""
    return _stop_signals_to(_end_by_signal)


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


def _first(transport: Transport, mine: bool) -> int | None:
    """The lowest rank for which ``mine`` is true (one allreduce), or None."""
    flags = [0.0] * transport.size
    flags[transport.rank] = 1.0 if mine else 0.0
    total = transport.allreduce_sum(flags)
    return next((rank for rank, flag in enumerate(total) if flag), None)


def config_difference(mine: dict, theirs: dict) -> list[str]:
    """One ``--option: value here, value on rank 0`` entry per differing run setting."""
    return [
        f"{option_flag(key)} {mine.get(key)!r} here, {theirs.get(key)!r} on rank 0"
        for key in sorted(set(mine) | set(theirs))
        if key not in PER_RANK and mine.get(key) != theirs.get(key)
    ]


def agree(
    transport: Transport, cfg: RunConfig | None, usage_error: str | None = None, kind: str = "usage error"
) -> None:
    """Return when every rank is free of usage errors and runs rank 0's config (see module doc).

    A rank with a usage error passes its message (and ``cfg=None`` if it has none); it raises.
    ``kind`` names the error where it is printed (a "data error": an unreadable dataset)."""
    if transport.size == 1:
        if usage_error is not None:
            print(f"[psgrad] {kind}: {usage_error}", file=sys.stderr, flush=True)
            raise AgreementError(usage_error)
        return
    first = _first(transport, usage_error is not None)
    if first is not None:
        if first == transport.rank:
            print(f"[psgrad rank {first}] {kind}: {usage_error}", file=sys.stderr, flush=True)
        raise AgreementError(f"rank {first} has a {kind}")
    mine = json.loads(cfg.to_json())
    theirs = json.loads(transport.broadcast_bytes(cfg.to_json().encode() if transport.rank == 0 else None))
    differences = config_difference(mine, theirs)
    first = _first(transport, bool(differences))
    if first is not None:
        if first == transport.rank:
            print(
                f"[psgrad rank {first}] the ranks run different configurations; give every rank the same options: "
                + "; ".join(differences),
                file=sys.stderr,
                flush=True,
            )
        raise AgreementError(f"rank {first} runs another configuration than rank 0")
