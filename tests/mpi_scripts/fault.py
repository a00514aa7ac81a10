"""Under mpiexec: one worker fails at step 3, by exception, SIGKILL, SIGSTOP, or by waiting
forever for a message nobody sends (hang: every rank ends up waiting); or (exit) it is SIGKILLed
after training, on its way out, in a process that ends with its job as ``psgrad train``'s does;
or (slow) its loader takes 9 s over that batch, and the job goes on; or (raise_all) every worker
raises at step 3; or (slow_eval) rank 0's evaluation after step 2, in the training loop, takes 9 s.

Arguments: how (raise, raise_all, kill, stop, hang, exit, slow, slow_eval), topology (ps, colocated), the failing worker's index (default
1: rank 2 with ps on 3 ranks, rank 1 with colocated), mode (sync, async). The watchdog's timeout
is 5 s, so a stopped rank must be named within seconds. Each rank first prints the MPI library's
shared-memory files it maps (``segment PATH``): a job that ends so must not leave them behind."""

import dataclasses
import os
import signal
import sys
import time

from psgrad.comm.transport import Transport, finalize, mpi_library, start_mpi
from psgrad.config import RunConfig
from psgrad.data import ShardLoader, eval_batches, load_dataset
from psgrad.roles import topology_of
from psgrad.runtime import segments
from psgrad.runtime.sentinel import hold_goodbyes
from psgrad.train import run

how = sys.argv[1]
topology = sys.argv[2] if len(sys.argv) > 2 else "ps"
failing = int(sys.argv[3]) if len(sys.argv) > 3 else 1
mode = sys.argv[4] if len(sys.argv) > 4 else "sync"
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


class FaultyLoader:
    def __init__(self, worker, workers):
        self.inner = ShardLoader(
            load_dataset("synthetic", "train", synthetic_size=256),
            dataset="synthetic",
            worker=worker,
            workers=workers,
            batch_size=8,
            seed=0,
        )
        self.steps_per_epoch = self.inner.steps_per_epoch
        self.worker = worker

    def batch(self, step):
        if step == 3 and how == "raise_all":
            raise ValueError("injected failure in the data loader")
        if self.worker == failing and step == 3 and how == "slow":
            time.sleep(9)
        elif self.worker == failing and step == 3 and how not in ("exit", "slow_eval"):
            if how in SIGNALS:
                os.kill(os.getpid(), SIGNALS[how])
            if how == "hang":
                Transport().irecv(8, source=0, tag=12345).wait()
            raise ValueError("injected failure in the data loader")
        return self.inner.batch(step)


start_mpi()  # MPI starts with the first transport: here, before listing the files it maps
# one write a line: print's text and its newline are two writes, which another rank's line
# can come between on the shared pipe ("library MPICH ...segment /dev/shm/...")
sys.stdout.write(f"library {mpi_library()}\n" + "".join(f"segment {path}\n" for path in segments.job_segments()))
sys.stdout.flush()
if how == "exit":
    hold_goodbyes()


class SlowTestSet:
    """The synthetic test set's batches, read slowly (9 s) by the evaluation after step 2."""

    def __init__(self):
        self.batches = list(eval_batches(load_dataset("synthetic", "test", synthetic_size=64), "synthetic"))
        self.reads = 0

    def __iter__(self):
        self.reads += 1
        if self.reads == 1:
            time.sleep(9)
        return iter(self.batches)


cfg = RunConfig(model="mlp", steps=50, batch_size=8, progress=False, topology=topology, mode=mode, timeout=5)
if how == "slow_eval":
    cfg = dataclasses.replace(cfg, eval_every_steps=3, eval_every_epochs=0, eval_background=False)
run(cfg, loader_fn=FaultyLoader, eval_data=SlowTestSet() if how == "slow_eval" else None)
if how == "exit":
    world = Transport()
    if world.rank == topology_of(topology).rank_layout(world=world.size, servers=cfg.servers).worker_ranks[failing]:
        os.kill(os.getpid(), signal.SIGKILL)
    finalize()
