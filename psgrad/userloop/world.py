"""The job seen from your own training loop: ``init`` once on every rank, then who is who.

``init(**settings)`` does, on every rank:
1. The settings: keywords named like ``RunConfig``'s fields, only those that act in your loop
   (``codec=``, ``feedback=``, ``down_codec=``, ``topology=``, ``servers=``, ...: ``your_loop`` in
   the settings table), held to the command line's rules and messages (``startup.prepare``: the
   ranks agree, or every rank raises).
2. This rank's place: its layout under the topology (``ps`` or ``colocated``; the servers sum,
   so ``mode`` is ``sync``). Rank 0 says, as ``psgrad train`` does at start-up, which rank plays
   which role, the exchange's settings, and the notes on them (``_announce``).
3. A serving-only rank (``--topology ps``) serves here: it learns the layer plan from the first
   worker's ``DistributedOptimizer``, decodes and sums gradients until every worker called
   ``shutdown`` (or exited), then ends its process with status 0. So one script runs unchanged
   on every rank; code after ``init`` runs on the workers only.
4. Every rank is watched as ``psgrad train``'s are (``runtime/watchdog.py``): a rank that stops,
   dies or is cut off, or every rank waiting on another, ends the job within ``timeout`` seconds,
   naming the rank, where the others would wait for its gradients for ever. An uncaught error,
   Ctrl-C or SIGTERM on any rank ends the job too, said by that rank (``_end_job_on_error``).
5. A worker returns. At exit (or ``shutdown()``) it tells the servers it is done and leaves MPI
   together with the other ranks.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..accuracy import accuracy_note
from ..choices import RENAMED
from ..codecs import make_codec
from ..comm.layout import RankLayout
from ..comm.protocol import layer_tag, plan_layers
from ..comm.transport import Transport, abort_if_running, finalize_and_exit, finalize_together, on_job_end
from ..config import RunConfig
from ..config.refusals import your_loop_config
from ..context import RunContext, one_worker_note, ranks_line
from ..metrics import say
from ..roles import topology_of
from ..runtime import job_end_hooks
from ..runtime.failure import SECOND_ABORT_DELAY
from ..runtime.signals import ignore_further_stops, stop_reason, stop_signals_raise_from_now
from ..runtime.watchdog import Report, Watchdog
from ..settings import settings_of
from ..startup import prepare
from .local import coded_change_note
from .stopping import StopTogether, report_from_thread, where_it_stopped

ABORT_GRACE_SECONDS = 0.5
"""How long a failing rank waits between printing its error and aborting the job."""

TOPOLOGIES = ("ps", "colocated")
"""The topologies whose servers can sum for your loop (a gossip rank has no server to sum)."""


@dataclass
class World:
    """This process's view of the job once ``init`` ran."""

    cfg: RunConfig
    transport: Transport
    layout: RankLayout
    closers: list = field(default_factory=list)  # what shutdown ends first: the optimizers' traffic
    optimizers: int = 0
    done: bool = False
    watchdog: Watchdog | None = None
    doing: Callable[[], str] = lambda: "in your loop, before its DistributedOptimizer"  # for the watchdog
    doing_in_psgrad: Callable[[], str] = lambda: ""  # the engine's last words, for a stop inside psgrad's code
    slowest_step: float = 0.0  # seconds, between two of the optimizer's steps
    stops: StopTogether | None = None  # the ranks' stop together after a signal
    workers: Transport | None = None  # the workers alone (a worker's), for saved stops' votes

    def watch(self) -> None:
        """Start the watchdog (collective: every rank, in ``init``)."""
        self.watchdog = Watchdog(
            self.transport,
            report=self._report,
            names=self.layout.role_name,
            timeout=self.cfg.timeout,
            setting="timeout={:.0f}",
        )
        self.watchdog.start()

    def _report(self) -> Report:
        return Report(self.doing(), self.slowest_step)

    def unwatch(self) -> None:
        """Stop the watchdog, and listening for the others' stops (collective: every rank, as it leaves)."""
        if self.stops is not None:
            self.stops.close()
            self.stops = None
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None


_WORLD: World | None = None


