"""Under mpiexec: the worker with index 1 fails at step 3, by exception or by SIGKILL (rank 2
with the ps topology on 3 ranks, rank 1 with colocated)."""

import os
import signal
import sys

from psgrad.config import RunConfig
from psgrad.data import ShardLoader, load_dataset
from psgrad.train import run

how = sys.argv[1]
topology = sys.argv[2] if len(sys.argv) > 2 else "ps"


class FaultyLoader:
    def __init__(self, worker, workers):
        self.inner = ShardLoader(
            load_dataset("synthetic", "train", synthetic_size=256), "synthetic", worker, workers, 8, 0
        )
        self.steps_per_epoch = self.inner.steps_per_epoch
        self.worker = worker

    def batch(self, step):
        if self.worker == 1 and step == 3:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("injected failure in the data loader")
        return self.inner.batch(step)


run(RunConfig(model="mlp", steps=50, batch_size=8, progress=False, topology=topology), loader_fn=FaultyLoader)
