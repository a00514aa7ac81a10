"""The process around a rank: how it stops (``signals``), what it leaves behind and who cleans it
up (``segments``, ``sentinel``), who notices a rank that went silent (``watchdog``), the errors
behind an error (``chain``) and the C allocator's tuning (``allocator``, chosen by the command
line, not by the library). Nothing here trains; only ``watchdog`` talks to other ranks, through
the transport it is given.
"""

from __future__ import annotations

from collections.abc import Callable

from . import segments, sentinel


def remove_job_segments() -> None:
    """Remove the MPI library's shared-memory files this process maps (``MPI_Abort`` leaves them)."""
    segments.remove(segments.job_segments())


def job_end_hooks() -> dict[str, Callable[[], None]]:
    """The transport's hooks for the end of a job (``comm.transport.on_job_end``): before an abort,
    remove the MPI library's files; after ``MPI_Finalize``, let the sentinels hear their goodbye."""
    return {"before_abort": remove_job_segments, "after_finalize": sentinel.farewell}
