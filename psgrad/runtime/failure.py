"""How a rank's run ends when ``train.run`` fails or is stopped: what it says, and how the job
ends with it (``end_on_failure``)."""

from __future__ import annotations

import errno
import os
import sys
import traceback
from typing import TYPE_CHECKING

from .. import checkpoint
from ..agreement import AgreementError
from ..comm.protocol import NonFiniteError
from ..comm.waiting import PeerFailure
from ..metrics import say
from .exits import CHECKPOINT, FAILED, NONFINITE
from .signals import ignore_further_stops, stop_reason

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
    2. Ctrl-C or SIGTERM: one line (where it stopped), rank 0 the checkpoint that resumes the
       run, further stops ignored, and the job aborted with the shell's status for the signal.
    3. Any other error: one line; a full disk adds the resume hint, and an error other than an
       expected stop (``EXPECTED_STOPS``, whose one line says what to do) or a peer's failure
       (``PeerFailure``: the other rank's own line says why) its traceback, which
       ``PSGRAD_DEBUG=1`` shows for those too; the job is aborted with ``exit_status(err)``, the abort
       claimed unless a dead peer's sentinel names it.
    """
    if getattr(err, "reported_elsewhere", False):
        return
    if isinstance(err, AgreementError):
        watchdog.stop(together=False)
        return
    if isinstance(err, KeyboardInterrupt):  # Ctrl-C or SIGTERM: where it stopped, not a traceback
        reason, status = stop_reason(err)
        say(f"[psgrad rank {transport.rank}] {reason} while {doing}")
        _say_resume_hint(transport.rank, log_dir)
        if transport.size > 1:
            ignore_further_stops()
        _end_job(transport, watchdog, reason, status)
        return
    say(f"[psgrad rank {transport.rank}] {type(err).__name__} while {doing}: {err}")
    if _disk_full(err):  # the system's words say it all; what to resume from once there is room
        _say_resume_hint(transport.rank, log_dir)
    elif not isinstance(err, (*EXPECTED_STOPS, PeerFailure)) or os.environ.get("PSGRAD_DEBUG"):
        traceback.print_exc(file=sys.stderr)
    # a dead peer's sentinel names it, not this rank
    claim = None if isinstance(err, PeerFailure) else f"{type(err).__name__}: {err}"
    _end_job(transport, watchdog, claim, exit_status(err))


def _say_resume_hint(rank: int, log_dir: str | None) -> None:
    """Rank 0 names the checkpoint that continues the run (``checkpoint.resume_hint``)."""
    if rank == 0 and (hint := checkpoint.resume_hint(log_dir)) is not None:
        say(f"[psgrad] {hint}")


def _end_job(transport: Channel, watchdog: Watchdog, claim: str | None, status: int) -> None:
    """With other ranks: claim the abort (unless ``claim`` is None), then abort the job with
    ``status`` whatever the claim does (a claim that failed on a full disk once skipped the abort,
    and the other ranks waited for the watchdog)."""
    if transport.size < 2:
        return
    try:
        if claim is not None:
            watchdog.claim(claim)
    finally:
        transport.abort(status)


def _disk_full(err: BaseException) -> bool:
    """A full disk or an exceeded quota, here or behind ``err`` (``checkpoint.system_error``): the
    system's words say it all, no traceback needed."""
    system = checkpoint.system_error(err)
    return system is not None and system.errno in (errno.ENOSPC, errno.EDQUOT)
