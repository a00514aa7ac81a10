"""A bench row through your own loop (``--api optimizer``): the row's settings, trained by a plain
torch loop with ``psgrad.DistributedOptimizer``, so its rate pairs with ``psgrad train``'s.

1. ``psgrad.init`` with the row's settings (a ``ps`` server serves there and leaves).
2. The model and each worker's batches as ``psgrad train`` makes them (``cfg.model``,
   ``shards.shard_loader``, ``--memory-format``), and torch's SGD with the run's lr, momentum,
   Nesterov and weight decay (no schedule: the rate does not depend on it).
3. Per step: zero_grad, forward, loss, backward, ``step()``; each worker keeps a row per step
   (the wall clock, its loss, the bytes it sent and received: with ``--local-steps``, on the
   exchanges' steps only, as ``psgrad train`` counts them); after the steps, the bytes become
   every worker's (``psgrad.average`` times the workers), as ``psgrad train`` counts them.
4. The row's traffic ends (``shutdown(leave_mpi=False)``): the job's end leaves MPI.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from ..config import RunConfig
from ..models import build_model, seeded_model
from ..models.layout import in_layout, memory_format
from ..shards import shard_loader


def own_loop_rows(cfg: RunConfig, *, steps: int) -> list[dict] | None:
    """Train ``steps`` steps of ``cfg`` through your own loop; the first worker's rows, else None."""
    from .. import userloop
    from ..userloop.world import init_settings

    userloop.init(**init_settings(cfg))  # the row's exchange; its model, data and SGD are this loop's
    torch.set_num_threads(cfg.threads)
    model = seeded_model(lambda: build_model(cfg.model, cfg.num_classes, **cfg.model_options), seed=cfg.seed)
    loader = shard_loader(cfg, worker=userloop.worker_index(), workers=userloop.num_workers())
    fmt = memory_format(cfg.memory_format, torch.device("cpu"))
    sgd = torch.optim.SGD(
        model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.sgd_nesterov, weight_decay=cfg.weight_decay
    )
    opt = userloop.DistributedOptimizer(sgd, model)
    rows, started = [], time.perf_counter()
    model.train()
    for step in range(steps):
        begin = time.perf_counter()
        opt.zero_grad()
        images, labels = loader.batch(step)
        loss = F.cross_entropy(model(in_layout(images, fmt)), labels)
        loss.backward()
        opt.step()
        end = time.perf_counter()
        rows.append(
            asdict(opt.last_stats)
            | {"step": step, "loss": float(loss.detach()), "wall": end - started, "step_time": end - begin}
        )
    # the bytes of every worker, as psgrad train counts them: colocated, the layers a rank serves
    # itself never cross a link, and a small model's shards can be far apart (one MLP rank sent 3 KB
    # a step, the other 0.8 MB)
    means = userloop.average([[row["bytes_up"], row["bytes_down"]] for row in rows])
    for row, (up, down) in zip(rows, means, strict=True):
        row["bytes_up"], row["bytes_down"] = up * userloop.num_workers(), down * userloop.num_workers()
    userloop.shutdown(leave_mpi=False)
    return rows if userloop.worker_index() == 0 else None
