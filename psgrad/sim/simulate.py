"""``psgrad simulate``: a whole job, N workers and its servers, as threads of one process.

1. The topology's rank layout for ``workers`` workers gives the number of ranks (the ps topology
   adds its ``--servers`` ranks).
2. The ranks share one ``sim.world.LocalWorld``. Each rank runs ``train.run`` in a thread of its
   own, on its ``LocalTransport``: the roles, codecs, feedback, optimizers and metrics are the
   ones an MPI job runs, so the same seed and settings give the same trajectory (up to the order
   of floating-point sums, as between two MPI runs).
3. Bytes are counted as they would go on the wire: every message is the wire format's bytes.
4. When one rank fails, the others stop at their next wait; its error is raised here. A job
   whose ranks all wait for each other for ``--timeout`` seconds (default 60) is ended.

Torch runs each rank's operations in that rank's thread and releases the GIL inside them, so the
ranks compute in parallel on the machine's cores, at most ``--cores`` of them at a time (the
local transport's core tokens); ``--threads`` stays the torch threads per rank.

With ``stack`` (``--stack``, the default) the workers' forwards and backwards are one pass of a
stacked model instead (``psgrad.sim.stacked``): the thread that called ``simulate`` runs it, for the
worker that handed in the last batch of the step, while it waits for the rank threads to end.
With more cores the workers are as many stacked groups, one per core, whose passes run side by
side (on two cores 1.1-1.3x as fast as one pass per worker, docs/benchmarks.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .. import checkpoint, memory
from ..config import RunConfig
from ..context import LossFn
from ..data import shared_loads
from ..metrics import say
from ..models import build_model
from ..optim import OptimizerFn
from ..roles import topology_of
from ..runtime.signals import stop_reason, stop_signals_to
from ..stopsaving import NotedStop
from ..train import RunResult, run
from .local import LocalTransport, Meeting
from .stacked import StackedWorkers
from .world import LocalWorld

DEFAULT_STALL = 60.0


def _play_out(world: LocalWorld, threads: list[threading.Thread], *, log_dir: str | None) -> None:
    """Start the ranks' threads and serve them until every one has ended.

    1. Every rank trains on the same sets: loaded once, held once (``shared_loads``).
    2. This thread joins the ranks in slices of 0.2 s (Ctrl-C reaches it between them, and the
       machine's memory is looked at), running the stacked passes meanwhile.
    3. A SIGTERM, when the run writes checkpoints (``world.shared_stop``), is noted for every rank,
       and the ranks save it as ``psgrad train``'s do (stopsaving.py): at a step they agree on.
    4. Ctrl-C, or a SIGTERM not saved: said once, every rank stopped (at most 10 s), the checkpoint
       that resumes the run named, and the stop raised again.
    """
    noting = stop_signals_to(world.shared_stop.note) if world.shared_stop is not None else nullcontext()
    with shared_loads(), noting:
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.2) if world.stacked is None else world.stacked.serve(0.2)
                    world.watch()
        except KeyboardInterrupt as err:
            reason, _ = stop_reason(err)
            say(f"[psgrad] {reason}")
            world.fail(reason)
            if world.stacked is not None:
                world.stacked.close(reason)
            deadline = time.monotonic() + 10.0
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            if (hint := checkpoint.resume_hint(log_dir)) is not None:  # now no rank writes one any more
                say(f"[psgrad] {hint}")
            raise
        finally:
            if world.stacked is not None:
                world.stacked.close("the simulation ended")
            if world.shared_stop is not None:
                world.shared_stop.agreed()  # its patience ends with the ranks


def _shared_stop(cfg: RunConfig, *, size: int) -> NotedStop | None:
    """The SIGTERM this process notes for every rank, saved as ``psgrad train`` saves it, when the
    run writes checkpoints (stopsaving.py); None: a SIGTERM stops the ranks at once."""
    if size > 1 and (cfg.log_dir is not None or cfg.checkpoint_every_steps > 0):
        return NotedStop(None, until="every rank agrees on, with a checkpoint")
    return None


def world_size(cfg: RunConfig, workers: int) -> int:
    """The ranks a job of ``workers`` workers takes with ``cfg``'s topology and servers."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    topology = topology_of(cfg.topology)
    size = topology.ranks_needed(workers=workers, servers=cfg.servers)
    topology.rank_layout(world=size, servers=cfg.servers)  # the topology's own checks
    places = topology.grid_places(cfg)
    if places is not None and places != size:
        raise ValueError(f"--grid {cfg.grid} has {places} places for {size} workers: simulate --workers {places}")
    return size


class MemoryWatch:
    """Why the simulation of ``size`` ranks must stop now, or None (``LocalWorld.memory_check``).

    1. Each look notes this process's resident memory. While it keeps growing (ranks building
       large models, a server posting its receive buffers), the smaller of the last two growths
       between looks is what the ranks may still add before the next look; a growth seen once
       (the stacked model made in one go) is not expected again.
    2. It is short when twice that would leave less than ``psgrad.memory``'s floor."""

    def __init__(self, size: int) -> None:
        self.size, self.last, self.growths = size, memory.resident(), (0, 0)

    def __call__(self) -> str | None:
        now = memory.resident()
        self.growths, self.last = (self.growths[1], max(0, now - self.last)), now
        short = memory.short_of(2 * min(self.growths))
        if short is None:
            return None
        available, total = short
        return (
            f"only {memory.gib(available)} of the machine's {memory.gib(total)} of memory is left with {self.size} "
            "simulated ranks in this process: fewer --workers, a smaller model or a smaller --batch-size would fit"
        )


def _refuse_what_cannot_fit(cfg: RunConfig, workers: int, *, model_fn: Callable[[], nn.Module] | None) -> None:
    """Stop before any rank starts when the workers' parameters and gradients alone, a floor of
    what they hold, would not fit the memory left: ``MemoryWatch`` would stop the run anyway, but
    only once the ranks had filled the machine, which takes minutes for a large model."""
    model = (model_fn or partial(build_model, cfg.model, cfg.num_classes, **cfg.model_options))()
    floor = 2 * workers * sum(p.numel() * p.element_size() for p in model.parameters())
    short = memory.short_of(floor)
    if short is not None:
        reason = (
            f"{workers} workers' parameters and gradients alone take {memory.gib(floor)}, and "
            f"{memory.gib(short[0])} of the machine's {memory.gib(short[1])} of memory is free: fewer --workers "
            "or a smaller model would fit"
        )
        say(f"[psgrad] stopping: {reason}")
        raise MemoryError(reason)


def simulate(
    cfg: RunConfig,
    workers: int,
    *,
    model_fn: Callable[[], nn.Module] | None = None,
    loader_fn: Callable[[int, int], object] | None = None,
    eval_data: Iterable | None = None,
    loss_fn: LossFn = F.cross_entropy,
    optimizer_fn: OptimizerFn | None = None,
    cores: int | None = None,
    stack: bool = True,
) -> list[RunResult]:
    """Run ``cfg`` with ``workers`` workers in this process; every rank's result, by rank.

    The arguments are ``train.run``'s (each rank calls it with them); at most ``cores`` ranks run
    at a time (default: the cores this process may use); ``stack`` computes the workers' forwards
    and backwards as stacked models (``psgrad.sim.stacked``), one group of workers per core; False: one
    pass per worker. Raises the first error any rank hit. Torch's thread count, which is the
    process's and which every rank and stacked pass sets, is the caller's again on return."""
    size = world_size(cfg, workers)
    _refuse_what_cannot_fit(cfg, workers, model_fn=model_fn)
    callers_threads = torch.get_num_threads()
    world = LocalWorld(size, cfg.timeout or DEFAULT_STALL, cores)
    world.memory_check = MemoryWatch(size)
    world.shared_stop = _shared_stop(cfg, size=size)
    if stack:
        world.stacked = StackedWorkers(Meeting(world, workers), groups=world.core_count)
    results: list[RunResult | None] = [None] * size
    errors: list[BaseException] = []

    def play(rank: int) -> None:
        world.enter(rank)
        try:
            results[rank] = run(
                cfg,
                model_fn=model_fn,
                loader_fn=loader_fn,
                eval_data=eval_data,
                loss_fn=loss_fn,
                transport=LocalTransport(world, rank),
                optimizer_fn=optimizer_fn,
            )
        except BaseException as err:  # noqa: BLE001 -- handed to the caller's thread below
            if not getattr(err, "reported_elsewhere", False):
                errors.append(err)
            world.fail(f"rank {rank} failed: {type(err).__name__}: {err}")
        finally:
            world.finished(rank)
            world.leave(rank)

    threads = [threading.Thread(target=play, args=(r,), name=f"psgrad-rank-{r}", daemon=True) for r in range(size)]
    try:
        _play_out(world, threads, log_dir=cfg.log_dir)
    finally:
        torch.set_num_threads(callers_threads)
    if world.memory_short is not None:
        raise MemoryError(world.memory_short)
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]
