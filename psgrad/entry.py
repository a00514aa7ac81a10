"""The ``psgrad`` command's first code (the console script and ``python -m psgrad``): it runs
before click and the rest of the command line are imported.

Under a multi-rank launch a Ctrl-C (SIGINT) ends the rank by the signal itself until the command
starts, where ``runtime.job.run_command`` gives it back to Python. Why: Python's own handler raises
KeyboardInterrupt wherever the signal lands; in an import or in click's parsing of the options
the rank then exited with status 1 (a traceback, or click's "Aborted!") before MPI started, and
the other ranks waited for it in MPI's start-up for ever (1 of 40 runs of the start-up signal
test, tests/test_training.py). A rank killed by a signal is one the process manager ends the job
for. (SIGTERM's default action is that already; nothing here changes it.)
"""

from __future__ import annotations

import signal

from .runtime.signals import launched_ranks


def main() -> None:
    """Set Ctrl-C to end a rank of a multi-rank launch by the signal, then run the command line."""
    if launched_ranks() > 1:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    from .cli import main as command_line

    command_line()
