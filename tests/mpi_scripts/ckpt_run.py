"""Under mpiexec: 40 steps of ResNet-20 (BatchNorm, top-k with error feedback: state in every
rank) with a checkpoint every 2 steps into LOG_DIR; with "resume", continue from LOG_DIR's newest
complete checkpoint. The first worker saves its final parameters to OUT."""

import sys

import torch

from psgrad.config import RunConfig
from psgrad.train import run

log_dir, out = sys.argv[1], sys.argv[2]
resume = log_dir if len(sys.argv) > 3 and sys.argv[3] == "resume" else None
cfg = RunConfig(
    model="resnet20",
    steps=40,
    batch_size=8,
    synthetic_size=256,
    lr=0.05,
    codec="topk:ratio=0.2",
    feedback="ef",
    eval_every_epochs=0,
    progress=False,
    checkpoint_every_steps=2,
    log_dir=log_dir,
    resume=resume,
)
result = run(cfg)
if result.rank == 1:
    torch.save(result.params, out)
    print("SAVED", flush=True)
