"""The run context, built once per rank and not changed after, and the interface every role
implements.

``RunContext.build`` does, in order (on the layout ``startup.prepare`` gave): this rank's data and
the run's steps -> device -> model -> checkpoints and resume state -> evaluations -> layer plan;
``open_log`` then writes config.json and opens the metrics log (rank 0), once a resumed state has
loaded on every rank. Every role receives the same context, so no role wires up a model, codec,
feedback, evaluation or checkpoint path of its own: evaluations are ``ctx.evaluations``
(psgrad.evaluation), checkpoints ``ctx.checkpoints`` (psgrad.checkpointing).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from .accuracy import accuracy_note
from .checkpointing import Checkpoints, load_resume
from .codecs import make_codec
from .comm.channel import Channel
from .comm.layout import RankLayout, Topology
from .comm.protocol import StepStats, buffers_vector, layer_rounds, layer_tag, plan_layers
from .config import RunConfig
from .devices import rank_device
from .evaluation import Evaluations
from .feedback import NoFeedback, feedback_for, make_feedback
from .metrics import MetricsLog
from .models import build_model, seeded_model
from .optim import LayerOptimizer, OptimizerFn, TorchLayerOptimizer
from .roles import topology_of
from .shards import rank_data

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
T = TypeVar("T")


@dataclass(frozen=True)
class RunContext:
    """Everything a role needs, built once by ``build`` and not changed after: the settings, the
    rank's place, its model and layer plan, its data, the run's steps, the resumed state, and the
    run's evaluations and checkpoints."""

    cfg: RunConfig
    transport: Channel
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
    resume_changed: tuple[str, ...] = ()  # settings that shape training, changed since the resumed run
    optimizer_fn: OptimizerFn | None = None
    buffers_size: int = 0
    sums: bool = False  # the servers return the workers' mean gradient; the workers update (own loop)

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def topology(self) -> Topology:
        return topology_of(self.cfg.topology)

    # ------------------------------------------------------------------ building
    @classmethod
    def build(
        cls,
        cfg: RunConfig,
        transport: Channel,
        *,
        layout: RankLayout,
        model_fn: Callable[[], nn.Module] | None = None,
        loader_fn: Callable[[int, int], object] | None = None,
        eval_data: Iterable | None = None,
        loss_fn: LossFn = F.cross_entropy,
        optimizer_fn: OptimizerFn | None = None,
    ) -> RunContext:
        """Build this rank's context (collective: every rank calls it).

        1. This rank's data and the run's steps (``shards.rank_data``: the job stops there when a
           dataset cannot serve it), before anything large is built.
        2. Threads, this rank's device, and the model, from the same seed on every rank.
        3. The run's checkpoints, the resumed state, the step the run starts at and the settings
           changed since the resumed run (said at start-up), then rank 0's evaluations.
        4. The layer plan, sharded over the serving ranks by coded bytes.
        """
        trains = layout.is_worker(transport.rank)
        data = rank_data(cfg, transport=transport, layout=layout, loader_fn=loader_fn, own_test_set=eval_data is None)
        torch.set_num_threads(cfg.threads)
        device = rank_device(cfg.device, transport=transport, is_worker=trains)
        model = seeded_model(
            model_fn or partial(build_model, cfg.model, cfg.num_classes, **cfg.model_options), seed=cfg.seed
        )
        checkpoints = Checkpoints(
            cfg.log_dir,
            transport=transport,
            total=data.total,
            every=cfg.checkpoint_every_steps,
            keep=cfg.keep_checkpoints,
        )
        resume, start, changed = load_resume(cfg.resume, transport=transport, total=data.total, settings=asdict(cfg))
        evaluations = Evaluations(cfg, model=model, trains=trains, loss_fn=loss_fn, data=data, eval_data=eval_data)
        buffers_size = buffers_vector(model).numel()
        layers = plan_layers(
            [(name, tuple(p.shape)) for name, p in model.named_parameters()],
            granularity=cfg.granularity,
            owners=layout.server_ranks,
            bucket_vectors=cfg.bucket_vectors,
            codec_spec=cfg.codec,
        )
        transport.check_tag(layer_tag(len(layers)))
        ctx = cls(
            cfg=cfg, transport=transport, layout=layout, model=model, layers=layers, loss_fn=loss_fn,
            label=data.label, steps_per_epoch=data.steps_per_epoch, total=data.total, start=start, device=device,
            evaluations=evaluations, checkpoints=checkpoints, loader=data.loader, resume=resume,
            resume_changed=tuple(changed), optimizer_fn=optimizer_fn, buffers_size=buffers_size,
        )  # fmt: skip
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
            cfg.save(cfg.log_dir, _run_facts(self.transport) | {"model": type(self.model).__name__, "data": self.label})
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
        torch.optim.Optimizer) if given, else --optimizer sgd|adam with the run's settings; with
        --local-steps the outer optimizer (``optimizer_fn`` is then the workers' inner one)."""
        if self.optimizer_fn is not None and not self.cfg.local_steps:  # local steps: it is the workers'
            return TorchLayerOptimizer(self.optimizer_fn)
        return LayerOptimizer.from_config(self.cfg)

    def make_feedback(self) -> NoFeedback:
        """The worker-side memory around the codec, with every DGC option the run was given."""
        return feedback_for(self.cfg)

    def make_down_feedback(self) -> NoFeedback | None:
        """A summing server's memory around --down-codec (error feedback: what the coded mean
        gradient dropped goes out in later steps); None for a dense down-link."""
        down = make_codec(self.cfg.down_codec)
        return make_feedback("ef", down) if down.name != "none" else None


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
        f"[psgrad] {ctx.transport.size} rank{'s' if ctx.transport.size != 1 else ''}{'' if ctx.transport.separate_processes else ' simulated in one process'} "
        f"({servers} serving, {layout.num_workers} working), topology "
        f"{cfg.topology}, mode {cfg.mode}, model {model} ({params:,} params, {len(ctx.layers)} messages/step), "
        f"data {ctx.label}, codec {make_codec(cfg.codec).spec}, feedback {cfg.feedback}, "
        f"{f'down-codec {make_codec(cfg.down_codec).spec}, ' if cfg.down_codec != 'none' else ''}"
        f"steps {ctx.start}..{ctx.total} ({ctx.steps_per_epoch} per epoch)",
        file=sys.stderr,
    )
    if ctx.resume_changed:  # allowed (the state may still fit), but the run is not the one it continues
        print(
            f"[psgrad] resumed at step {ctx.start} with settings changed since the run that wrote the checkpoint: "
            + "; ".join(ctx.resume_changed),
            file=sys.stderr,
        )
    for note in (accuracy_note(cfg), down_link_note(cfg, ctx.layers)):
        if note is not None:
            print(f"[psgrad] {note}", file=sys.stderr)
    if ctx.transport.separate_processes and (note := one_worker_note(cfg, layout, ranks=ctx.transport.size)):
        print(f"[psgrad] {note}", file=sys.stderr)
    if note := threads_note(cfg.threads, ranks_here=ranks_on_node() if ctx.transport.separate_processes else 1):
        print(f"[psgrad] {note}", file=sys.stderr)


