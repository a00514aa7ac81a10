"""The run context, built once per rank, and the interface every role implements.

``RunContext.build`` does, in order: settings -> rank layout -> model -> layer plan -> this
rank's data shard -> steps -> resume state; ``open_log`` then writes config.json and opens the
metrics log (rank 0), once a resumed state has loaded on every rank. Every role receives the same
context, so no role wires up a model, codec, feedback or checkpoint path of its own.
"""

from __future__ import annotations

import copy
import datetime
import importlib.metadata
import math
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from . import checkpoint
from .accuracy import accuracy_note
from .codecs import make_codec
from .comm import wire
from .comm.layout import RankLayout
from .comm.protocol import StepStats, buffers_vector, layer_tag, plan_layers
from .comm.transport import Transport
from .config import RunConfig
from .data import DataError, ImageSet, ShardLoader, eval_batches, load_dataset
from .feedback import NoFeedback, make_feedback
from .metrics import MetricsLog, say
from .models import build_model
from .models.layout import in_layout, memory_format
from .optim import LayerOptimizer, OptimizerFn, TorchLayerOptimizer
from .roles import topology_of
from .startup import agree

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
T = TypeVar("T")

_GLOBAL_RNG = threading.Lock()
"""Held while a model is built from torch's global generator: simulated ranks share a process,
and one rank seeding while another draws its initial weights would give them different models."""


class _IterLoader:
    """Adapts a re-iterable loader of (inputs, labels) to ``batch(step)`` (epochs restart it)."""

    def __init__(self, iterable: Iterable) -> None:
        self.iterable = iterable
        self.steps_per_epoch = len(iterable)  # type: ignore[arg-type]
        self._it, self._next = None, 0

    def batch(self, step: int):
        if self._it is None or step != self._next or step % self.steps_per_epoch == 0:
            self._it = iter(self.iterable)
            for _ in range(step % self.steps_per_epoch):
                next(self._it)
        self._next = step + 1
        return next(self._it)


def evaluate(
    model: nn.Module, batches: Iterable, loss_fn: LossFn, layout: torch.memory_format = torch.contiguous_format
) -> tuple[float, float]:
    """Mean loss and accuracy of ``model`` over ``batches``, its images in ``layout``."""
    model.eval()
    total, loss_sum, correct = 0, 0.0, 0
    with torch.no_grad():
        for images, labels in batches:
            out = model(in_layout(images, layout))
            loss_sum += float(loss_fn(out, labels)) * len(labels)
            correct += int((out.argmax(1) == labels).sum())
            total += len(labels)
    return loss_sum / max(1, total), correct / max(1, total)


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


