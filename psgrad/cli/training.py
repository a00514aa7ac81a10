"""The training commands: ``train`` (every rank of an MPI job), ``server`` and ``worker`` (the two
parts of an MPMD launch), and ``simulate`` (every rank in this one process)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ..options import SectionedCommand, config_option, on_command_line, run_options, run_settings
from .checks import require_data, require_resumable
from .group import main


def _train(role: str | None, options: dict) -> None:
    from ..comm.transport import finalize, world_rank, world_size
    from ..roles import topology_of
    from ..runtime.allocator import keep_freed_memory
    from ..runtime.sentinel import goodbyes_held, hold_goodbyes
    from ..runtime.signals import stop_signals_raise
    from ..train import run

    cfg = run_settings(options)
    require_data(cfg)
    require_resumable(cfg, world_size(), lambda ranks: f"start mpiexec -n {ranks}")
    try:
        layout = topology_of(cfg.topology).rank_layout(world=world_size(), servers=cfg.servers)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    places = topology_of(cfg.topology).grid_places(cfg)
    if places is not None and places != world_size():
        raise click.UsageError(
            f"--grid {cfg.grid} has {places} places for {world_size()} ranks: start mpiexec -n {places}"
        )
    if role is not None:
        if layout.kind != "separate":
            raise click.UsageError(
                f"'psgrad {role}' is for MPMD launches of --topology ps; with {cfg.topology} run 'psgrad train' on every rank"
            )
        is_server = layout.is_server(world_rank())
        if is_server != (role == "server"):
            actual = "server" if is_server else "worker"
            raise click.UsageError(
                f"'psgrad {role}' started on rank {world_rank()}, which is a {actual} rank with --servers {cfg.servers} (servers are ranks 0..{cfg.servers - 1})"
            )
    keep_freed_memory()  # the command's choice for its process; train.run as a library leaves malloc alone
    hold_goodbyes()  # this process ends with the job: a rank dying in MPI_Finalize is named too
    with stop_signals_raise():  # from here on, with MPI started: a SIGTERM is said and aborts the job
        run(cfg)
    if goodbyes_held():  # a sentinel waits (a job of more than one rank): MPI_Finalize, then goodbye
        finalize()


@main.command(cls=SectionedCommand)
@run_options
@config_option
def train(**options) -> None:
    """Train under MPI; every rank runs this: `mpiexec -n 3 psgrad train ...` (rank 0 serves, 1-2 work)."""
    _train(None, options)


@main.command(cls=SectionedCommand)
@run_options
@config_option
def server(**options) -> None:
    """The server part of an MPMD launch: `mpiexec -n 1 psgrad server ... : -n 2 psgrad worker ...`."""
    _train("server", options)


@main.command(cls=SectionedCommand)
@run_options
@config_option
def worker(**options) -> None:
    """The worker part of an MPMD launch (same options as the server part)."""
    _train("worker", options)


def _recorded_workers(cfg, *, config_path: str | None) -> int | None:
    """The workers of the run that ``--resume`` continues (the ranks that wrote its checkpoint) or
    ``--config`` reruns (its config.json's job size), less the servers; None when neither says."""
    import json

    from .. import checkpoint
    from ..roles import topology_of

    ranks = None
    if cfg.resume:
        try:
            ranks = checkpoint.written_ranks(cfg.resume)
        except checkpoint.CheckpointError:
            return None  # require_resumable says what is wrong with it
    elif config_path is not None:
        path = Path(config_path)
        path = path / "config.json" if path.is_dir() else path
        run = json.loads(path.read_text()).get("run")  # run_settings has read it: JSON of an object
        ranks = run.get("world_size") if isinstance(run, dict) else None
    if not isinstance(ranks, int):
        return None
    try:
        return topology_of(cfg.topology).rank_layout(world=ranks, servers=cfg.servers).num_workers
    except ValueError:
        return None  # a job size this topology cannot take: world_size() below says why


@main.command(cls=SectionedCommand)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=4,
    help="Workers to simulate; the ps topology adds its --servers ranks, the others run one rank per worker "
    "[default: 4; with --resume or --config, as many as that run had].",
)
@click.option(
    "--cores",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks that compute at the same time (each with --threads torch threads) [default: the cores this process may use].",
)
@click.option(
    "--stack/--no-stack",
    default=True,
    show_default=True,
    help="Compute the workers' forwards and backwards as passes of stacked models (grouped "
    "convolutions, batched matrix products), one group of workers per core (--cores), the groups side "
    "by side, not one small pass per worker: the same gradients, rounded differently (--no-stack "
    "reproduces an MPI run bit for bit). Models with layers it cannot stack fall back to one pass per "
    "worker, with a note.",
)
@run_options
@config_option
def simulate(workers: int, cores: int | None, stack: bool, **options) -> None:
    """Train N workers (and their servers) as threads of this one process, no MPI launch: `psgrad simulate --workers 16 ...`."""
    from ..agreement import AgreementError
    from ..runtime.allocator import keep_freed_memory
    from ..runtime.signals import launched_ranks
    from ..sim.simulate import simulate as run_simulation
    from ..sim.simulate import world_size

    if launched_ranks() > 1:
        raise click.UsageError("psgrad simulate runs every rank in this one process: start it without mpiexec")
    config_path = options.get("config_path")
    cfg = run_settings(options)
    require_data(cfg)
    if not on_command_line("workers"):
        workers = _recorded_workers(cfg, config_path=config_path) or workers
    try:
        size = world_size(cfg, workers)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    servers = size - workers
    require_resumable(cfg, size, lambda ranks: f"simulate --workers {ranks - servers}")
    usable = len(os.sched_getaffinity(0))
    if cores is not None and cores > usable:
        click.echo(
            f"[psgrad] note: --cores {cores} is more than the {usable} this process may use: the ranks that "
            "compute at once will share them, each more slowly",
            err=True,
        )
    keep_freed_memory()  # the command's choice for its process; simulate() as a library leaves malloc alone
    try:
        run_simulation(cfg, workers, cores=cores, stack=stack)
    except AgreementError:  # said once; its status (2 for a usage error) as under mpiexec (runtime/job.py)
        raise
    except Exception as err:  # the failing rank printed its error and traceback (train.run)
        from ..runtime.failure import exit_status

        sys.exit(exit_status(err))
