"""psgrad's command line on a rank of an MPI job, with one fault injected the first time a log
dir sees it: ``python injected.py RANK STEP -- train ... --log-dir DIR``.

Rank RANK SIGKILLs itself as it starts step STEP (after telling its sentinel the step, as every
rank does), unless ``DIR/injected`` exists: the fault writes it first, so the restarted job, the
same command with ``--resume DIR``, runs through. RANK -1 injects nothing."""

import os
import signal
import sys
from pathlib import Path

from psgrad.runtime.watchdog import Watchdog

rank, step = int(sys.argv[1]), int(sys.argv[2])
args = sys.argv[4:] if sys.argv[3:4] == ["--"] else sys.argv[3:]
log_dir = Path(args[args.index("--log-dir") + 1])
marker = log_dir / "injected"
told = Watchdog.at_step


def at_step(self, at: int) -> None:
    told(self, at)
    if self.rank == rank and at == step and not marker.exists():
        marker.write_text(f"rank {rank} killed at step {step}\n")
        os.kill(os.getpid(), signal.SIGKILL)


Watchdog.at_step = at_step
sys.argv = ["psgrad", *args]
from psgrad.entry import main  # noqa: E402  after the fault is in place

main()