@dataclass
class RunContext:
    """Everything a role needs, built once by ``build``."""

    cfg: RunConfig
    transport: Transport
    layout: RankLayout
    model: nn.Module
    layers: list
    loss_fn: LossFn
    label: str
    steps_per_epoch: int
    total: int
    start: int
    device: torch.device
    loader: object | None = None
    resume: dict | None = None
    log: MetricsLog | None = None
    eval_data: Iterable | None = None
    optimizer_fn: OptimizerFn | None = None
    doing: str = "setting up"
    buffers_size: int = 0
    _test_set: ImageSet | None = field(default=None, repr=False)
    _eval_model: nn.Module | None = field(default=None, repr=False)
    _evaluator: ThreadPoolExecutor | None = field(default=None, repr=False)
    _evaluations: list[Future] = field(default_factory=list, repr=False)

    @property
    def rank(self) -> int:
        return self.transport.rank

    # ------------------------------------------------------------------ building
    @classmethod
    def build(
        cls,
        cfg: RunConfig,
        transport: Transport,
        *,
        model_fn: Callable[[], nn.Module] | None = None,
        loader_fn: Callable[[int, int], object] | None = None,
        eval_data: Iterable | None = None,
        loss_fn: LossFn | None = None,
        optimizer_fn: OptimizerFn | None = None,
    ) -> RunContext:
        """Build this rank's context (collective: every rank calls it)."""
        torch.set_num_threads(cfg.threads)
        layout = topology_of(cfg.topology).rank_layout(world=transport.size, servers=cfg.servers)
        rank = transport.rank
        with _GLOBAL_RNG:
            torch.manual_seed(cfg.seed)  # same initial model on every rank
            model = (
                model_fn()
                if model_fn
                else build_model(
                    cfg.model, cfg.num_classes, depth=cfg.depth, widen_factor=cfg.widen_factor, dropout=cfg.dropout
                )
            )
        named = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
        layers = plan_layers(
            named,
            granularity=cfg.granularity,
            owners=layout.server_ranks,
            bucket_vectors=cfg.bucket_vectors,
            cost=_coded_bytes(cfg.codec),
        )
        transport.check_tag(layer_tag(len(layers)))
        label = cfg.dataset_label if loader_fn is None else "custom data"
        loader, test_set = _data(
            cfg, transport=transport, layout=layout, loader_fn=loader_fn, own_test_set=eval_data is None
        )
        # collective on every rank (--device may differ per rank): a server counts in no GPU index
        local_worker = transport.local_rank(group=int(layout.is_worker(rank)))
        # every rank agrees on the steps per epoch: the mean of the workers' shards
        spe = int(transport.allreduce_sum([loader.steps_per_epoch if loader else 0])[0] // layout.num_workers)
        total = cfg.steps if cfg.steps is not None else max(1, math.ceil(cfg.epochs * spe))
        ctx = cls(
            cfg,
            transport,
            layout,
            model,
            layers,
            loss_fn or torch.nn.functional.cross_entropy,
            label,
            spe,
            total,
            0,
            _device(cfg, local_worker) if layout.is_worker(rank) else torch.device("cpu"),
            loader,
            eval_data=eval_data,
            optimizer_fn=optimizer_fn,
            buffers_size=buffers_vector(model).numel(),
            _test_set=test_set,
        )
        ctx.resume = ctx._load_resume()
        ctx.start = int(ctx.resume["step"]) if ctx.resume else 0
        if ctx.start >= total:
            raise checkpoint.CheckpointError(
                f"--resume {cfg.resume} is at step {ctx.start}, nothing left of {total} steps: to train on, give "
                f"--steps (or --epochs) beyond it, e.g. --steps {ctx.start + total}"
            )
        ctx._announce(model_fn is None)
        return ctx

    def open_log(self, *, keep_all_rows: bool = False) -> None:
        """Rank 0 writes config.json and opens the metrics log (``log``). Called once the run
        starts for sure: a resume whose checkpoint did not fit must leave its log dir as it was."""
        if self.rank != 0:
            return
        cfg = self.cfg
        if cfg.log_dir:
            cfg.save(cfg.log_dir, _run_facts(self.transport))
        self.log = MetricsLog(
            cfg.log_dir,
            total_steps=self.total,
            start_step=self.start,
            steps_per_epoch=self.steps_per_epoch,
            label=f"psgrad {self.label} {cfg.topology}",
            tensorboard=cfg.tensorboard,
            progress=cfg.progress,
            keep_all_rows=keep_all_rows,
        )

    def _announce(self, named_model: bool) -> None:
        pids = self.transport.all_pids()
        if self.rank != 0:
            return
        layout, cfg = self.layout, self.cfg
        print(f"[psgrad] {ranks_line([layout.role_name(r) for r in range(len(pids))], pids)}", file=sys.stderr)
        servers = len(layout.server_ranks)
        model = cfg.model if named_model else type(self.model).__name__
        params = sum(p.numel() for p in self.model.parameters())
        print(
            f"[psgrad] {self.transport.size} ranks{'' if self.transport.separate_processes else ' simulated in one process'} "
            f"({servers} serving, {layout.num_workers} working), topology "
            f"{cfg.topology}, mode {cfg.mode}, model {model} ({params:,} params, {len(self.layers)} messages/step), "
            f"data {self.label}, codec {make_codec(cfg.codec).spec}, feedback {cfg.feedback}, "
            f"steps {self.start}..{self.total} ({self.steps_per_epoch} per epoch)",
            file=sys.stderr,
        )
        note = accuracy_note(cfg)
        if note is not None:
            print(f"[psgrad] {note}", file=sys.stderr)

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

    def is_eval_step(self, step: int) -> bool:
        """The last step, every ``eval_steps``-th step, and the end of every ``eval_every``-th epoch."""
        spe, every = self.steps_per_epoch, self.cfg.eval_every
        if step == self.total - 1 or (self.cfg.eval_steps and (step + 1) % self.cfg.eval_steps == 0):
            return True
        return every > 0 and (step + 1) % spe == 0 and ((step + 1) // spe) % every == 0

    def is_checkpoint_step(self, step: int) -> bool:
        """Every ``--checkpoint-every`` steps, and after the last step whenever there is a log dir."""
        every = self.cfg.checkpoint_every
        last = step + 1 == self.total and self.cfg.log_dir is not None
        return last or (every > 0 and (step + 1) % every == 0 and step + 1 < self.total)

    def start_evaluation(self, model: nn.Module, step: int, paused: float = 0.0) -> None:
        """Evaluate ``model`` after ``step``; the row comes out of ``take_evaluations``.

        With ``--eval-background`` (default) a helper thread evaluates while this rank goes on
        serving or training, so the workers do not wait for it: the caller hands ``model`` over and
        must not change it before ``wait_for_evaluations`` (at most one runs at a time). Otherwise
        it runs here and now. ``paused``: the seconds the caller already held training up (the row's
        ``paused_seconds`` adds the evaluation itself when it runs in the foreground)."""
        if not self.cfg.eval_background:
            row = self.evaluate(model, step)
            row["paused_seconds"] = paused + row["eval_seconds"]
            future: Future = Future()
            future.set_result(row)
        else:
            if self._evaluator is None:
                self._evaluator = ThreadPoolExecutor(1, thread_name_prefix="psgrad-eval")
            future = self._evaluator.submit(lambda: {**self.evaluate(model, step), "paused_seconds": paused})
        self._evaluations.append(future)

    def evaluation_model(self) -> nn.Module:
        """The model rank 0 loads an evaluation into, free to change (the previous evaluation has
        finished): a serving-only rank's own model, which never trains; on a training rank a copy of
        it, made once (building a new model would draw from the RNG the run trains with), without
        the worker's pull hooks."""
        self.wait_for_evaluations()
        if not self.layout.is_worker(self.rank):
            return self.model
        if self._eval_model is None:
            self._eval_model = copy.deepcopy(self.model).cpu()
            for module in self._eval_model.modules():
                module._forward_pre_hooks.clear()
        return self._eval_model

    def wait_for_evaluations(self) -> None:
        """Block until every evaluation started has finished (its model may be changed again)."""
        wait(self._evaluations)

    def take_evaluations(self, block: bool = False) -> list[dict]:
        """The rows of the evaluations finished so far, in order (with ``block``: of all, and the
        helper thread ends)."""
        if block:
            self.wait_for_evaluations()
            if self._evaluator is not None:
                self._evaluator.shutdown()
                self._evaluator = None
        rows = []
        while self._evaluations and self._evaluations[0].done():
            rows.append(self._evaluations.pop(0).result())  # re-raises an evaluation's exception here
        return rows

    def evaluate(self, model: nn.Module, step: int) -> dict:
        """One eval.csv row: ``model`` evaluated on the test set after ``step``."""
        if self.eval_data is not None:
            batches = self.eval_data
        else:
            batches = eval_batches(self._test_set, self.cfg.dataset)
        start = time.perf_counter()
        device = next(model.parameters()).device
        test_loss, test_acc = evaluate(model, batches, self.loss_fn, memory_format(self.cfg.memory_format, device))
        return {
            "epoch": round((step + 1) / self.steps_per_epoch, 4),
            "step": step,  # the last step trained, 0-based as in metrics.csv
            "test_loss": test_loss,
            "test_acc": test_acc,
            "dataset": self.label,
            "eval_seconds": time.perf_counter() - start,
        }

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int, state: dict) -> None:
        """Every rank writes its file (atomically); once all have (one allreduce: every rank is
        between steps, and the MPI progress it drives completes the sends still in flight), rank 0
        writes the marker that makes the checkpoint complete."""
        directory = checkpoint.step_dir(self.cfg.log_dir or "checkpoints", step)
        checkpoint.save_rank_state(directory, self.rank, {"step": step, **state})
        written = self.transport.allreduce_sum([1])[0]
        if self.rank == 0 and written == self.transport.size:
            checkpoint.mark_complete(directory, step, self.transport.size)

    def save_model(self) -> None:
        """``model.pt`` in the log dir, from the first worker's model after its last pull: the
        servers' final values, and that worker's BatchNorm statistics."""
        if self.cfg.log_dir and self.rank == self.layout.worker_ranks[0]:
            path = checkpoint.save_model(self.cfg.log_dir, self.model)
            say(f"[psgrad] trained model: {path} (torch.load(..., weights_only=True))")

    def _load_resume(self) -> dict | None:
        cfg = self.cfg
        if not cfg.resume:
            return None
        directory = checkpoint.resolve(cfg.resume)
        state = checkpoint.load_rank_state(directory, self.rank, self.transport.size)
        steps = self.transport.allreduce_sum([int(state["step"]), 1])
        if steps[0] != int(state["step"]) * steps[1]:
            raise checkpoint.CheckpointError(
                f"--resume {directory}: the ranks' checkpoint files are from different steps"
            )
        return state


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


def _run_facts(transport: Transport) -> dict:
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
    """What the training loop drives on every rank (``roles.ROLES[topology](ctx)`` builds one).

    ``step(t)`` does this rank's part of step t (train a batch, serve until t is complete, or
    both) and returns the metrics rows that became complete; ``evaluate(t)`` does this rank's part
    of an evaluation (rank 0 starts it with ``ctx.start_evaluation``; the loop logs the rows from
    ``ctx.take_evaluations``); ``finish()`` ends the run's traffic and returns the last rows.
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
        """Start this rank's part of evaluating after ``step`` (rows: ``ctx.take_evaluations``)."""

    def finish(self) -> list[dict]:
        return []

    def params(self) -> dict[str, torch.Tensor]:
        """The model this rank ends with (empty where it holds none)."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore from a checkpoint's ``state`` (the dict ``state_dict`` gave, plus ``step``)."""


def load_split(cfg: RunConfig, split: str) -> ImageSet:
    """``split`` ("train" or "test") of ``cfg``'s dataset: read (CIFAR) or generated from its seed."""
    return load_dataset(
        cfg.dataset,
        split,
        data_dir=cfg.data_dir,
        synthetic_classes=cfg.synthetic_classes,
        synthetic_size=cfg.synthetic_samples,
        seed=cfg.seed,
    )


def read_agreed(cfg: RunConfig, transport: Transport, read: Callable[[], T]) -> T | None:
    """``read()`` on every rank, then agree (collective): a dataset that cannot serve the run
    (``DataError``, a missing file) is one error for the job, said once by the lowest rank that has
    it (``startup.agree``), and ``AgreementError`` on every rank; not a traceback per rank."""
    try:
        result, problem = read(), None
    except (DataError, FileNotFoundError) as err:
        result, problem = None, str(err)
    agree(transport, None if problem else cfg, problem, "data error")
    return result


def _data(
    cfg: RunConfig, *, transport: Transport, layout: RankLayout, loader_fn: Callable | None, own_test_set: bool
) -> tuple[object | None, ImageSet | None]:
    """This rank's batches (a worker's loader) and test set (rank 0's, which evaluates, unless the
    caller brought its own), made before the first step (``read_agreed``): a dataset that cannot be
    read, or is too small for one batch a worker, stops the job here, not at the first evaluation
    hours in."""
    rank = transport.rank

    def read() -> tuple[object | None, ImageSet | None]:
        loader = None
        if layout.is_worker(rank):
            index, workers = layout.worker_index(rank), layout.num_workers
            if loader_fn is not None:
                loader = loader_fn(index, workers)
                loader = loader if hasattr(loader, "batch") else _IterLoader(loader)
            else:
                train = load_split(cfg, "train")
                loader = ShardLoader(
                    train,
                    dataset=cfg.dataset,
                    worker=index,
                    workers=workers,
                    batch_size=cfg.batch_size,
                    seed=cfg.seed,
                    partition=cfg.partition,
                    augment=cfg.augment,
                )
        return loader, load_split(cfg, "test") if rank == 0 and own_test_set else None

    return read_agreed(cfg, transport, read)
