"""How a rank of a multi-rank launch ends its job when it stops or fails outside ``train.run``
(which ends the job itself): while it starts, parses its options or ends. Leaving by a normal exit
there would leave the other ranks waiting for it, so the rank aborts the job if MPI runs, else
dies by a signal, which the process manager ends the job for (``run_command`` wraps a command).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TypeVar

import click

from .chain import stop_behind

T = TypeVar("T")


def run_command(
    invoke: Callable[[], T], *, ctx: click.Context, ranks: int, agrees_on_usage: Callable[[], bool]
) -> T | None:
    """Run a command (``invoke``) of a launch of ``ranks`` ranks, ending the job as a rank must.

    1. In a multi-rank launch Ctrl-C is raised from here on (``psgrad.entry`` had it end the rank),
       and the rank's sentinel starts before torch and MPI (``sentinel.start_early``).
    2. SIGTERM stops the command as Ctrl-C does, except in a rank of a multi-rank launch before MPI
       runs, which ends by the signal itself (a training rank raises it around ``train.run``).
    3. A stop says where it was and ends the job (``leave_the_job``); a usage error of a command
       whose ranks agree on usage (``agrees_on_usage()``, asked once the command is known) is printed
       once for the job, and every rank
       exits with status 2; any other error in a multi-rank launch ends the job too (``fail_the_job``);
       in a single rank, an expected stop of ``train.run`` (which said its line) exits with its
       status (``failure.exit_status``).
    """
    from ..agreement import AgreementError
    from .signals import stop_reason, stop_signals_end_the_rank, stop_signals_raise

    try:
        if ranks > 1:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, signal.default_int_handler)
            from .sentinel import start_early

            start_early()  # before torch and MPI: a rank that dies while MPI starts is seen to
        with stop_signals_raise() if ranks < 2 else stop_signals_end_the_rank():
            return invoke()
    except KeyboardInterrupt as err:  # the command said where it stopped; click would add "Aborted!", status 1
        if ranks > 1:
            leave_the_job(err)
        ctx.exit(stop_reason(err)[1])
    except click.UsageError as err:
        if ranks < 2 or not agrees_on_usage():
            raise
        from ..agreement import agree
        from ..comm.transport import Transport

        try:
            agree(Transport(), None, err.format_message())
        except AgreementError:
            ctx.exit(2)
    except AgreementError as err:  # said once by one rank; a usage error's status, or its own kind's
        ctx.exit(err.status)
    except (click.exceptions.Exit, click.Abort):
        raise
    except Exception as err:
        if ranks < 2:
            from .failure import EXPECTED_STOPS, exit_status

            if isinstance(err, EXPECTED_STOPS):  # train.run said its one line; the status says which stop
                ctx.exit(exit_status(err))
            raise
        # a Ctrl-C that a library reported as its own error (one inside torch's import is a
        # RuntimeError) is the stop it is; any other error must end the job too
        stop = stop_behind(err)
        if stop is not None:
            leave_the_job(stop)
        fail_the_job(err)
    return None  # a usage error the ranks did not take up: the command did nothing


def leave_the_job(err: KeyboardInterrupt) -> None:
    """A rank of a multi-rank launch stopped by a signal outside ``train.run`` (which aborts the job
    itself), while it starts or ends: end the job without leaving the other ranks waiting for it.

    1. Say so, once.
    2. MPI runs: abort the job.
    3. Otherwise die by the signal itself. A normal exit would not do: a signal during mpi4py's
       import can leave MPI started with its module unlisted, and the interpreter's teardown then
       finalizes MPI, telling the process manager this rank is done while the others wait for it
       in start-up's agreement; and a rank that exits with a status before MPI starts leaves the
       others waiting in MPI's start-up. Both hung the job. A rank killed by a signal is one the
       process manager ends the job for."""
    from .signals import Terminated, rank_said, stop_reason

    reason, status = stop_reason(err)
    print(rank_said(f"{reason} while starting or ending"), file=sys.stderr, flush=True)
    end_the_job(status, err.signum if isinstance(err, Terminated) else signal.SIGINT)


def end_the_job(status: int, signum: int) -> None:
    """End this rank's job: abort it with ``status`` if MPI runs, else die by ``signum`` (the
    process manager then ends the job; see ``leave_the_job``)."""
    from .signals import die_by_signal

    sys.stderr.flush()
    sys.stdout.flush()
    if "mpi4py.MPI" in sys.modules:
        from ..comm.transport import abort_if_running, on_job_end
        from . import job_end_hooks

        on_job_end(**job_end_hooks())
        abort_if_running(status)
    die_by_signal(signum)
    os._exit(status)  # not reached: the signal's default action ends the process


def fail_the_job(err: Exception) -> None:
    """A rank of a multi-rank launch failed outside ``train.run`` (which aborts the job itself):
    print the error as Python would, then end the job, as ``leave_the_job`` does for a signal.
    A rank that exited with status 1 before MPI started left the others spinning in MPI's
    start-up for ever, at a full core each: MPI's C code never returns to let a Ctrl-C or SIGTERM
    handler of Python's run. So: MPI runs, abort the job with status 1; otherwise die by SIGTERM,
    which the process manager ends the job for."""
    from .signals import rank_said

    if isinstance(err, click.ClickException):  # click's own error: its one line, as click prints it
        err.show()
    else:
        traceback.print_exception(err)
    print(rank_said(f"failed while starting or ending: {type(err).__name__}: {err}"), file=sys.stderr)
    end_the_job(1, signal.SIGTERM)
