"""Under mpiexec: psgrad with codec `none` == plain averaged SGD in one process (rank 0 checks)."""

import sys

import torch

from psgrad.config import RunConfig
from psgrad.data import ShardLoader, load_dataset
from psgrad.models import build_model
from psgrad.train import run
from psgrad.transport import world_rank, world_size

steps = 6
kw = dict(
    model="mlp",
    steps=steps,
    batch_size=8,
    synthetic_size=256,
    lr=0.05,
    momentum=0.9,
    weight_decay=5e-4,
    progress=False,
    seed=3,
)
nesterov = "--nesterov" in sys.argv
granularity = "model" if "--model-granularity" in sys.argv else "layer"
# a down-codec that keeps everything: the workers follow the server through deltas, not values
down = "topk:ratio=1.0" if "--delta-down" in sys.argv else "none"
cfg = RunConfig(**kw, nesterov=nesterov, granularity=granularity, down_codec=down)
result = run(cfg)
if world_rank() == 0:
    workers = world_size() - 1
    torch.manual_seed(cfg.seed)
    model = build_model("mlp", 10)
    opt = torch.optim.SGD(
        model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, nesterov=nesterov
    )
    data = load_dataset("synthetic", "train", synthetic_size=256, seed=cfg.seed)
    loaders = [ShardLoader(data, "synthetic", w, workers, cfg.batch_size, cfg.seed) for w in range(workers)]
    for step in range(steps):
        opt.zero_grad()
        for loader in loaders:
            x, y = loader.batch(step)
            (torch.nn.functional.cross_entropy(model(x), y) / workers).backward()
        opt.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(result.params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    print("REFERENCE OK", flush=True)
