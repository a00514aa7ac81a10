"""The MPI library's named shared-memory segments of this job, removed when the job does not end cleanly.

MPICH keeps one file per node and job in /dev/shm (``mpich_shm_<id>_0``, 3 MB for 3 ranks) for as
long as the job runs, and removes it in ``MPI_Finalize``. A job that ends through ``MPI_Abort``
(Ctrl-C, SIGTERM, an error, the watchdog) or whose rank is killed never gets there: the file
stays, in memory (/dev/shm is RAM), until the machine reboots. One day of interrupted test jobs
left 1,081 of them here, 3.1 GB.

1. ``job_segments()`` reads /proc/self/maps: the files under /dev/shm this process maps whose
   names are an MPI library's (``PREFIXES``) and that are still there (not ``(deleted)``). Only
   this job's ranks map this job's segment, so no other job's is ever touched.
2. ``remove(paths)`` unlinks them. The ranks keep their mappings, so a rank still running reads
   and writes them as before; a rank that has not yet attached cannot any more, which is why
   this runs only when the job is ending anyway: right before ``MPI_Abort``, and in the rank's
   sentinel (runtime/sentinel.py) when the rank dies without saying goodbye.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

SHM_DIR = "/dev/shm"
PREFIXES = ("mpich_shm_",)  # MPICH 4 and 5 (ch4); Open MPI's launcher removes its own


def job_segments(maps: str = "/proc/self/maps") -> list[str]:
    """Paths of the MPI library's segments this process maps and that still exist (see above)."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:  # not Linux: nothing known to remove
        return []
    found: list[str] = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5]
        if path.endswith(" (deleted)"):
            continue
        if os.path.dirname(path) == SHM_DIR and os.path.basename(path).startswith(PREFIXES) and path not in found:
            found.append(path)
    return found


def remove(paths: Iterable[str]) -> None:
    """Unlink ``paths``; one already gone (another rank was first) is no error."""
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass
