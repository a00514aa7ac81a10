"""Under mpiexec: every rank starts a watchdog; rank 0 stops its own 1.5 s after the others (as
rank 0 evaluating and saving the model last does). Every rank prints how long its ``stop()`` took:
a clean end waits until every rank's watchdog thread has ended, so no rank exits while a peer may
still send it a heartbeat (an MPI send to a process that has gone never returns).

With the argument ``stuck``, rank 0 never ends: after the others stopped their watchdogs it waits
for a broadcast no rank sends (as a server waiting for a layer plan from workers that have gone).
Its watchdog must end the job."""

import sys
import time

from psgrad.comm import transport
from psgrad.runtime.watchdog import Report, Watchdog

world = transport.Transport()
watchdog = Watchdog(world, report=Report, names=lambda rank: f"rank {rank}", timeout=2.0).start()
world.barrier()
if world.rank == 0 and sys.argv[1:] == ["stuck"]:
    time.sleep(0.5)  # the others' goodbyes arrive first
    world.broadcast_bytes(None, root=1)  # rank 1 is in stop(): it never sends
if world.rank == 0:
    time.sleep(1.5)  # the thread beats every 0.4 s meanwhile, to peers that have said goodbye
start = time.monotonic()
watchdog.stop()
print(f"rank {world.rank} stop {time.monotonic() - start:.3f}", flush=True)
transport.finalize_and_exit(0)