def init(**settings) -> None:
    """Join the job (collective over every rank); see the module docstring."""
    global _WORLD
    if _WORLD is not None:
        raise RuntimeError("psgrad.init() was called already in this process")
    for name in set(settings) & set(RENAMED):  # renamed so that the name says its unit
        warnings.warn(f"psgrad.init: {name} is now {RENAMED[name]}", FutureWarning, stacklevel=2)
        settings[RENAMED[name]] = settings.pop(name)
    cfg = _your_loop_config(settings)
    transport = Transport()
    on_job_end(**job_end_hooks())  # as train.run: MPI_Abort's leftovers removed, sentinels told after MPI_Finalize
    _refuse_too_few_ranks(cfg, ranks=transport.size)
    layout = prepare(cfg, transport=transport)
    _announce(cfg, transport=transport, layout=layout)  # the settings agree: one rank says them for the job
    _WORLD = World(cfg=cfg, transport=transport, layout=layout)
    _WORLD.watch()
    sys.excepthook = _end_job_on_error(sys.excepthook)  # a server's error too: it raises out of init
    stop_signals_raise_from_now()  # SIGTERM as Ctrl-C: said by every rank, where the default dies without a word
    _WORLD.stops = StopTogether(transport).start()  # after the handlers above: it notes their stops
    _WORLD.workers = transport.split(member=layout.is_worker(transport.rank))  # collective
    if not layout.is_worker(transport.rank):
        _serve(_WORLD)  # does not return
    atexit.register(_shutdown_at_exit)


def _your_loop_config(settings: dict) -> RunConfig:
    """The run settings of ``init``'s keywords, refused with ValueError unless every one of them
    acts in your loop (``your_loop`` in the settings table): the model, data, optimizer, schedule,
    logging and checkpoints are your loop's own, and psgrad would silently ignore them."""
    cfg = your_loop_config(settings, caller="psgrad.init", takes=_takes())
    if cfg.topology not in TOPOLOGIES:
        raise ValueError(
            f"psgrad.init: topology must be one of {', '.join(TOPOLOGIES)} for your own loop, got {cfg.topology}"
        )
    if cfg.mode != "sync":
        raise ValueError("psgrad.init: your optimizer steps on the mean of every worker's gradient: mode must be sync")
    return cfg


def _takes() -> list[str]:
    """The settings ``init`` takes: ``your_loop`` in the settings table."""
    return [name for name, (_, meta) in settings_of(RunConfig).items() if meta.your_loop]


def init_settings(cfg: RunConfig) -> dict:
    """The keywords of ``init`` that give ``cfg``'s exchange: each setting ``init`` takes that
    ``cfg`` sets off its default (``psgrad bench --api optimizer`` trains a row's run so)."""
    defaults = RunConfig()
    return {name: getattr(cfg, name) for name in _takes() if getattr(cfg, name) != getattr(defaults, name)}


def _refuse_too_few_ranks(cfg: RunConfig, *, ranks: int) -> None:
    """A script started without mpiexec (or with too few ranks) under ps: say how to start it, as
    the layout's own message speaks of psgrad's commands (``psgrad simulate``), not of a script."""
    needed = topology_of(cfg.topology).ranks_needed(workers=1, servers=cfg.servers)
    if ranks < needed:
        raise ValueError(
            f"psgrad.init: topology={cfg.topology!r} with {cfg.servers} server(s) needs at least {needed} ranks, "
            f"and this job has {ranks}: start the script with mpiexec -n {needed + 1} python ... ({cfg.servers} "
            "server(s) and 2 workers), or pass topology='colocated', where every rank works and serves"
        )


def _announce(cfg: RunConfig, *, transport: Transport, layout: RankLayout) -> None:
    """Rank 0's start-up lines, as ``psgrad train``'s: which rank plays which role in which
    process (a serving-only rank never returns from ``init``), the exchange's settings, and the
    notes on them (collective: every rank gives its pid)."""
    pids = transport.all_pids()
    if transport.rank != 0:
        return
    say(f"[psgrad] {ranks_line([layout.role_name(r) for r in range(len(pids))], pids)}")
    down = f", down-codec {make_codec(cfg.down_codec).spec}" if cfg.down_codec != "none" else ""
    local = (
        f", an exchange every {cfg.local_steps} steps (outer {cfg.outer_optimizer}, lr {cfg.outer_lr:g}, momentum "
        f"{cfg.outer_momentum:g})" if cfg.local_steps else ""
    )  # fmt: skip
    say(
        f"[psgrad] psgrad.init: {len(pids)} rank{'s' * (len(pids) != 1)} ({len(layout.server_ranks)} serving, "
        f"{layout.num_workers} working), topology {cfg.topology}, codec {make_codec(cfg.codec).spec}, "
        f"feedback {cfg.feedback}{down}{local}"
    )
    accuracy = coded_change_note(cfg) or accuracy_note(cfg, dense="codec='none'", your_loop=True)
    for note in (accuracy, one_worker_note(cfg, layout, ranks=len(pids), colocated="topology='colocated'")):
        if note is not None:
            say(f"[psgrad] {note}")


