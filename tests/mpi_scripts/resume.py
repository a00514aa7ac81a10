"""Under mpiexec: 8 uninterrupted steps == resuming for steps 4..7 from the checkpoint at step 4.

Extra arguments key=value (strings) go into the config, e.g. topology=colocated."""

import sys

import torch

from psgrad.config import RunConfig
from psgrad.train import run

base, extra = sys.argv[1], dict(item.split("=") for item in sys.argv[2:])
kw = dict(
    model="resnet20",
    batch_size=8,
    synthetic_size=256,
    lr=0.05,
    progress=False,
    codec="topk:ratio=0.2",
    feedback="ef",
    eval_every=0,
    steps=8,
    **extra,
)
full = run(RunConfig(**kw, log_dir=f"{base}/full", checkpoint_every=4))
resumed = run(RunConfig(**kw, log_dir=f"{base}/resumed", resume=f"{base}/full/ckpt-step4"))
if full.role != "server":
    for name, p in full.params.items():
        torch.testing.assert_close(resumed.params[name], p, rtol=0, atol=0, msg=name)
    print(f"RESUME OK rank {full.rank}", flush=True)
