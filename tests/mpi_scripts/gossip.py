"""Under mpiexec -n N: ``--topology ring`` with codec none and consensus step 1 equals exact gossip
averaging, computed here for all N ranks in one process: every rank takes its local SGD step on
its own batch, then x_i = sum_j w_ij x_j over itself and its ring neighbours (w = 1/(deg + 1)).
Each rank checks its own final parameters against the reference's model of its rank.

Arguments: the runs, separated by ``--``, each ``ring`` or ``torus`` (a 2x2 grid) and optionally
``--differ`` (also check that the ranks' models are not all the same); every rank prints
``GOSSIP OK <run> rank <rank>`` for each run it checked."""

import sys

import torch
from scenarios import split_runs
from small_mlp import SETTINGS

from psgrad.comm.transport import world_rank, world_size
from psgrad.config import RunConfig
from psgrad.data import ShardLoader, load_dataset
from psgrad.models import build_model
from psgrad.roles import topology_of
from psgrad.train import run

STEPS = 5


def check(topology: str, differ: bool) -> None:
    cfg = RunConfig(
        **SETTINGS,
        steps=STEPS,
        topology=topology,
        grid="2x2" if topology == "torus" else None,
        codec="none",
        consensus_step=1.0,
        consensus_every_steps=1,
    )
    result = run(cfg)
    size, rank = world_size(), world_rank()
    torch.manual_seed(cfg.seed)
    first = build_model("mlp", 10)
    models = [first] + [build_model("mlp", 10) for _ in range(size - 1)]
    for m in models[1:]:
        m.load_state_dict(first.state_dict())
    opts = [
        torch.optim.SGD(m.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay) for m in models
    ]
    data = load_dataset("synthetic", "train", synthetic_size=256, seed=cfg.seed)
    loaders = [
        ShardLoader(data, dataset="synthetic", worker=r, workers=size, batch_size=cfg.batch_size, seed=cfg.seed)
        for r in range(size)
    ]
    for step in range(STEPS):
        for m, opt, loader in zip(models, opts, loaders, strict=True):
            opt.zero_grad()
            x, y = loader.batch(step)
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        before = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]
        with torch.no_grad():
            for r, m in enumerate(models):
                group = [r, *topology_of(cfg.topology).neighbours(r, size, cfg)]
                for n, p in m.named_parameters():
                    p.copy_(sum(before[j][n] for j in group) / len(group))
    mine = dict(models[rank].named_parameters())
    for name, p in result.params.items():
        torch.testing.assert_close(p, mine[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
    if differ:  # the ranks' models are not all the same (gossip is not an allreduce)
        assert not torch.allclose(
            dict(models[0].named_parameters())["net.1.weight"], dict(models[2].named_parameters())["net.1.weight"]
        )


for words in split_runs(sys.argv[1:]):
    check(words[0], "--differ" in words)
    print(f"GOSSIP OK {' '.join(words)} rank {world_rank()}", flush=True)
