"""How a rank's run ends when ``train.run`` fails or is stopped: what it says, and how the job
ends with it (``end_on_failure``)."""

from __future__ import annotations

import errno
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import checkpoint
from ..agreement import AgreementError
from ..comm.protocol import NonFiniteError
from ..comm.waiting import PeerFailure
from ..metrics import say
from ..stopsaving import SavedStop
from .exits import CHECKPOINT, FAILED, NONFINITE
from .signals import ignore_further_stops, stop_reason

SECOND_ABORT_DELAY = 1.0
"""Seconds a rank that claims a job's abort after another waits before its own abort: the first
rank's words (its traceback, the resume hint) go out before this abort can cut them short."""

EXPECTED_STOPS = (checkpoint.CheckpointError, NonFiniteError)
"""Errors whose one line says what happened and what to do (a checkpoint that does not fit, a
gradient that is not finite): a traceback into autograd would only bury it."""


def exit_status(err: BaseException) -> int:
    """The exit status a run that failed with ``err`` ends with (``FAILED``, ``NONFINITE`` or
    ``CHECKPOINT``; runtime/exits.py)."""
    if isinstance(err, NonFiniteError):
        return NONFINITE
    if isinstance(err, checkpoint.CheckpointError) or _disk_full(err):  # a full disk stays full
        return CHECKPOINT
    return FAILED


if TYPE_CHECKING:  # the interfaces only
    from ..comm.channel import Channel
    from .watchdog import Watchdog


def end_on_failure(
    err: BaseException, *, transport: Channel, watchdog: Watchdog, log_dir: str | None, doing: str
) -> None:
    """Say how this rank's run ended with ``err`` and end the job with it (the caller re-raises).

    1. A simulated rank stopped by another's failure, and a disagreement (said once by one rank),
       end quietly.
    2. Ctrl-C or SIGTERM: one line (where it stopped, or the checkpoint a saved stop wrote:
       stopsaving.py), further stops ignored, and the job
       aborted with the shell's status for the signal; the rank that claims the abort first (the
       one stopped, when a rank is stopped alone) names the checkpoint that resumes the run.
    3. Any other error: one line; a full disk adds the resume hint (said as in 2), and an error
       other than an expected stop (``EXPECTED_STOPS``, whose one line says what to do) or a
       peer's failure (``PeerFailure``: the other rank's own line says why) its traceback, on
       the rank that claims the abort first (every rank's, and those too, with
       ``PSGRAD_DEBUG=1``); the job is aborted with ``exit_status(err)``, the abort claimed unless
       a dead peer's sentinel names it. A rank that claims after another waits
       ``SECOND_ABORT_DELAY`` before its abort, which could cut the first one's words short.
    """
    if getattr(err, "reported_elsewhere", False):
        return
    if isinstance(err, AgreementError):
        watchdog.stop(together=False)
        return
    if isinstance(err, KeyboardInterrupt):  # Ctrl-C or SIGTERM: where it stopped, not a traceback
        reason, status = stop_reason(err)
        said = err.said(transport.rank) if isinstance(err, SavedStop) else f"{reason} while {doing}"
        if not (isinstance(err, SavedStop) and transport.shared_stop() is not None):
            say(f"[psgrad rank {transport.rank}] {said}")
        elif transport.rank == 0:  # simulated ranks' saved stop: said once, for the process
            say(f"[psgrad] {said}")
        if transport.size > 1:
            ignore_further_stops()
        _end_job(transport, watchdog, reason, status, first_says=lambda: _say_resume_hint(log_dir))
        return
    say(f"[psgrad rank {transport.rank}] {type(err).__name__} while {doing}: {err}")
    full = _disk_full(err)  # the system's words say it all; what to resume from once there is room
    traced = not full and not isinstance(err, (*EXPECTED_STOPS, PeerFailure))
    debug = bool(os.environ.get("PSGRAD_DEBUG"))
    if debug and not full:
        traceback.print_exception(err, file=sys.stderr)

    def first_says() -> None:  # one traceback a job: the same error on every worker buried itself
        if traced and not debug:
            traceback.print_exception(err, file=sys.stderr)
        if full:
            _say_resume_hint(log_dir)

    # a dead peer's sentinel names it, not this rank
    claim = None if isinstance(err, PeerFailure) else f"{type(err).__name__}: {err}"
    _end_job(transport, watchdog, claim, exit_status(err), first_says=first_says)


def _say_resume_hint(log_dir: str | None) -> None:
    """The checkpoint that continues the run (``checkpoint.resume_hint``)."""
    if (hint := checkpoint.resume_hint(log_dir)) is not None:
        say(f"[psgrad] {hint}")


def _end_job(
    transport: Channel,
    watchdog: Watchdog,
    claim: str | None,
    status: int,
    *,
    first_says: Callable[[], None] | None = None,
) -> None:
    """With other ranks: claim the abort (unless ``claim`` is None), then abort the job with
    ``status`` whatever the claim does (a claim that failed on a full disk once skipped the abort,
    and the other ranks waited for the watchdog). ``first_says`` speaks once for the job: on the
    rank that claimed first (a rank stopped alone, not only rank 0), or rank 0 without claims."""
    if transport.size < 2:
        if first_says is not None:
            first_says()
        return
    try:
        first = watchdog.claim(claim) if claim is not None else None
        if first_says is not None and (first if first is not None else transport.rank == 0):
            first_says()
        elif first is False:  # the first rank's words go out before this rank's abort can cut them short
            time.sleep(SECOND_ABORT_DELAY)
    finally:
        transport.abort(status)


def _disk_full(err: BaseException) -> bool:
    """A full disk or an exceeded quota, here or behind ``err`` (``checkpoint.system_error``): the
    system's words say it all, no traceback needed."""
    system = checkpoint.system_error(err)
    return system is not None and system.errno in (errno.ENOSPC, errno.EDQUOT)
