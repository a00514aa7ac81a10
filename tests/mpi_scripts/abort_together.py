"""Under mpiexec: every rank ignores the stop signals (as a rank on its way down after Ctrl-C
does), then all abort the job at once with status 7. MPICH's abort returns in the ranks that
outlive another's: nothing after ``abort_if_running`` may run, so no rank prints its line."""

import signal
import sys

from mpi4py import MPI

from psgrad.comm import transport
from psgrad.runtime import job_end_hooks

world = transport.Transport()
transport.on_job_end(**job_end_hooks())  # the abort removes MPI's files in /dev/shm, as psgrad's do
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
MPI.COMM_WORLD.Barrier()  # MPI's own, blocking: the ranks leave it within microseconds of each other
transport.abort_if_running(7)
print(f"rank {world.rank} ran on after its abort", file=sys.stderr, flush=True)
