"""Under mpiexec: train with the given codec/options; the first worker saves its final parameters,
server 0 the model it evaluated and its eval rows."""

import sys

import torch

from psgrad.config import RunConfig
from psgrad.train import run

out, codec, servers, extra = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
options = dict(
    model="convnet", steps=6, batch_size=8, synthetic_size=256, lr=0.05, progress=False, codec=codec, servers=servers
)
for item in extra:
    key, value = item.split("=")
    options[key] = type(getattr(RunConfig(), key))(value) if getattr(RunConfig(), key) is not None else int(value)
result = run(RunConfig(**options))
if result.rank == 0 and result.role == "server":
    torch.save({"params": result.params, "evals": result.evals}, out + ".server")
if result.role == "worker" and result.rank == servers:
    torch.save(result.params, out)
    print("SAVED", flush=True)
