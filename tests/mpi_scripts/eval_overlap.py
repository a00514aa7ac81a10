"""Under mpiexec: does training go on while rank 0 evaluates?

The evaluation after step 4 reads its batches from an iterable that first waits (up to a limit)
until metrics.csv shows step 6 (counted from 0): only possible if the workers kept training meanwhile. Prints
OVERLAP yes|no on rank 0. Argument: background or foreground."""

import csv
import sys
import time
from pathlib import Path

import torch

from psgrad.config import RunConfig
from psgrad.train import run

mode, log_dir = sys.argv[1], Path(sys.argv[2])
seen = []


class WaitingTestSet:
    def __iter__(self):
        if not seen:  # the first evaluation (after 4 steps) waits for steps 4..6 to be trained
            deadline = time.monotonic() + (60 if mode == "background" else 3)
            while time.monotonic() < deadline:
                with open(log_dir / "metrics.csv") as f:
                    if any(int(r["step"]) >= 6 for r in csv.DictReader(f)):
                        seen.append(True)
                        break
                time.sleep(0.05)
            else:
                seen.append(False)
        yield torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))


result = run(
    RunConfig(
        model="mlp",
        steps=16,
        batch_size=8,
        synthetic_size=256,
        progress=False,
        eval_every_epochs=0,
        eval_every_steps=4,
        eval_background=mode == "background",
        log_dir=str(log_dir),
    ),
    eval_data=WaitingTestSet(),
)
if result.rank == 0:
    print(f"OVERLAP {'yes' if seen[0] else 'no'} evals={len(result.evals)}", flush=True)