def _end_job_on_error(previous):
    """An uncaught exception on a worker ends the whole job once it is printed: the servers and
    the other workers would otherwise wait for this worker's gradients for ever. Its line comes
    from each rank, its traceback from the first to fail (every rank's with ``PSGRAD_DEBUG=1``).
    Ctrl-C (or SIGTERM, ``Terminated``) is said in one line, where the script stopped and what
    psgrad was doing, as ``psgrad train`` says it: a traceback into psgrad's waits on every rank
    would bury it (``PSGRAD_DEBUG=1`` shows them); the job ends with the shell's status for the
    signal. Called from another thread (a library reporting its own error), it prints, as Python's
    hook would, and ends nothing."""

    def hook(kind, value, trace) -> None:
        if threading.current_thread() is not threading.main_thread():
            # a library's thread reporting its own error (multiprocessing's resource sharer does)
            report_from_thread(previous, (kind, value, trace), stops=_WORLD and _WORLD.stops)
            return
        if isinstance(value, KeyboardInterrupt):
            reason, status = stop_reason(value)
            line, inside = where_it_stopped(trace)
            doing = (_WORLD.doing_in_psgrad() if inside else "") or _WORLD.doing()
            stops = _WORLD.stops
            passed = f" as rank {stops.passed_from} was," if stops and stops.passed_from is not None else ""
            say(f"[psgrad rank {_WORLD.transport.rank}] {reason}{passed} at {line}, {doing}")
            if os.environ.get("PSGRAD_DEBUG"):
                previous(kind, value, trace)
            if stops is not None:
                stops.stop(getattr(value, "signum", signal.SIGINT))
            ignore_further_stops()  # a second Ctrl-C must not cut the abort short
            _abort(reason, status=status)
            return
        _say(value)
        why = f"{type(value).__name__}: {value}"
        first = _claim(why)  # one traceback a job: the same error on every worker buried itself
        if first is not False or os.environ.get("PSGRAD_DEBUG"):
            previous(kind, value, trace)
        _abort(why, first=first is not False)

    return hook


def _shutdown_at_exit() -> None:
    """``shutdown`` as the script ends: an error there (a worker that stopped while the others
    still send gradients) ends the whole job, where Python would only print it and exit 0."""
    try:
        shutdown()
    except BaseException as err:
        _say(err)
        traceback.print_exc()
        _abort(f"{type(err).__name__}: {err}")


def _say(err: BaseException) -> None:
    """The error in one line, first: another rank's abort may cut this rank's traceback short."""
    where = f" rank {_WORLD.transport.rank}" if _WORLD is not None else ""
    say(f"[psgrad{where}] {type(err).__name__}: {err}")


def _claim(why: str) -> bool | None:
    """Claim the job's abort (``why``): whether this rank claimed first, None where it cannot."""
    if _WORLD is not None and _WORLD.watchdog is not None:
        return _WORLD.watchdog.claim(why)
    return None


def _abort(why: str, *, status: int = 1, first: bool = True) -> None:
    """End every rank of the job with ``status``, once mpiexec had a moment to pass on what this
    rank printed (an abort can drop output not yet forwarded), ``SECOND_ABORT_DELAY`` when another
    rank claimed first (its traceback goes out before this abort can cut it short); the abort is
    claimed (``why``; again is harmless), so that the sentinels of the ranks it takes down do not
    name them as having died."""
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_SECONDS if first else SECOND_ABORT_DELAY)
    _claim(why)
    abort_if_running(status)


def joined() -> bool:
    """Whether this process called ``init``."""
    return _WORLD is not None


def world() -> World:
    """The job this process joined (RuntimeError before ``init``)."""
    if _WORLD is None:
        raise RuntimeError("call psgrad.init(...) first, on every rank")
    return _WORLD


