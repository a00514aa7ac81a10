"""The run context, built once per rank and not changed after, and the interface every role
implements.

``RunContext.build`` does, in order: settings -> rank layout -> model -> layer plan -> this
rank's data shard -> steps -> resume state; ``open_log`` then writes config.json and opens the
metrics log (rank 0), once a resumed state has loaded on every rank. Every role receives the same
context, so no role wires up a model, codec, feedback, evaluation or checkpoint path of its own:
evaluations are ``ctx.evaluations`` (psgrad.evaluation), checkpoints ``ctx.checkpoints``
(psgrad.checkpointing).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from . import checkpoint
from .accuracy import accuracy_note
from .checkpointing import Checkpoints, load_resume
from .codecs import make_codec
from .comm import wire
from .comm.channel import Channel
from .comm.layout import RankLayout, Topology
from .comm.protocol import StepStats, buffers_vector, layer_tag, plan_layers
from .config import RunConfig
from .evaluation import Evaluations
from .feedback import NoFeedback, make_feedback
from .metrics import MetricsLog
from .models import build_model
from .optim import LayerOptimizer, OptimizerFn, TorchLayerOptimizer
from .roles import topology_of
from .shards import rank_data

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
T = TypeVar("T")

_GLOBAL_RNG = threading.Lock()
"""Held while a model is built from torch's global generator: simulated ranks share a process,
and one rank seeding while another draws its initial weights would give them different models."""


def device_problem(cfg: RunConfig) -> str | None:
    """Why a worker on this node cannot have ``cfg.device``, or None."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda but torch sees no CUDA device on this node"
    return None


def _device(cfg: RunConfig, local_worker: int) -> torch.device:
    """A worker's device: ``cuda:<its index among this node's workers>`` (modulo the GPUs seen)."""
    problem = device_problem(cfg)
    if problem is not None:
        raise RuntimeError(problem)
    if cfg.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_worker % torch.cuda.device_count())


