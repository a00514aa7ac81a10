"""Under mpiexec: every rank starts a watchdog; rank 0 stops its own 1.5 s after the others (as
rank 0 evaluating and saving the model last does). Every rank prints how long its ``stop()`` took:
a clean end waits until every rank's watchdog thread has ended, so no rank exits while a peer may
still send it a heartbeat (an MPI send to a process that has gone never returns)."""

import time

from psgrad.comm import transport
from psgrad.runtime.watchdog import Report, Watchdog

world = transport.Transport()
watchdog = Watchdog(world, report=Report, names=lambda rank: f"rank {rank}", timeout=2.0).start()
world.barrier()
if world.rank == 0:
    time.sleep(1.5)  # the thread beats every 0.4 s meanwhile, to peers that have said goodbye
start = time.monotonic()
watchdog.stop()
print(f"rank {world.rank} stop {time.monotonic() - start:.3f}", flush=True)
transport.finalize_and_exit(0)
