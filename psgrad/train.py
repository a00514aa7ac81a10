"""The training run: one function every rank calls; it finds its role and plays it.

Read top to bottom: settings -> model and layers -> data -> role (server, worker or alltoall
peer) -> steps -> evaluation, metrics, checkpoints -> result. Any exception on any rank is
printed with the rank and what it was doing, then the whole MPI job is aborted (no hangs).
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .codecs import make_codec
from .config import RunConfig
from .data import ImageSet, ShardLoader, eval_batches, load_dataset
from .feedback import make_feedback
from .metrics import MetricsLog, StepAggregator
from .models import build_model
from .optim import learning_rate
from .roles import Roles, plan_layers
from .server import ParameterServer
from .transport import Transport
from .worker import Worker, buffers_vector, load_buffers_vector

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class RunResult:
    """What rank 0 (server 0, or peer 0) saw; other ranks get a result with their own role."""

    role: str
    rank: int
    steps: int
    rows: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


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


def _device(cfg: RunConfig, transport: Transport) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch sees no CUDA device on this node")
    return torch.device("cuda", transport.local_rank() % torch.cuda.device_count())


def evaluate(model: nn.Module, batches: Iterable, loss_fn: LossFn) -> tuple[float, float]:
    """Mean loss and accuracy of ``model`` over ``batches``."""
    model.eval()
    total, loss_sum, correct = 0, 0.0, 0
    with torch.no_grad():
        for images, labels in batches:
            out = model(images)
            loss_sum += float(loss_fn(out, labels)) * len(labels)
            correct += int((out.argmax(1) == labels).sum())
            total += len(labels)
    return loss_sum / max(1, total), correct / max(1, total)


def _eval_row(model: nn.Module, batches: Iterable, loss_fn: LossFn, step: int, spe: int, label: str) -> dict:
    """One eval.csv row: the model evaluated after ``step``."""
    test_loss, test_acc = evaluate(model, batches, loss_fn)
    epoch = round((step + 1) / spe, 4)
    return {"epoch": epoch, "step": step + 1, "test_loss": test_loss, "test_acc": test_acc, "dataset": label}


def _is_eval_step(cfg: RunConfig, step: int, spe: int, total: int) -> bool:
    if step == total - 1:
        return True
    return cfg.eval_every > 0 and (step + 1) % spe == 0 and ((step + 1) // spe) % cfg.eval_every == 0


def _checkpoint_path(cfg: RunConfig, step: int, rank: int) -> Path:
    return Path(cfg.log_dir or "checkpoints") / f"ckpt-step{step}" / f"rank{rank}.pt"


def _save(state: dict, path: Path) -> None:
    """Atomic: write a temporary file, then rename it over the final name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_resume(cfg: RunConfig, transport: Transport) -> dict | None:
    if not cfg.resume:
        return None
    path = Path(cfg.resume) / f"rank{transport.rank}.pt"
    if not path.is_file():
        raise FileNotFoundError(
            f"--resume {cfg.resume}: no {path.name} for rank {transport.rank} (was the run started with the same number of ranks?)"
        )
    state = torch.load(path, weights_only=True)
    steps = transport.allreduce_sum([int(state["step"]), 1])
    if steps[0] != int(state["step"]) * steps[1]:
        raise RuntimeError(f"--resume {cfg.resume}: the ranks' checkpoint files are from different steps")
    return state