def rank() -> int:
    """This process's MPI rank."""
    return world().transport.rank


def size() -> int:
    """The job's MPI ranks, serving-only ranks included."""
    return world().transport.size


def num_workers() -> int:
    """The ranks that train (every rank under ``colocated``, all but the servers under ``ps``)."""
    return world().layout.num_workers


def worker_index() -> int:
    """This worker's index among the workers, 0..num_workers()-1: shard your data by it."""
    w = world()
    return w.layout.worker_index(w.transport.rank)


def is_worker() -> bool:
    """Whether this rank trains (after ``init``, always true: a serving-only rank never returns)."""
    w = world()
    return w.layout.is_worker(w.transport.rank)


def shutdown(*, leave_mpi: bool = True) -> None:
    """End this worker's part (idempotent; also run at exit): every optimizer tells the servers
    it is done (a worker that built none tells them there is no layer plan to serve), a colocated
    rank serves until every other rank is, then all ranks leave MPI together (``leave_mpi=False``:
    the caller leaves MPI itself, with every other rank)."""
    w = _WORLD
    if w is None or w.done:
        return
    w.done = True
    if not w.optimizers and w.layout.is_worker(w.transport.rank):
        layer_plan(w, None)  # the servers wait for a layer plan: there is none (raises if another worker built one)
    for close in w.closers:
        close()
    w.unwatch()  # the serving-only ranks stop theirs once every worker is done
    if leave_mpi:
        finalize_together()  # the servers' finalize_and_exit holds the same barrier


def layer_plan(w: World, named_shapes: list[tuple[str, tuple[int, ...]]] | None) -> list | None:
    """The layers every rank agrees on, from the first worker's model (collective; a worker whose
    model differs raises). ``named_shapes`` None: this worker ends without a ``DistributedOptimizer``;
    the plan is None when the first worker built none (a worker that did while it did not raises)."""
    root, rank = w.layout.worker_ranks[0], w.transport.rank
    sent = json.dumps(named_shapes).encode() if rank == root else None
    theirs = json.loads(w.transport.broadcast_bytes(sent, root=root))
    if w.layout.is_worker(rank) and (theirs is None) != (named_shapes is None):
        built, not_built = (rank, root) if theirs is None else (root, rank)
        raise RuntimeError(
            f"rank {built} built a DistributedOptimizer and rank {not_built} ended without one: build one on "
            "every worker (or on none), after psgrad.init"
        )
    if theirs is None:
        return None
    theirs = [(name, tuple(shape)) for name, shape in theirs]
    if w.layout.is_worker(rank) and theirs != named_shapes:
        raise RuntimeError(
            f"rank {rank}'s model differs from rank {root}'s (parameter names or shapes): "
            "build the same model on every rank"
        )
    layers = plan_layers(
        theirs,
        granularity=w.cfg.granularity,
        owners=w.layout.server_ranks,
        bucket_vectors=w.cfg.bucket_vectors,
        codec_spec=w.cfg.codec,
    )
    w.transport.check_tag(layer_tag(len(layers)))
    return layers


def context(w: World, *, model: torch.nn.Module | None, layers: list, device: torch.device) -> RunContext:
    """The context psgrad's engines run in, for a loop that is not psgrad's: the servers only
    sum (``sums``), and there is no schedule, evaluation, checkpoint or data of psgrad's."""
    return RunContext(
        cfg=w.cfg,
        transport=w.transport,
        layout=w.layout,
        model=model,
        layers=layers,
        loss_fn=F.cross_entropy,
        label="your loop",
        steps_per_epoch=1,
        total=2**62,
        start=0,
        device=device,
        evaluations=None,
        checkpoints=None,
        sums=True,
    )


def _serve(w: World) -> None:
    """A serving-only rank: the layer plan (none when the workers ended without an optimizer),
    then sum until every worker stopped; then leave."""
    from ..engine.serving import SyncServer

    w.doing = lambda: "waiting for the first worker's DistributedOptimizer (its layer plan)"
    layers = layer_plan(w, [])
    if layers is None:  # the workers ended without training (a script that exits before its loop)
        w.unwatch()
        finalize_and_exit(0)
    server = SyncServer(context(w, model=None, layers=layers, device=torch.device("cpu")))
    w.doing = lambda: f"serving: {server.doing}"
    server.start()
    server.finish()
    w.unwatch()
    finalize_and_exit(0)
