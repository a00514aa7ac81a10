"""Reference rows for ``psgrad bench``: torch DDP (dense, PowerSGD) and compute alone.

Each baseline trains the same model on the same per-worker batches as the parameter-server run
and returns per-step rows in the shape ``psgrad.bench.launcher`` measures (``wall`` plus the time
breakdown and bytes), so they land in the same table.

1. ``compute``: every worker rank trains its own shard at the same time, with no communication at
   all (plain ``torch.optim.SGD``); its clock is the slowest rank's (``slowest_clock``), so its
   it/s is what a perfectly hidden network would give the workers sharing this machine (the
   ceiling for every codec: a data-parallel job moves at its slowest worker's pace; on the
   2-core development VM one rank ran 1-5 % behind the other). ``mpiexec -n 1`` gives the rate of
   one process alone.
2. ``ddp``: every MPI rank is a worker; ``DistributedDataParallel`` over gloo (TCP), whose
   bucketed allreduce overlaps backward. gloo is initialised from a TCP address and port that rank 0
   broadcasts over MPI (``PSGRAD_RANK0_ADDR``, 127.0.0.1 unless the run is shaped).
3. ``ddp-powersgd``: as ``ddp`` with torch's PowerSGD communication hook (rank ``powersgd_rank``,
   compression from the second step on, error feedback and warm start as torch defaults) and all
   gradients in ONE bucket: with several buckets the hook's chained collectives may be issued in a
   different order on each rank, and gloo then fails or hangs.
4. Bytes per step are computed, not sniffed: a ring allreduce of E fp32 elements makes each of W
   workers send 2 (W-1)/W * 4E bytes; for PowerSGD E is the element count the hook allreduces
   (its P and Q factors plus the tensors it leaves uncompressed), read from the hook's own
   counters. All of it is reported as ``bytes_up`` (DDP has no server to send anything down).
"""

from __future__ import annotations

import gc
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import RunConfig
from ..data import ImageSet, eval_batches
from ..models import build_model
from ..models.layout import in_layout, memory_format
from ..optim import learning_rate
from ..runtime.allocator import keep_freed_memory

if TYPE_CHECKING:  # the interface only
    from ..comm.channel import Channel

BASELINES = ("compute", "ddp", "ddp-powersgd")


def slowest_clock(rows: list[dict], *, transport: Channel) -> None:
    """Set each row's ``wall`` to the slowest rank's at that step (collective; the ranks started
    together): a step of a job that waits for every worker ends when its last worker's does.

    1. Every rank writes its walls into its own row of a ranks x steps table, zeros elsewhere.
    2. One allreduce sums the tables: every rank then holds all of them.
    3. Each step's wall is the largest of its column.
    """
    walls = np.zeros((transport.size, len(rows)))
    walls[transport.rank] = [row["wall"] for row in rows]
    every = np.asarray(transport.allreduce_sum(walls.ravel())).reshape(transport.size, len(rows))
    for row, wall in zip(rows, every.max(axis=0), strict=True):
        row["wall"] = float(wall)


def _model_and_loader(cfg: RunConfig, worker: int, workers: int):
    from ..shards import shard_loader

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.num_classes, **cfg.model_options)
    return model, shard_loader(cfg, worker=worker, workers=workers)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ring_bytes(elements: int, workers: int) -> int:
    """Bytes all workers together send for one ring allreduce of ``elements`` fp32 values."""
    return 0 if workers < 2 else 2 * (workers - 1) * 4 * elements


def train_rows(
    cfg: RunConfig, model, *, loader, optimizer, steps: int, bytes_of_step, lr_at, evaluate=None
) -> tuple[list[dict], list[dict]]:
    """Train ``steps`` steps at the run's schedule (``lr_at(step)``, the same as psgrad's servers
    use), batches in the layout psgrad's workers use (``--memory-format``); ``evaluate(step)``
    (rank 0, at evaluation steps) gives eval rows."""
    layout = memory_format(cfg.memory_format, torch.device("cpu"))
    rows, evals, start = [], [], time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loading = time.perf_counter()
        images, labels = loader.batch(step)
        t0 = time.perf_counter()
        out = model(in_layout(images, layout))
        loss = F.cross_entropy(out, labels)
        t1 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # for DDP this includes the allreduce that backward could not hide
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        rows.append(
            {
                "step": step,
                "loss": float(loss.detach()),
                "load": t0 - loading,
                "forward": t1 - t0,
                "backward": t2 - t1,
                "apply": t3 - t2,
                "step_time": t3 - t0,
                "encode": 0.0,
                "push_wait": 0.0,
                "pull_wait": 0.0,
                "decode": 0.0,
                "bytes_up": bytes_of_step(),
                "bytes_down": 0,
                "wall": t3 - start,
            }
        )
        if evaluate is not None:
            row = evaluate(step)
            if row is not None:
                evals.append(row)
                model.train()
    return rows, evals


def _evaluator(cfg: RunConfig, model, test: ImageSet | None, steps: int):
    """With ``test`` (rank 0's, when the row evaluates), ``model`` is evaluated every
    ``cfg.eval_every_steps`` steps and at the last, like psgrad's runs."""
    if test is None:
        return None
    from ..evaluation import evaluate
    from ..metrics import say

    layout = memory_format(cfg.memory_format, torch.device("cpu"))

    def run(step: int) -> dict | None:
        if (step + 1) % cfg.eval_every_steps and step != steps - 1:
            return None
        start = time.perf_counter()
        loss, acc = evaluate(model, eval_batches(test, cfg.dataset), F.cross_entropy, layout)
        say(f"[eval] step {step}: test loss {loss:.4f}, accuracy {acc:.4f} ({cfg.dataset_label})")  # as psgrad's runs
        return {"step": step, "test_loss": loss, "test_acc": acc, "eval_seconds": time.perf_counter() - start}

    return run


