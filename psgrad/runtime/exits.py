"""The exit statuses of psgrad's commands and of ``launch/mpirun.sh --max-restarts``, in one place
(docs/launch.md, "Failures", lists them).

A training rank ends a failed job with ``FAILED``, ``NONFINITE`` or ``CHECKPOINT``
(``runtime.failure.exit_status``); click ends a usage error with ``USAGE``. The last three would
fail the same way if started again, so a restart is only for ``FAILED`` and for a rank killed
outright (mpiexec's own status). The supervisor of restarts adds ``GAVE_UP`` and
``NO_CHECKPOINT`` (runtime/restarts.py).
"""

FAILED = 1
"""An error, a lost or stopped rank: starting again from the last checkpoint may well finish."""
USAGE = 2
"""An option, settings the ranks do not agree on, unreadable data (click's status)."""
NONFINITE = 3
"""A gradient that was not finite (psgrad/comm/protocol.py, NonFiniteError)."""
CHECKPOINT = 4
"""A checkpoint that could not be written or resumed from, or a full disk under the log dir."""
GAVE_UP = 5
"""``--max-restarts K``: the job failed again after K restarts."""
NO_CHECKPOINT = 6
"""``--max-restarts``: the job failed before its first complete checkpoint, and
``--restart-from-scratch`` was not given."""

WOULD_FAIL_AGAIN = {
    USAGE: "a usage error",
    NONFINITE: "a gradient that was not finite",
    CHECKPOINT: "a checkpoint problem or a full disk",
}