def run(
    cfg: RunConfig,
    model_fn: Callable[[], nn.Module] | None = None,
    loader_fn: Callable[[int, int], object] | None = None,
    eval_data: Iterable | None = None,
    loss_fn: LossFn = F.cross_entropy,
    transport: Transport | None = None,
) -> RunResult:
    """Train under MPI: call on every rank (``mpiexec -n 3 python my_script.py``).

    ``model_fn`` builds the model (identically on every rank; default from ``cfg.model``),
    ``loader_fn(worker_index, num_workers)`` gives each worker an object with ``batch(step)`` and
    ``steps_per_epoch``, or a re-iterable loader with ``len`` (default: ``cfg.dataset`` shards),
    ``eval_data`` is an iterable of (inputs, labels) for server-side evaluation.
    """
    cfg.validate()
    transport = transport or Transport()
    state = {"doing": "setting up"}
    try:
        return _run(cfg, model_fn, loader_fn, eval_data, loss_fn, transport, state)
    except BaseException as err:
        doing = state["role"].doing if "role" in state else state["doing"]
        print(f"[psgrad rank {transport.rank}] {type(err).__name__} while {doing}: {err}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        if transport.size > 1:
            transport.abort(1)
        raise


def _run(cfg, model_fn, loader_fn, eval_data, loss_fn, transport: Transport, state: dict) -> RunResult:
    torch.set_num_threads(cfg.threads)
    roles = Roles(transport.size, cfg.servers, cfg.topology)
    rank, workers = transport.rank, roles.num_workers
    torch.manual_seed(cfg.seed)  # same initial model on every rank
    model = (
        model_fn()
        if model_fn
        else build_model(
            cfg.model, cfg.num_classes, depth=cfg.depth, widen_factor=cfg.widen_factor, dropout=cfg.dropout
        )
    )
    named = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    layers = plan_layers(named, cfg.granularity, cfg.servers if cfg.topology == "ps" else 1, cfg.bucket_vectors)
    is_server = roles.is_server(rank)
    label = "synthetic" if cfg.dataset == "synthetic" and loader_fn is None else cfg.dataset

    # ---- data: workers get shards; every rank agrees on the steps per epoch
    state["doing"] = "loading data"
    loader = None
    if not is_server:
        worker_index = roles.worker_index(rank)
        if loader_fn is not None:
            loader = loader_fn(worker_index, workers)
            loader = loader if hasattr(loader, "batch") else _IterLoader(loader)
        else:
            train_set = load_dataset(
                cfg.dataset, "train", cfg.data_dir, cfg.synthetic_classes, cfg.synthetic_size, cfg.seed
            )
            loader = ShardLoader(
                train_set, cfg.dataset, worker_index, workers, cfg.batch_size, cfg.seed, cfg.partition, cfg.augment
            )
    spe_sum = transport.allreduce_sum([0 if loader is None else loader.steps_per_epoch])[0]
    spe = int(spe_sum // workers)
    total = cfg.steps if cfg.steps is not None else max(1, math.ceil(cfg.epochs * spe))
    resume = _load_resume(cfg, transport)
    start = int(resume["step"]) if resume else 0
    if start >= total:
        raise ValueError(f"--resume is at step {start}, nothing left of {total} steps")

    pids = transport.all_pids()
    if rank == 0:
        names = ", ".join(f"{r}={'server' if roles.is_server(r) else 'worker'}:{pid}" for r, pid in enumerate(pids))
        print(f"[psgrad] rank=role:pid {names}", file=sys.stderr)
        cfg_dir = cfg.log_dir
        if cfg_dir:
            cfg.save(cfg_dir)
        print(
            f"[psgrad] {transport.size} ranks ({len(roles.server_ranks)} server, {workers} worker), topology {cfg.topology}, mode {cfg.mode}, "
            f"model {cfg.model if model_fn is None else type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} params, {len(layers)} messages/step), "
            f"data {label}, codec {make_codec(cfg.codec).spec}, feedback {cfg.feedback}, steps {start}..{total} ({spe} per epoch)",
            file=sys.stderr,
        )

    if cfg.topology == "alltoall":
        return _run_peer(
            cfg, model, layers, loader, transport, state, loss_fn, spe, total, start, resume, eval_data, label
        )
    if is_server:
        return _run_server(
            cfg, model, layers, roles, transport, state, loss_fn, spe, total, start, resume, eval_data, label
        )
    return _run_worker(cfg, model, layers, roles, loader, transport, state, loss_fn, spe, total, start, resume)


def _eval_source(cfg: RunConfig, eval_data, label: str):
    if eval_data is not None:
        return lambda: eval_data
    test_set: ImageSet = load_dataset(
        cfg.dataset, "test", cfg.data_dir, cfg.synthetic_classes, cfg.synthetic_size, cfg.seed
    )
    return lambda: eval_batches(test_set, cfg.dataset)


def _run_server(
    cfg, model, layers, roles, transport, state, loss_fn, spe, total, start, resume, eval_data, label
) -> RunResult:
    rank = transport.rank
    params = dict(model.named_parameters())
    values = {
        layer.index: torch.cat([params[n].detach().reshape(-1) for n in layer.params]).clone()
        for layer in layers
        if layer.owner == rank
    }
    server = ParameterServer(transport, roles, layers, cfg, values, spe, start, buffers_vector(model).numel())
    state["role"] = server
    if resume:
        server.load_state_dict(resume["server"])
    log = (
        MetricsLog(cfg.log_dir, total, start, spe, f"psgrad {label}", cfg.tensorboard, cfg.progress)
        if rank == 0
        else None
    )
    can_eval = rank == 0
    other_servers = [s for s in roles.server_ranks if s != rank]
    batches = _eval_source(cfg, eval_data, label) if can_eval else None
    aggregator = StepAggregator(roles.num_workers)
    pending_eval: dict[int, dict] = {}

    def load_model(peers: dict[int, torch.Tensor] | None = None) -> None:
        """Copy the values into the model: this server's own, and other servers' from ``peers``."""
        flat_of = {layer.index: server.values[layer.index] for layer in layers if layer.owner == rank}
        for owner, flat in (peers or {}).items():
            offset = 0
            for layer in (layer for layer in layers if layer.owner == owner):
                flat_of[layer.index] = flat[offset : offset + layer.numel]
                offset += layer.numel
        with torch.no_grad():
            for layer in layers:
                if layer.index not in flat_of:
                    continue
                offset = 0
                for n in layer.params:
                    params[n].copy_(flat_of[layer.index][offset : offset + params[n].numel()].view_as(params[n]))
                    offset += params[n].numel()

    def maybe_eval(step: int) -> None:
        entry = pending_eval.get(step, {})
        if "params" not in entry or "buffers" not in entry or len(entry.get("peers", {})) < len(other_servers):
            return
        del pending_eval[step]
        server.doing = f"evaluating after step {step}"
        load_model(entry.get("peers"))
        load_buffers_vector(model, entry["buffers"])
        log.evaluation(_eval_row(model, batches(), loss_fn, step, spe, label))

    def on_stats(worker: int, record: dict) -> None:
        row = aggregator.add(record)
        if row is not None:
            row["lr"] = learning_rate(cfg, row["step"], spe, roles.num_workers)
            row["server_decode"], row["server_apply"], row["server_idle"] = (
                server.times["decode"],
                server.times["apply"],
                server.times["idle"],
            )
            row["server_cpu"] = time.process_time()  # this server process's CPU seconds so far
            log.step(row)

    def on_buffers(step: int, flat: torch.Tensor) -> None:
        pending_eval.setdefault(step, {})["buffers"] = flat
        maybe_eval(step)

    def on_values(owner: int, step: int, flat: torch.Tensor) -> None:
        pending_eval.setdefault(step, {}).setdefault("peers", {})[owner] = flat
        maybe_eval(step)

    def on_step_done(step: int) -> None:
        if _is_eval_step(cfg, step, spe, total):
            if can_eval:
                pending_eval.setdefault(step, {})["params"] = True
                maybe_eval(step)
            else:
                server.send_values(step)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < total:
            _save({"step": step + 1, "server": server.state_dict()}, _checkpoint_path(cfg, step + 1, rank))

    if rank == 0:
        server.on_stats, server.on_buffers = on_stats, on_buffers
        if other_servers:
            server.on_values = on_values
            server.still_waiting = lambda: bool(pending_eval)
    server.on_step_done = on_step_done
    server.run()
    if can_eval:
        load_model()
    result = RunResult(
        "server",
        rank,
        total,
        log.rows if log else [],
        log.evals if log else [],
        {n: p.detach().clone() for n, p in params.items()} if can_eval else {},
    )
    if log:
        log.close()
        _summary(result, cfg, label)
    return result


def _run_worker(cfg, model, layers, roles, loader, transport, state, loss_fn, spe, total, start, resume) -> RunResult:
    rank = transport.rank
    device = _device(cfg, transport)
    model.to(device)
    feedback = make_feedback(
        cfg.feedback,
        make_codec(cfg.codec),
        **(
            {
                "momentum": cfg.dgc_momentum,
                "nesterov": cfg.nesterov,
                "clip_norm": cfg.dgc_clip_norm,
                "warmup_epochs": cfg.dgc_warmup_epochs,
            }
            if cfg.feedback == "dgc"
            else {}
        ),
    )
    if resume:
        feedback.load_state_dict(resume["feedback"])
        load_buffers_vector(model, resume["buffers"])
        torch.set_rng_state(resume["rng"])
    worker = Worker(model, transport, roles, layers, cfg, feedback, device)
    state["role"] = worker
    worker.post_pulls(start)
    for step in range(start, total):
        feedback.set_epoch(step // max(1, spe))
        images, labels = loader.batch(step)
        stats = worker.train_step(step, images, labels, loss_fn)
        worker.report(stats)
        if _is_eval_step(cfg, step, spe, total):
            worker.send_buffers(step)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < total:
            _save(
                {
                    "step": step + 1,
                    "feedback": feedback.state_dict(),
                    "buffers": buffers_vector(model),
                    "rng": torch.get_rng_state(),
                },
                _checkpoint_path(cfg, step + 1, rank),
            )
    worker.stop()
    return RunResult("worker", rank, total, params={n: p.detach().cpu().clone() for n, p in model.named_parameters()})


def _run_peer(
    cfg, model, layers, loader, transport, state, loss_fn, spe, total, start, resume, eval_data, label
) -> RunResult:
    from .peer import PeerWorker

    rank = transport.rank
    feedback = make_feedback(cfg.feedback, make_codec(cfg.codec))
    if resume:
        raise ValueError("--resume is not supported with --topology alltoall yet")
    peer = PeerWorker(model, transport, layers, cfg, feedback, spe)
    state["role"] = peer
    log = (
        MetricsLog(cfg.log_dir, total, start, spe, f"psgrad {label} alltoall", cfg.tensorboard, cfg.progress)
        if rank == 0
        else None
    )
    first = last = time.perf_counter()
    for step in range(start, total):
        feedback.set_epoch(step // max(1, spe))
        images, labels = loader.batch(step)
        s = peer.train_step(step, images, labels, loss_fn)
        sums = transport.allreduce_sum(
            [
                s.loss,
                s.bytes_up,
                s.bytes_down,
                s.forward,
                s.backward,
                s.encode,
                s.push_wait,
                s.decode,
                s.apply,
                s.step_time,
            ]
        )
        now = time.perf_counter()
        if log:
            n = transport.size
            keys = ("forward", "backward", "encode", "push_wait", "decode", "apply", "step_time")
            row = {
                "step": step,
                "loss": sums[0] / n,
                "bytes_up": int(sums[1]),
                "bytes_down": int(sums[2]),
                "it_per_s": 1 / max(1e-9, now - last),
                "wall": now - first,
                "pull_wait": 0.0,
                "lr": learning_rate(cfg, step, spe, n),
            }
            row.update({k: sums[3 + i] / n for i, k in enumerate(keys)})
            log.step(row)
        last = now
        if _is_eval_step(cfg, step, spe, total):
            # BatchNorm statistics averaged over ranks, then rank 0 evaluates
            flat = buffers_vector(model)
            if flat.numel():
                load_buffers_vector(
                    model, torch.from_numpy(transport.allreduce_sum(flat.double().numpy())).float() / transport.size
                )
            if log:
                log.evaluation(_eval_row(model, _eval_source(cfg, eval_data, label)(), loss_fn, step, spe, label))
    result = RunResult(
        "peer",
        rank,
        total,
        log.rows if log else [],
        log.evals if log else [],
        {n: p.detach().clone() for n, p in model.named_parameters()},
    )
    if log:
        log.close()
        _summary(result, cfg, label)
    return result


def _summary(result: RunResult, cfg: RunConfig, label: str) -> None:
    rows = result.rows
    if not rows:
        return
    tail = rows[len(rows) // 5 :] or rows  # skip warm-up
    its = len(tail) / max(1e-9, sum(1 / r["it_per_s"] for r in tail))
    mb = sum(r["bytes_up"] + r["bytes_down"] for r in tail) / len(tail) / 1e6
    acc = f", test accuracy {result.evals[-1]['test_acc']:.4f}" if result.evals else ""
    print(
        f"[psgrad] done: {len(rows)} steps, final loss {rows[-1]['loss']:.4f}, {its:.2f} it/s, {mb:.3f} MB/step (up+down, all workers){acc} [{label}]",
        file=sys.stderr,
    )
