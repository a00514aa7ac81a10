"""Under mpiexec: every rank leaves through ``finalize_and_exit``; the last rank is slow on its way
out (a second after ``MPI_Finalize``, as a rank descheduled on a busy machine can be) and then
writes the file named by the first argument. The job must end with status 0 and that file written:
no rank that left first may take the slow one down with it."""

import sys
import time
from pathlib import Path

from psgrad.comm import transport
from psgrad.runtime import job_end_hooks

marker = Path(sys.argv[1])
world = transport.Transport()
hooks = job_end_hooks()
if world.rank == world.size - 1:
    goodbye = hooks["after_finalize"]

    def slow_farewell() -> None:
        time.sleep(1.5)
        marker.write_text("left\n")
        goodbye()

    hooks["after_finalize"] = slow_farewell
transport.on_job_end(**hooks)
transport.finalize_and_exit(0)
