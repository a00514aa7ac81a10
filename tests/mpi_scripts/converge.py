"""Under mpiexec: each given configuration trains a small model and its loss goes down."""

import json
import sys

from psgrad.comm.transport import world_rank
from psgrad.config import RunConfig
from psgrad.train import run

failures = []
for item in sys.argv[1:]:
    options = dict(
        model="mlp",
        steps=40,
        batch_size=16,
        synthetic_size=1024,
        lr=0.02,
        momentum=0.9,
        progress=False,
        eval_every_epochs=0,
    )
    options.update(json.loads(item))
    result = run(RunConfig(**options))
    if world_rank() == 0:
        losses = [r["loss"] for r in result.rows]
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        acc = result.evals[-1]["test_acc"] if result.evals else float("nan")
        ok = len(losses) == options["steps"] and last < 0.8 * first
        print(f"{'OK  ' if ok else 'FAIL'} {item}: loss {first:.3f} -> {last:.3f}, test acc {acc:.3f}", flush=True)
        if not ok:
            failures.append(item)
if world_rank() == 0:
    print("CONVERGE FAILURES" if failures else "CONVERGE OK", len(failures), flush=True)
    sys.exit(1 if failures else 0)