def threads_note(threads: int, *, ranks_here: int) -> str | None:
    """A sentence when ``threads`` torch threads a rank, times the ``ranks_here`` on rank 0's node,
    are more than the cores rank 0 may use: torch would run them all, each more slowly, and nothing
    else says so. One thread a rank on more ranks than cores is the launch's choice, not noted."""
    cores = len(os.sched_getaffinity(0))
    if threads > cores:
        return f"note: --threads {threads} is more than the {cores} cores rank 0 may use: its threads share them, each more slowly"
    if threads > 1 and threads * ranks_here > cores:
        return (
            f"note: --threads {threads} on each of the {ranks_here} ranks of rank 0's node is {threads * ranks_here} "
            f"threads for the {cores} cores rank 0 may use: they share them, each more slowly"
        )
    return None


def ranks_on_node() -> int:
    """The ranks the launcher started on this node, as it tells each of them (MPICH's hydra:
    MPI_LOCALNRANKS; Open MPI: OMPI_COMM_WORLD_LOCAL_SIZE); 1 when it does not say."""
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def one_worker_note(
    cfg: RunConfig, layout: RankLayout, *, ranks: int, colocated: str = "--topology colocated"
) -> str | None:
    """What ``mpiexec -n 2`` under ``ps`` gives, which nothing else says: one server and one worker,
    so nothing runs in parallel (None for any other layout). ``colocated`` is how the caller's
    users ask for colocated serving."""
    servers = len(layout.server_ranks)
    if layout.num_workers != 1 or not servers or ranks < 2:
        return None
    return (
        f"note: the {ranks} ranks of topology {cfg.topology} are {servers} server(s) and 1 worker: no data "
        f"parallelism. {colocated} makes every rank a worker that also serves its shard; or start more ranks"
    )


def down_link_note(cfg: RunConfig, layers: list, *, down: str = "") -> str | None:
    """What --down-codec codes under a codec of several rounds (None for any other pair): only the
    replies of the compressed layers that codec sends whole. A factored layer's reply is its summed
    factors, its own down-link, so a run that sets both would otherwise believe every reply coded.
    ``down`` names the setting as the caller's users write it (``--down-codec X`` by default)."""
    up = make_codec(cfg.codec)
    if cfg.down_codec == "none" or not up.multi_round:
        return None
    compressed = [layer for layer in layers if layer.compress]
    whole = [layer.name for layer in compressed if layer_rounds(up, layer) == 1]
    said = f"note: {down or f'--down-codec {cfg.down_codec}'} codes"
    if not whole:
        return f"{said} no reply here: {cfg.codec} factors every compressed layer, and a factored layer's reply is its summed factors"
    named = ", ".join(whole[:4]) + (f" and {len(whole) - 4} more" if len(whole) > 4 else "")
    return (
        f"{said} the replies of {len(whole)} of {len(compressed)} compressed layers, those {cfg.codec} sends whole "
        f"({named}); the others' replies are their summed factors"
    )


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
    """What config.json records of the run itself (not settings): who, where, with what (the
    caller adds the model's class and the data's label, which a run's own parts replace)."""
    return {
        "world_size": transport.size,
        "psgrad": importlib.metadata.version("psgrad"),
        "torch": torch.__version__,
        "mpi": transport.library(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


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