def _wrapped(kind: str, model, *, numel: int, workers: int, powersgd_rank: int) -> tuple:
    """``model`` in DDP (``ddp``), or in DDP with the PowerSGD hook in one bucket
    (``ddp-powersgd``), and the function that gives each step's bytes on a ring allreduce."""
    from torch.nn.parallel import DistributedDataParallel

    if kind == "ddp":
        return DistributedDataParallel(model), lambda: _ring_bytes(numel, workers)
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    ddp = DistributedDataParallel(model, bucket_cap_mb=max(1.0, 8 * numel / 2**20))  # one bucket
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    seen = {"after": 0}

    def step_bytes() -> int:
        # before compression starts the hook runs a plain allreduce and counts nothing
        after = state.total_numel_after_compression
        elements, seen["after"] = (after - seen["after"]) or numel, after
        return _ring_bytes(elements, workers)

    return ddp, step_bytes


def _sgd(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.SGD:
    """The run's SGD, as psgrad's servers apply it."""
    return torch.optim.SGD(
        model.parameters(), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.sgd_nesterov, weight_decay=cfg.weight_decay
    )


def _init_gloo(transport) -> None:
    """torch.distributed on gloo over the MPI job's ranks: rank 0 picks a free port on
    ``PSGRAD_RANK0_ADDR`` (default loopback) and broadcasts it."""
    import torch.distributed as dist

    host = os.environ.get("PSGRAD_RANK0_ADDR", "127.0.0.1")
    port = int(transport.broadcast_bytes(str(_free_port(host)).encode() if transport.rank == 0 else None).decode())
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=transport.rank, world_size=transport.size)


def _run_ddp(
    kind: str,
    cfg: RunConfig,
    *,
    transport,
    model: nn.Module,
    loader,
    test,
    steps: int,
    lr_at: Callable[[int], float],
    powersgd_rank: int,
) -> tuple[list[dict], list[dict]]:
    """``kind``'s DDP over gloo on every rank of the job: the rows and evaluations of ``steps`` steps."""
    import torch.distributed as dist

    _init_gloo(transport)
    try:
        numel = sum(p.numel() for p in model.parameters())
        ddp, step_bytes = _wrapped(kind, model, numel=numel, workers=transport.size, powersgd_rank=powersgd_rank)
        evaluate = _evaluator(cfg, model, test, steps)
        rows, evals = train_rows(
            cfg,
            ddp,
            loader=loader,
            optimizer=_sgd(cfg, ddp),
            steps=steps,
            bytes_of_step=step_bytes,
            lr_at=lr_at,
            evaluate=evaluate,
        )
        dist.barrier()  # no rank tears gloo down while the other still has work in flight
        # DDP's reducer must not be the group's last holder: freed by it, the group's destructor
        # joins gloo's threads with the GIL held while one of them waits for the GIL (a torch deadlock)
        del ddp
        gc.collect()
    finally:
        dist.destroy_process_group()
    return rows, evals


def run_baseline(kind: str, cfg: RunConfig, steps: int, powersgd_rank: int = 2) -> tuple[list[dict], list[dict]]:
    """Run baseline ``kind`` on every MPI rank of the job; rank 0 returns (rows, evals), others
    ([], []). DDP rows evaluate every ``cfg.eval_every_steps`` steps; ``compute`` has no one model to
    evaluate (each worker trains alone)."""
    if kind not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {kind!r}")
    from ..agreement import read_agreed
    from ..comm.transport import Transport  # imported here: importing mpi4py's MPI initialises MPI
    from ..data import DataError
    from ..shards import load_split

    torch.set_num_threads(cfg.threads)
    keep_freed_memory()
    transport = Transport()
    rank, workers = transport.rank, transport.size

    def read():
        model, loader = _model_and_loader(cfg, rank, workers)
        evaluates = rank == 0 and kind != "compute" and cfg.eval_every_steps
        return model, loader, load_split(cfg, "test") if evaluates else None

    # as psgrad's own runs: an unreadable dataset is one line for the job
    model, loader, test = read_agreed(transport, read, problems=(DataError, FileNotFoundError), cfg=cfg)
    # the mean shard, as psgrad's runs agree on it
    spe = int(transport.allreduce_sum([loader.steps_per_epoch])[0] // workers)

    def lr_at(step: int) -> float:
        return learning_rate(cfg, step, spe, workers)

    if kind == "compute":
        transport.barrier()  # all ranks compute at once, as the workers of a real run do
        rows, _ = train_rows(
            cfg, model, loader=loader, optimizer=_sgd(cfg, model), steps=steps, bytes_of_step=lambda: 0, lr_at=lr_at
        )
        slowest_clock(rows, transport=transport)
        return (rows, []) if rank == 0 else ([], [])

    rows, evals = _run_ddp(
        kind, cfg, transport=transport, model=model, loader=loader, test=test, steps=steps, lr_at=lr_at,
        powersgd_rank=powersgd_rank,
    )  # fmt: skip
    return (rows, evals) if rank == 0 else ([], [])
