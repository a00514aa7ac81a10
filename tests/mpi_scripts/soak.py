"""Under mpiexec: a long run of a small model; every rank reports its resident memory once settled
and at the end of the run, as SOAK rank=R settled=KB late=KB peak=KB.

1. A thread samples the rank's resident memory every 0.2 s.
2. ``settled``: the smallest sample between 25 % and 45 % of the run (by then the first
   evaluations have loaded the test set and the metrics rows kept in memory have reached their
   cap); ``late``: the smallest sample of the last 20 %. A leak raises ``late`` above ``settled``.
3. The smallest, not the largest: an evaluation's batch (about 3 MB of floats for this run's
   test set) lives a few milliseconds, and a sample may land on it; with glibc's default malloc it
   may also stay in the heap for a while after. ``peak`` (the largest sample after 25 %) is
   reported as well. tests/test_training.py runs this with malloc set to hand freed memory back
   at once (its ``EXACT``) and with psgrad's setting.

Arguments: steps (default 10000), then key=value config overrides (e.g. topology=colocated)."""

import ast
import sys
import threading
import time

from psgrad import memory, metrics
from psgrad.config import RunConfig
from psgrad.train import run

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
extra = {}
for item in sys.argv[2:]:
    key, value = item.split("=")
    try:
        extra[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        extra[key] = value
# rank 0 keeps the last ROWS_KEPT metrics rows by design: let them reach that cap within the
# warm-up, or a short soak reads the filling of a bounded buffer as growth
metrics.ROWS_KEPT = min(metrics.ROWS_KEPT, steps // 10)


samples: list[tuple[float, int]] = []
done = threading.Event()


def sample() -> None:
    while not done.wait(0.2):
        samples.append((time.monotonic(), memory.resident() >> 10))


threading.Thread(target=sample, daemon=True).start()
start = time.monotonic()
settings = dict(
    model="mlp",
    steps=steps,
    batch_size=8,
    synthetic_size=512,
    progress=False,
    codec="topk:ratio=0.1",
    feedback="ef",
    lr=0.01,
    eval_every_epochs=0,
    eval_every_steps=max(1, steps // 20),
)
result = run(RunConfig(**{**settings, **extra}))
done.set()
span = time.monotonic() - start


def window(low: float, high: float) -> list[int]:
    return [kb for t, kb in samples if low * span < t - start <= high * span]


settled, late = min(window(0.25, 0.45)), min(window(0.8, 1.0))
peak = max(window(0.25, 1.0))
print(f"SOAK rank={result.rank} settled={settled} late={late} peak={peak} seconds={span:.0f}", flush=True)
