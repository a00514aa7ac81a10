"""Under mpiexec: train with the given codec/options; the first worker saves its final parameters,
rank 0 (server 0, or the colocated rank 0) the model it evaluated and its eval rows."""

import sys

import torch

from psgrad.config import RunConfig
from psgrad.train import run

out, codec, servers, extra = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
options = dict(
    model="convnet", steps=6, batch_size=8, synthetic_size=256, lr=0.05, progress=False, codec=codec, servers=servers
)
for item in extra:
    key, value = item.split("=", 1)
    options[key] = type(getattr(RunConfig(), key))(value) if getattr(RunConfig(), key) is not None else int(value)
cfg = RunConfig(**options)
result = run(cfg)
if result.rank == 0:
    torch.save({"params": result.params, "evals": result.evals, "rows": result.rows}, out + ".server")
if result.role != "server" and result.rank == (servers if cfg.topology == "ps" else 0):
    torch.save(result.params, out)
    print("SAVED", flush=True)