@dataclass(frozen=True)
class RunContext:
    """Everything a role needs, built once by ``build`` and not changed after: the settings, the
    rank's place, its model and layer plan, its data, the run's steps, the resumed state, and the
    run's evaluations and checkpoints."""

    cfg: RunConfig
    transport: Channel
    topology: Topology
    layout: RankLayout
    model: nn.Module
    layers: list
    loss_fn: LossFn
    label: str
    steps_per_epoch: int
    total: int
    start: int
    device: torch.device
    evaluations: Evaluations
    checkpoints: Checkpoints
    loader: object | None = None
    resume: dict | None = None
    optimizer_fn: OptimizerFn | None = None
    buffers_size: int = 0

    @property
    def rank(self) -> int:
        return self.transport.rank

    # ------------------------------------------------------------------ building
    @classmethod
    def build(
        cls,
        cfg: RunConfig,
        transport: Channel,
        *,
        model_fn: Callable[[], nn.Module] | None = None,
        loader_fn: Callable[[int, int], object] | None = None,
        eval_data: Iterable | None = None,
        loss_fn: LossFn | None = None,
        optimizer_fn: OptimizerFn | None = None,
    ) -> RunContext:
        """Build this rank's context (collective: every rank calls it).

        1. Threads, rank layout, and the model, from the same seed on every rank.
        2. The layer plan, sharded over the serving ranks by coded bytes.
        3. This rank's data (``shards.rank_data``: the job stops here when a dataset cannot serve it).
        4. The device, and the steps: per epoch agreed over ranks, in all from --steps or --epochs.
        5. The resumed state, and the step the run starts at.
        """
        torch.set_num_threads(cfg.threads)
        topology = topology_of(cfg.topology)
        layout = topology.rank_layout(world=transport.size, servers=cfg.servers)
        model = _initial_model(cfg, model_fn)
        layers = _layer_plan(cfg, model=model, layout=layout, transport=transport)
        label = cfg.dataset_label if loader_fn is None else "custom data"
        loader, test_set = rank_data(
            cfg, transport=transport, layout=layout, loader_fn=loader_fn, own_test_set=eval_data is None
        )
        device = _rank_device(cfg, transport=transport, layout=layout)
        # every rank agrees on the steps per epoch: the mean of the workers' shards
        spe = int(transport.allreduce_sum([loader.steps_per_epoch if loader else 0])[0] // layout.num_workers)
        total = cfg.steps if cfg.steps is not None else max(1, math.ceil(cfg.epochs * spe))
        resume, start = _resumed(cfg, transport=transport, total=total)
        loss_fn = loss_fn or torch.nn.functional.cross_entropy
        ctx = cls(
            cfg=cfg,
            transport=transport,
            topology=topology,
            layout=layout,
            model=model,
            layers=layers,
            loss_fn=loss_fn,
            label=label,
            steps_per_epoch=spe,
            total=total,
            start=start,
            device=device,
            evaluations=Evaluations(
                cfg,
                model=model,
                trains=layout.is_worker(transport.rank),
                loss_fn=loss_fn,
                label=label,
                steps_per_epoch=spe,
                total=total,
                eval_data=eval_data,
                test_set=test_set,
            ),
            checkpoints=Checkpoints(cfg.log_dir, transport=transport, every=cfg.checkpoint_every, total=total),
            loader=loader,
            resume=resume,
            optimizer_fn=optimizer_fn,
            buffers_size=buffers_vector(model).numel(),
        )
        _announce(ctx, named_model=model_fn is None)
        return ctx

    def open_log(self, *, keep_all_rows: bool = False) -> MetricsLog | None:
        """Rank 0 writes config.json and opens the metrics log (None on the other ranks). Called
        once the run starts for sure: a resume whose checkpoint did not fit must leave its log dir
        as it was."""
        if self.rank != 0:
            return None
        cfg = self.cfg
        if cfg.log_dir:
            cfg.save(cfg.log_dir, _run_facts(self.transport))
        return MetricsLog(
            cfg.log_dir,
            total_steps=self.total,
            start_step=self.start,
            steps_per_epoch=self.steps_per_epoch,
            label=f"psgrad {self.label} {cfg.topology}",
            tensorboard=cfg.tensorboard,
            progress=cfg.progress,
            keep_all_rows=keep_all_rows,
        )

    # ------------------------------------------------------------------ what roles ask for
    def train_on_batch(self, step: int, train_step: Callable[[int, Any, Any], StepStats]) -> StepStats:
        """``train_step`` on this worker's batch of ``step``; the seconds spent loading the batch
        go in the stats' ``load``."""
        start = time.perf_counter()
        images, labels = self.loader.batch(step)  # type: ignore[union-attr]
        loaded = time.perf_counter() - start
        stats = train_step(step, images, labels)
        stats.load = loaded
        return stats

    def make_optimizer(self) -> LayerOptimizer | TorchLayerOptimizer:
        """The per-layer optimizer of the ranks that update: the API's ``optimizer_fn`` (any
        torch.optim.Optimizer) if given, else --optimizer sgd|adam with the run's settings."""
        if self.optimizer_fn is not None:
            return TorchLayerOptimizer(self.optimizer_fn)
        return LayerOptimizer.from_config(self.cfg)

    def make_feedback(self) -> NoFeedback:
        """The worker-side memory around the codec, with every DGC option the run was given."""
        cfg = self.cfg
        options = (
            {
                "momentum": cfg.dgc_momentum,
                "nesterov": cfg.nesterov,
                "clip_norm": cfg.dgc_clip_norm,
                "warmup_epochs": cfg.dgc_warmup_epochs,
            }
            if cfg.feedback == "dgc"
            else {}
        )
        return make_feedback(cfg.feedback, make_codec(cfg.codec), **options)


def _resumed(cfg: RunConfig, *, transport: Channel, total: int) -> tuple[dict | None, int]:
    """The resumed state of this rank (None without --resume) and the step the run starts at."""
    resume = load_resume(cfg.resume, transport=transport)
    start = int(resume["step"]) if resume else 0
    if start >= total:
        raise checkpoint.CheckpointError(
            f"--resume {cfg.resume} is at step {start}, nothing left of {total} steps: to train on, give "
            f"--steps (or --epochs) beyond it, e.g. --steps {start + total}"
        )
    return resume, start


def _layer_plan(cfg: RunConfig, *, model: nn.Module, layout: RankLayout, transport: Channel) -> list:
    """The layers, the units of communication, sharded over the serving ranks by coded bytes."""
    named = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    layers = plan_layers(
        named,
        granularity=cfg.granularity,
        owners=layout.server_ranks,
        bucket_vectors=cfg.bucket_vectors,
        cost=_coded_bytes(cfg.codec),
    )
    transport.check_tag(layer_tag(len(layers)))
    return layers


def _rank_device(cfg: RunConfig, *, transport: Channel, layout: RankLayout) -> torch.device:
    """A worker's device (``--device``), the CPU for a serving-only rank. Collective on every rank
    (--device may differ per rank): a server counts in no GPU index."""
    local_worker = transport.local_rank(group=int(layout.is_worker(transport.rank)))
    return _device(cfg, local_worker) if layout.is_worker(transport.rank) else torch.device("cpu")


def _initial_model(cfg: RunConfig, model_fn: Callable[[], nn.Module] | None) -> nn.Module:
    """The run's model before training, the same on every rank (torch seeded with ``cfg.seed``)."""
    with _GLOBAL_RNG:
        torch.manual_seed(cfg.seed)
        if model_fn is not None:
            return model_fn()
        return build_model(
            cfg.model, cfg.num_classes, depth=cfg.depth, widen_factor=cfg.widen_factor, dropout=cfg.dropout
        )


def _announce(ctx: RunContext, *, named_model: bool) -> None:
    """Rank 0's start-up lines: which rank plays which role in which process, and the run."""
    pids = ctx.transport.all_pids()
    if ctx.rank != 0:
        return
    layout, cfg = ctx.layout, ctx.cfg
    print(f"[psgrad] {ranks_line([layout.role_name(r) for r in range(len(pids))], pids)}", file=sys.stderr)
    servers = len(layout.server_ranks)
    model = cfg.model if named_model else type(ctx.model).__name__
    params = sum(p.numel() for p in ctx.model.parameters())
    print(
        f"[psgrad] {ctx.transport.size} ranks{'' if ctx.transport.separate_processes else ' simulated in one process'} "
        f"({servers} serving, {layout.num_workers} working), topology "
        f"{cfg.topology}, mode {cfg.mode}, model {model} ({params:,} params, {len(ctx.layers)} messages/step), "
        f"data {ctx.label}, codec {make_codec(cfg.codec).spec}, feedback {cfg.feedback}, "
        f"steps {ctx.start}..{ctx.total} ({ctx.steps_per_epoch} per epoch)",
        file=sys.stderr,
    )
    note = accuracy_note(cfg)
    if note is not None:
        print(f"[psgrad] {note}", file=sys.stderr)


def ranks_line(roles: list[str], pids: list[int]) -> str:
    """Which rank plays which role, in which process: ``rank=role:pid 0=server:11, 1=worker:12, ...``
    for ranks in processes of their own (the pid to signal or inspect each), and
    ``ranks 0=server, 1-32=worker, all in pid 7`` for ranks simulated in one process (a run of
    ranks with one role is one entry, not 33 copies of one pid)."""
    if len(set(pids)) != 1 or len(pids) == 1:
        return "rank=role:pid " + ", ".join(
            f"{r}={role}:{pid}" for r, (role, pid) in enumerate(zip(roles, pids, strict=True))
        )
    runs: list[list] = []  # [first rank, last rank, role]
    for rank, role in enumerate(roles):
        if runs and runs[-1][2] == role:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank, role])
    entries = ", ".join(f"{a}={role}" if a == b else f"{a}-{b}={role}" for a, b, role in runs)
    return f"ranks {entries}, all in pid {pids[0]}"


