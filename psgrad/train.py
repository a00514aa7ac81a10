"""The training run: one function every rank calls; it builds its context and plays its role.

Read top to bottom: context (settings, model, layers, data, resume, metrics) -> role from the
topology's registry -> steps, each followed by metrics, evaluation and checkpoints -> result.
Any exception on any rank is printed with the rank and what it was doing, then the whole MPI job
is aborted (no hangs).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint
from .comm.transport import Transport, on_job_end
from .comm.waiting import PeerFailure
from .config import RunConfig
from .context import LossFn, RunContext
from .optim import OptimizerFn
from .runtime import job_end_hooks
from .runtime.failure import end_on_failure
from .runtime.watchdog import Report, Watchdog
from .startup import prepare
from .stopsaving import StopSaving


@dataclass
class RunResult:
    """What rank 0 saw (the last metrics.ROWS_KEPT metrics rows, all evaluations); every rank gets
    its own role and model."""

    role: str
    rank: int
    steps: int
    rows: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def run(
    cfg: RunConfig,
    *,
    model_fn: Callable[[], nn.Module] | None = None,
    loader_fn: Callable[[int, int], object] | None = None,
    eval_data: Iterable | None = None,
    loss_fn: LossFn = F.cross_entropy,
    transport: Transport | None = None,
    optimizer_fn: OptimizerFn | None = None,
    keep_all_rows: bool = False,
    save_on_stop: bool = True,
) -> RunResult:
    """Train under MPI: call on every rank (``mpiexec -n 3 python my_script.py``).

    ``model_fn`` builds the model (identically on every rank; default from ``cfg.model``),
    ``loader_fn(worker_index, num_workers)`` gives each worker an object with ``batch(step)`` and
    ``steps_per_epoch``, or a re-iterable loader with ``len`` (default: ``cfg.dataset`` shards),
    ``eval_data`` is an iterable of (inputs, labels) for evaluation on rank 0,
    ``loss_fn(outputs, labels)`` the training loss, and ``optimizer_fn([layer_values])`` builds
    any ``torch.optim.Optimizer`` the servers apply per layer (default: ``cfg.optimizer``; psgrad's
    schedule sets its lr every step). ``keep_all_rows`` keeps every metrics row in the result
    (``psgrad bench`` reads them all), not only the last few. With ``save_on_stop``, a SIGTERM
    during the steps of a run that writes checkpoints is saved in one before the job stops
    (psgrad/stopsaving.py).
    """
    _check_eval_data(eval_data, own_model=model_fn is not None, dataset=cfg.dataset)
    transport = transport or Transport()
    on_job_end(**job_end_hooks())  # MPI_Abort's leftovers removed, sentinels told after MPI_Finalize
    layout = prepare(cfg, transport=transport)
    where: dict = {}

    def report() -> Report:
        role = where.get("role")
        return Report(role.doing if role else "setting up", where.get("slowest", 0.0))

    watchdog = Watchdog(
        transport, report=report, names=layout.role_name, timeout=cfg.timeout, claim_dir=cfg.log_dir
    ).start()
    try:
        ctx = RunContext.build(
            cfg,
            transport,
            layout=layout,
            model_fn=model_fn,
            loader_fn=loader_fn,
            eval_data=eval_data,
            loss_fn=loss_fn,
            optimizer_fn=optimizer_fn,
        )
        # simulated ranks are threads of one process, which share its signals: psgrad simulate
        # notes them for every rank (transport.shared_stop), or none is saved
        saving = save_on_stop and (isinstance(transport, Transport) or transport.shared_stop() is not None)
        result = _loop(ctx, where=where, keep_all_rows=keep_all_rows, at_step=watchdog.at_step, save_on_stop=saving)
    except BaseException as err:
        end_on_failure(err, transport=transport, watchdog=watchdog, log_dir=cfg.log_dir, doing=report().doing)
        raise
    watchdog.stop()
    return result


def _check_eval_data(eval_data: Iterable | None, *, own_model: bool, dataset: str) -> None:
    """``eval_data`` can serve every evaluation of the run (ValueError otherwise): given with a
    model of the caller's own, not empty, and not a one-shot iterator, which the second
    evaluation would find empty (it scored accuracy 0 without a word)."""
    if own_model and eval_data is None:
        raise ValueError(
            "a custom model_fn needs eval_data (an iterable of (inputs, labels) batches of your test set): "
            f"psgrad will not evaluate your model on the {dataset} test set"
        )
    if isinstance(eval_data, Iterator):
        raise ValueError(
            f"eval_data is a one-shot iterator ({type(eval_data).__name__}): every evaluation reads it from the "
            "start, so the second would find it empty; pass a list of (inputs, labels) batches or a re-iterable "
            "loader (a torch DataLoader)"
        )
    if isinstance(eval_data, Sized) and len(eval_data) == 0:
        raise ValueError("eval_data holds no batches: give it your test set's (inputs, labels) batches")


def _loop(
    ctx: RunContext, *, where: dict, keep_all_rows: bool, at_step: Callable[[int], None], save_on_stop: bool
) -> RunResult:
    """This rank's role, from its first step to its result (``where`` tells the watchdog what it
    is doing, ``at_step`` which step it starts; ``save_on_stop``: psgrad/stopsaving.py)."""
    role = where["role"] = ctx.topology.make_role(ctx)
    if ctx.resume:
        _load_state(role, ctx)
        ctx.transport.barrier()  # every rank's state fits before rank 0 touches the log dir
    log = ctx.open_log(keep_all_rows=keep_all_rows)  # rank 0 only
    role.start()
    stops = StopSaving(ctx.transport, checkpoints=ctx.checkpoints, cfg=ctx.cfg, wanted=save_on_stop)
    with stops.during_steps():
        for step in range(ctx.start, ctx.total):
            at_step(step)
            stops.before(step)
            started = time.monotonic()
            rows = role.step(step)
            where["slowest"] = max(where.get("slowest", 0.0), time.monotonic() - started)
            if log:
                for row in rows:
                    log.step(row)
            if ctx.evaluations.is_due(step):
                role.evaluate(step)
            for evaluation in ctx.evaluations.take():
                log.evaluation(evaluation)
            if ctx.checkpoints.is_due(step):
                ctx.checkpoints.save(step + 1, role.state_dict())
            if stops.after(step):
                break
    rows = role.finish()
    for evaluation in ctx.evaluations.take(block=True):
        log.evaluation(evaluation)
    if stops.agreed:  # the last steps' rows logged, then the job ends (psgrad/stopsaving.py)
        for row in rows if log else ():
            log.step(row)
        stops.stop()
    # model.pt is the model rank 0 evaluated last (the last step is always evaluated): the servers'
    # final values with the workers' averaged BatchNorm statistics, so it scores what eval.csv says
    saved = ctx.checkpoints.save_model(ctx.evaluations.model()) if ctx.rank == 0 else None
    result = RunResult(role.name, ctx.rank, ctx.total, params=role.params())
    if log:
        for row in rows:
            log.step(row)
        result.rows, result.evals = list(log.rows), log.evals
        log.close()
        done = log.summary(steps=ctx.total - ctx.start, data=ctx.label)
        if done:
            print(done, file=sys.stderr)
        if saved is not None:  # after the progress bar and the summary, not in the middle of them
            print(
                f'[psgrad] trained model: {saved} (psgrad.load_model; docs/training.md, "What a run leaves behind")',
                file=sys.stderr,
            )
        if not ctx.cfg.log_dir:
            print("[psgrad] the trained model was not saved: --log-dir DIR keeps it (DIR/model.pt)", file=sys.stderr)
    return result


def _load_state(role, ctx: RunContext) -> None:
    """The checkpoint's state into ``role``; when it does not fit (another feedback, model or
    topology than the run that wrote it), a CheckpointError names the settings that changed."""
    try:
        role.load_state_dict(ctx.resume)
    except PeerFailure:  # another rank's failure, not this checkpoint's
        raise
    except (ValueError, KeyError, RuntimeError) as err:
        changed = ctx.resume_changed
        since = f"; changed since the run that wrote it: {', '.join(changed)}" if changed else ""
        raise checkpoint.CheckpointError(
            f"--resume {ctx.cfg.resume}: the checkpoint of step {ctx.start} does not fit this run's settings "
            f"({type(err).__name__}: {err}){since}. Resume with that run's settings: without --config, psgrad "
            "takes every setting the command line does not give from the config.json of the run it resumes"
        ) from err
