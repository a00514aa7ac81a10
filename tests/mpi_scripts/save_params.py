"""Under mpiexec: train with the given codec/options; the first worker saves its final parameters,
rank 0 (server 0, or the colocated rank 0) the model it evaluated and its eval rows.

Arguments: ``OUT CODEC SERVERS [KEY=VALUE ...]``, or several such runs separated by ``--``, trained
one after another in the same job (one start-up of the ranks for all of them)."""

import sys

import torch
from scenarios import split_runs

from psgrad.config import RunConfig
from psgrad.train import run


def train_and_save(out: str, codec: str, servers: str, *extra: str) -> None:
    options = dict(
        model="convnet",
        steps=6,
        batch_size=8,
        synthetic_size=256,
        lr=0.05,
        progress=False,
        codec=codec,
        servers=int(servers),
    )
    for item in extra:
        key, value = item.split("=", 1)
        options[key] = type(getattr(RunConfig(), key))(value) if getattr(RunConfig(), key) is not None else int(value)
    cfg = RunConfig(**options)
    result = run(cfg)
    if result.rank == 0:
        torch.save({"params": result.params, "evals": result.evals, "rows": result.rows}, out + ".server")
    if result.role != "server" and result.rank == (cfg.servers if cfg.topology == "ps" else 0):
        torch.save(result.params, out)
        print(f"SAVED {out}", flush=True)


for args in split_runs(sys.argv[1:]):
    train_and_save(*args)