def _run_facts(transport: Channel) -> dict:
    """What config.json records of the run itself (not settings): who, where, with what."""
    return {
        "world_size": transport.size,
        "psgrad": importlib.metadata.version("psgrad"),
        "torch": torch.__version__,
        "mpi": transport.library(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def _coded_bytes(codec_spec: str) -> Callable[[tuple[int, ...], bool], float]:
    """A layer's cost for sharding: the bytes its gradient message may take on the wire."""
    return lambda shape, compress: float(wire.max_message_bytes(codec_spec if compress else "none", shape))


class Role:
    """What the training loop drives on every rank (``topology_of(cfg.topology).make_role(ctx)``
    builds one).

    ``step(t)`` does this rank's part of step t (train a batch, serve until t is complete, or
    both) and returns the metrics rows that became complete; ``evaluate(t)`` does this rank's part
    of an evaluation (rank 0 starts it with ``ctx.evaluations.start``; the loop logs the rows from
    ``ctx.evaluations.take``); ``finish()`` ends the run's traffic and returns the last rows.
    """

    name = "role"
    doing = "starting"

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def start(self) -> None:
        """Post receives, send the starting parameters: whatever comes before step ``ctx.start``."""

    def step(self, step: int) -> list[dict]:
        raise NotImplementedError

    def evaluate(self, step: int) -> None:
        """Start this rank's part of evaluating after ``step`` (rows: ``ctx.evaluations.take``)."""

    def finish(self) -> list[dict]:
        return []

    def params(self) -> dict[str, torch.Tensor]:
        """The model this rank ends with (empty where it holds none)."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore from a checkpoint's ``state`` (the dict ``state_dict`` gave, plus ``step``)."""
