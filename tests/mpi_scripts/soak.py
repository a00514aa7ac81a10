"""Under mpiexec: a long run of a small model; every rank reports its peak resident memory during
the warm-up (the first quarter of the steps: the first evaluations have loaded the test set, the
metrics rows kept in memory have reached their cap) and its peak after that, as
SOAK rank=R warm=KB peak=KB.

Arguments: steps (default 10000), then key=value config overrides (e.g. topology=colocated)."""

import ast
import sys
import threading
import time

from psgrad import metrics
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
PAGE_KB = 4
# rank 0 keeps the last ROWS_KEPT metrics rows by design: let them reach that cap within the
# warm-up, or a short soak reads the filling of a bounded buffer as growth
metrics.ROWS_KEPT = min(metrics.ROWS_KEPT, steps // 10)


def rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_KB


samples: list[tuple[float, int]] = []
done = threading.Event()


def sample() -> None:
    while not done.wait(0.2):
        samples.append((time.monotonic(), rss_kb()))


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
    eval_every=0,
    eval_steps=max(1, steps // 20),
)
result = run(RunConfig(**{**settings, **extra}))
done.set()
span = time.monotonic() - start
warm = [kb for t, kb in samples if t - start <= 0.25 * span]
after = [kb for t, kb in samples if t - start > 0.25 * span]
print(f"SOAK rank={result.rank} warm={max(warm)} peak={max(after)} seconds={span:.0f}", flush=True)
