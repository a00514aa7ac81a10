"""Under mpiexec: 8 uninterrupted steps == resuming for steps 4..7 from the checkpoint at step 4.

The final checkpoint (step 8) is made incomplete first (its marker removed, as if the job had
been cut off while writing it), and the resume names only the log dir: it must pick step 4.
The first worker also checks that model.pt holds its final parameters (under gossip, the
average of the ranks' parameters, which rank 0 evaluated).
Arguments: ``BASE [KEY=VALUE ...]`` (strings that go into the config, e.g. topology=colocated), or
several such scenarios separated by ``--``, run one after another in the same job; each prints
``MODEL OK BASE rank R`` and ``RESUME OK BASE rank R``."""

import os
import sys

import numpy as np
import torch
from mpi4py import MPI
from scenarios import split_runs

from psgrad.config import RunConfig
from psgrad.train import run


def _average(tensor: torch.Tensor) -> torch.Tensor:
    """The mean of ``tensor`` over the ranks (MPI's buffer all-reduce: nothing pickled)."""
    mine = np.ascontiguousarray(tensor.detach().numpy())
    total = np.empty_like(mine)
    MPI.COMM_WORLD.Allreduce(mine, total, op=MPI.SUM)
    return torch.from_numpy(total / MPI.COMM_WORLD.size)


def resume_equals_uninterrupted(base: str, *options: str) -> None:
    extra = {key: int(value) if value.isdigit() else value for key, value in (o.split("=", 1) for o in options)}
    kw = dict(
        model="resnet20",
        batch_size=8,
        synthetic_size=256,
        lr=0.05,
        progress=False,
        codec="topk:ratio=0.2",
        feedback="ef",
        eval_every_epochs=0,
        steps=8,
    )
    kw.update(extra)
    full = run(RunConfig(**kw, log_dir=f"{base}/full", checkpoint_every_steps=4))
    MPI.COMM_WORLD.Barrier()
    if full.rank == 0:
        os.remove(f"{base}/full/ckpt-step8/COMPLETE")
    MPI.COMM_WORLD.Barrier()
    resumed = run(RunConfig(**kw, log_dir=f"{base}/resumed", resume=f"{base}/full"))
    first_worker = 1 if kw.get("topology", "ps") == "ps" else 0
    gossip = kw.get("topology") in ("ring", "torus")
    if gossip:  # each rank has its own model: model.pt is their average, which rank 0 evaluated
        average = {name: _average(p) for name, p in full.params.items()}
    if full.rank == first_worker:
        saved = torch.load(f"{base}/full/model.pt", weights_only=True)
        for name, p in full.params.items():
            if gossip:
                torch.testing.assert_close(saved[name], average[name], rtol=1e-6, atol=1e-7, msg=name)
            else:
                torch.testing.assert_close(saved[name], p, rtol=0, atol=0, msg=name)
        print(f"MODEL OK {base} rank {full.rank}", flush=True)
    if full.role != "server":
        for name, p in full.params.items():
            torch.testing.assert_close(resumed.params[name], p, rtol=0, atol=0, msg=name)
        print(f"RESUME OK {base} rank {full.rank}", flush=True)


for args in split_runs(sys.argv[1:]):
    resume_equals_uninterrupted(*args)
