"""The ``psgrad`` command line: a thin layer over the Python API.

Importing it does not import torch (each command imports what it runs), so ``--help`` and usage
errors are quick."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import click

from .choices import MODEL_NAMES, option_flag
from .options import (
    SectionedCommand,
    config_from,
    config_option,
    run_options,
    run_settings,
    set_off_default,
)
from .runtime.chain import stop_behind

TRAINING_COMMANDS = frozenset({"train", "server", "worker"})
BENCH_IGNORES = {
    "--log-dir": "log_dir",
    "--tensorboard": "tensorboard",
    "--checkpoint-every": "checkpoint_every",
    "--resume": "resume",
    "--overwrite": "overwrite",
}
"""Run options that mean nothing to ``psgrad bench`` (refused there rather than ignored)."""


def _leave_the_job(err: KeyboardInterrupt) -> None:
    """A rank of a multi-rank launch stopped by a signal outside ``train.run`` (which aborts the job
    itself), while it starts or ends: end the job without leaving the other ranks waiting for it.

    1. Say so, once.
    2. MPI runs: abort the job.
    3. Otherwise die by the signal itself. A normal exit would not do: a signal during mpi4py's
       import can leave MPI started with its module unlisted, and the interpreter's teardown then
       finalizes MPI, telling the process manager this rank is done while the others wait for it
       in start-up's agreement; and a rank that exits with a status before MPI starts leaves the
       others waiting in MPI's start-up. Both hung the job. A rank killed by a signal is one the
       process manager ends the job for."""
    from .runtime.signals import Terminated, rank_said, stop_reason

    reason, status = stop_reason(err)
    print(rank_said(f"{reason} while starting or ending"), file=sys.stderr, flush=True)
    _end_the_job(status, err.signum if isinstance(err, Terminated) else signal.SIGINT)


def _end_the_job(status: int, signum: int) -> None:
    """End this rank's job: abort it with ``status`` if MPI runs, else die by ``signum`` (the
    process manager then ends the job; see ``_leave_the_job``)."""
    from .runtime.signals import die_by_signal

    sys.stderr.flush()
    sys.stdout.flush()
    if "mpi4py.MPI" in sys.modules:
        from .comm.transport import abort_if_running, on_job_end
        from .runtime import job_end_hooks

        on_job_end(**job_end_hooks())
        abort_if_running(status)
    die_by_signal(signum)
    os._exit(status)  # not reached: the signal's default action ends the process


def _fail_the_job(err: Exception) -> None:
    """A rank of a multi-rank launch failed outside ``train.run`` (which aborts the job itself):
    print the error as Python would, then end the job, as ``_leave_the_job`` does for a signal.
    A rank that exited with status 1 before MPI started left the others spinning in MPI's
    start-up for ever, at a full core each: MPI's C code never returns to let a Ctrl-C or SIGTERM
    handler of Python's run. So: MPI runs, abort the job with status 1; otherwise die by SIGTERM,
    which the process manager ends the job for."""
    from .runtime.signals import rank_said

    if isinstance(err, click.ClickException):  # click's own error: its one line, as click prints it
        err.show()
    else:
        traceback.print_exception(err)
    print(rank_said(f"failed while starting or ending: {type(err).__name__}: {err}"), file=sys.stderr)
    _end_the_job(1, signal.SIGTERM)


class _Commands(click.Group):
    """Under a multi-rank launch, a training command's usage error is printed once for the job
    (by the lowest rank that has it, after every rank agreed; psgrad/startup.py), and every rank
    exits with status 2 — not once per rank, interleaved."""

    def invoke(self, ctx: click.Context):
        from .runtime.signals import launched_ranks, stop_reason, stop_signals_end_the_rank, stop_signals_raise
        from .startup import AgreementError

        try:
            if launched_ranks() > 1:
                # psgrad.entry had Ctrl-C end the rank by the signal until here; from here it is
                # raised, and _leave_the_job below ends the job
                if threading.current_thread() is threading.main_thread():
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                from .runtime.sentinel import start_early

                start_early()  # before torch and MPI: a rank that dies while MPI starts is seen to
            # SIGTERM as Ctrl-C for the whole command, but not in a rank of a multi-rank launch
            # before MPI runs: a rank leaving then without dying by the signal hung the job (a
            # training rank turns it on around train.run, _train)
            with stop_signals_raise() if launched_ranks() < 2 else stop_signals_end_the_rank():
                return super().invoke(ctx)
        except KeyboardInterrupt as err:  # the command said where it stopped; click would add "Aborted!", status 1
            if launched_ranks() > 1:
                _leave_the_job(err)
            ctx.exit(stop_reason(err)[1])
        except click.UsageError as err:
            if ctx.invoked_subcommand not in TRAINING_COMMANDS or launched_ranks() < 2:
                raise
            from .comm.transport import Transport
            from .startup import agree

            try:
                agree(Transport(), None, err.format_message())
            except AgreementError:
                ctx.exit(2)
        except AgreementError:
            ctx.exit(2)
        except (click.exceptions.Exit, click.Abort):
            raise
        except Exception as err:
            if launched_ranks() < 2:
                raise
            # a Ctrl-C that a library reported as its own error (one inside torch's import is a
            # RuntimeError) is the stop it is; any other error must end the job too
            stop = stop_behind(err)
            if stop is not None:
                _leave_the_job(stop)
            _fail_the_job(err)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command's whole first paragraph, wrapped, not cut at 45 characters."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, " ".join((command.help or "").split("\n\n")[0].split())))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


EXIT_STATUS = (
    "Exit status: 0 when the command did its work; 1 when it failed (the failing rank printed its error); 2 for a "
    "usage error (an option set to a value of its own where the run would not use it is one: --depth with --model "
    "mlp, --staleness without --mode async), settings the ranks do not agree on or unreadable data (said once, "
    "before the first step); 130 "
    "after Ctrl-C and 143 after SIGTERM (each rank said what it was doing, rank 0 which checkpoint resumes the run). "
    "A rank killed outright (SIGKILL, a crash), or one that failed before MPI started (it prints its error, then ends "
    "itself by SIGTERM so that the job ends), ends mpiexec with a status of its own."
)


@click.group(
    cls=_Commands, epilog=EXIT_STATUS, context_settings={"help_option_names": ["-h", "--help"], "show_default": True}
)
@click.version_option(package_name="psgrad")
def main() -> None:
    """psgrad: data-parallel training through a parameter server whose every gradient is encoded."""


def _output_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An output file's folder is made (or refused) now: a measurement of minutes must not end
    unable to write its result. '-' (standard output) passes."""
    if value is None or value == "-":
        return value
    from .config import folder_problem

    folder = Path(value).parent
    problem = folder_problem(folder)
    if problem is not None:
        raise click.BadParameter(f"{value}: its folder {folder} {problem}")
    return value


def _output_option(*decls: str, allow_dash: bool = False, default: str | None = None, help: str):
    """A file option whose folder ``_output_file`` makes (or refuses) when the command starts."""
    return click.option(
        *decls,
        type=click.Path(dir_okay=False, allow_dash=allow_dash),
        default=default,
        callback=_output_file,
        help=help,
    )


def _codec_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
    from .bench import codecbench
    from .codecs import make_codec

    if value is None:
        return codecbench.DEFAULT_SPECS
    specs = tuple(s.strip() for s in value.split(";") if s.strip())
    for spec in specs:
        try:
            make_codec(spec)
        except ValueError as err:
            raise click.BadParameter(str(err)) from None
    return specs


def _sizes(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    from .bench import codecbench

    try:
        return tuple(codecbench.parse_size(item) for item in value.split(",") if item.strip())
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


@main.command()
@click.option(
    "--sizes",
    default="256K,4M,16M",
    callback=_sizes,
    help="Gradient sizes in fp32 elements, comma-separated (K and M are 2^10 and 2^20; at most 2048M, the most one message may carry); one table each.",
)
@click.option(
    "--model",
    type=click.Choice(MODEL_NAMES),
    default=None,
    help="Instead of --sizes: code the gradient of this model's every layer, one message a layer (one table).",
)
@click.option("--depth", type=click.IntRange(min=10), default=28, help="With --model wrn: WideResNet depth.")
@click.option("--widen-factor", type=click.IntRange(min=1), default=10, help="With --model wrn: width multiplier.")
@click.option("--classes", type=click.Choice(["10", "100"]), default="100", help="With --model: output classes.")
@click.option("--repeat", type=click.IntRange(min=1), default=5, help="Timed runs per codec; the median is reported.")
@click.option(
    "--codecs",
    "specs",
    default=None,
    callback=_codec_list,
    help="Codec specs separated by ';' (e.g. 'qsgd:levels=4;topk:ratio=0.01'); default: a representative set.",
)
@click.option("--threads", type=click.IntRange(min=1), default=1, help="torch threads (1 = what one MPI rank uses).")
@_output_option(
    "--json",
    "json_path",
    allow_dash=True,
    help="Also write the rows (and the machine) as JSON here, as bench's --json does; '-' prints them instead of tables (a file's folder is made before measuring).",
)
def codecs(
    sizes: tuple[int, ...],
    model: str | None,
    depth: int,
    widen_factor: int,
    classes: str,
    repeat: int,
    specs: tuple[str, ...],
    threads: int,
    json_path: str | None,
) -> None:
    """Bytes on the wire and encode/decode throughput of every codec, against a memcpy of the same
    bytes, with cold caches: at several gradient sizes, or over the layers of a model."""
    import torch

    from .bench import codecbench
    from .choices import wrn_depth_problem
    from .codecs import available_codecs, kernels_name
    from .models import build_model
    from .runtime.allocator import keep_freed_memory

    if model == "wrn" and (problem := wrn_depth_problem(depth)) is not None:
        raise click.BadParameter(problem, param_hint="--depth")
    given = [name for name in ("sizes", "depth", "widen_factor", "classes") if set_off_default(name)]
    if model is not None and "sizes" in given:
        raise click.UsageError("--sizes and --model are two ways to say what to code: give one")
    for name in given:
        flag = option_flag(name)
        if name in ("depth", "widen_factor") and model != "wrn":
            raise click.UsageError(
                f"{flag} shapes a WideResNet: it means nothing {f'to --model {model}' if model else 'without --model wrn'}"
            )
        if name == "classes" and model is None:
            raise click.UsageError("--classes sizes the output layer of --model: it means nothing without one")
    torch.set_num_threads(threads)
    keep_freed_memory()
    if model is not None:
        net = build_model(model, int(classes), depth=depth, widen_factor=widen_factor)
        shapes = [tuple(p.shape) for p in net.parameters()]
        click.echo(f"{model}: {len(shapes)} layers, {sum(p.numel() for p in net.parameters()):,} parameters", err=True)
        rows = codecbench.run_model(specs, shapes, repeat=repeat)
    else:
        rows = codecbench.run(specs, sizes=sizes, repeat=repeat)
    if json_path is not None:
        text = json.dumps({"machine": codecbench.machine(), "rows": codecbench.as_dicts(rows)}, indent=1)
        if json_path == "-":
            click.echo(text)
            return
        Path(json_path).write_text(text + "\n")
    click.echo(
        f"median of {repeat}, {threads} thread(s), caches cold before every call, "
        f"{kernels_name()} kernels (PSGRAD_KERNELS, docs/codecs.md)"
    )
    click.echo(codecbench.table(rows))
    click.echo(f"available codecs: {', '.join(available_codecs())}")


def _train(role: str | None, options: dict) -> None:
    from .comm.transport import finalize, world_rank, world_size
    from .roles import topology_of
    from .runtime.allocator import keep_freed_memory
    from .runtime.sentinel import goodbyes_held, hold_goodbyes
    from .runtime.signals import stop_signals_raise
    from .train import run

    cfg = run_settings(options)
    _require_data(cfg)
    _require_resumable(cfg, world_size(), lambda ranks: f"start mpiexec -n {ranks}")
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


def _require_resumable(cfg, ranks: int, fix: Callable[[int], str]) -> None:
    """With --resume: a missing or incomplete checkpoint, or one written by another number of
    ranks, is a usage error said once, before any rank builds a model (``fix(ranks written)`` says
    how to start the job instead)."""
    from . import checkpoint

    if not cfg.resume:
        return
    try:
        written = checkpoint.written_ranks(cfg.resume)
    except checkpoint.CheckpointError as err:
        raise click.UsageError(str(err)) from None
    if written != ranks:
        raise click.UsageError(
            f"--resume {cfg.resume}: its checkpoint was written by {written} ranks, this job has {ranks}: {fix(written)}"
        )


def _require_data(cfg) -> None:
    """A missing CIFAR folder or archive is a usage error, said once, before any rank builds a model."""
    from .data import missing_data

    problem = missing_data(cfg.dataset, cfg.data_dir)
    if problem is not None:
        raise click.UsageError(problem)


def _abort_job(message: str) -> None:
    """A usage error on one rank must end every rank, or the others would wait for it forever."""
    from .comm.transport import Transport, on_job_end
    from .runtime import job_end_hooks

    click.echo(f"Error: {message}", err=True)
    on_job_end(**job_end_hooks())
    Transport().abort(2)


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


@main.command(cls=SectionedCommand)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=4,
    help="Workers to simulate; the ps topology adds its --servers ranks, the others run one rank per worker.",
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
    from .runtime.allocator import keep_freed_memory
    from .runtime.signals import launched_ranks
    from .sim.simulate import simulate as run_simulation
    from .sim.simulate import world_size
    from .startup import AgreementError

    if launched_ranks() > 1:
        raise click.UsageError("psgrad simulate runs every rank in this one process: start it without mpiexec")
    cfg = run_settings(options)
    _require_data(cfg)
    try:
        size = world_size(cfg, workers)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    servers = size - workers
    _require_resumable(cfg, size, lambda ranks: f"simulate --workers {ranks - servers}")
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
    except AgreementError:  # a usage error, printed once: exit 2 as under mpiexec
        raise
    except Exception:  # the failing rank printed its error and traceback (train.run)
        sys.exit(1)


@main.command()
@click.argument("log_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@_output_option("-o", "--output", default="psgrad.png", help="PNG file to write (its folder is made if missing).")
def plot(log_dirs: tuple[str, ...], output: str) -> None:
    """Loss and test accuracy of runs (their --log-dir) against step, wall time and bytes sent."""
    from .plot import MetricsFileError, matplotlib_problem, plot_runs

    if (problem := matplotlib_problem("psgrad plot")) is not None:
        raise click.ClickException(problem)
    try:
        path = plot_runs([Path(d) for d in log_dirs], Path(output))
    except (FileNotFoundError, MetricsFileError) as err:
        raise click.UsageError(str(err)) from None
    click.echo(f"wrote {path}")


def _baseline_list(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    from .bench.baselines import BASELINES

    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise click.BadParameter(f"unknown baseline(s) {unknown}; choose from {', '.join(BASELINES)}")
    return names


def _bandwidth(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from .bench.netshape import parse_rate

    if value is not None:
        try:
            parse_rate(value)
        except ValueError as err:
            raise click.BadParameter(str(err)) from None
    return value


@main.command(cls=SectionedCommand)
@run_options
@click.option(
    "--codecs",
    "bench_codecs",
    default="none;qsgd:levels=16 --down-codec qsgd:levels=16;sign:bucket=32 --feedback ef --down-codec qsgd:levels=16;"
    "powersgd:rank=8",
    help="Codec specs to compare, separated by ';' (none is the speed-up baseline); a spec may be followed by "
    "train options for its row only, e.g. 'topk:ratio=0.01 --feedback ef --down-codec topk:ratio=0.01'. "
    "The default rows are the combinations nearest dense accuracy on the accuracy proxy (docs/benchmarks.md).",
)
@click.option(
    "--baselines",
    default="",
    callback=_baseline_list,
    help="Extra rows, comma-separated: compute (the workers train at once, no communication), ddp (torch DDP, gloo), "
    "ddp-powersgd (DDP with the PowerSGD hook). Needs the launcher mode (no mpiexec).",
)
@click.option("--warmup", type=click.IntRange(min=0), default=3, help="Steps per run excluded from the figures.")
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    help="Rounds of all codecs, interleaved; the median is reported, speed-ups are per-round ratios (median).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=2,
    help="Worker ranks per run (launcher mode; each codec run also gets --servers server ranks).",
)
@click.option(
    "--bandwidth",
    default=None,
    callback=_bandwidth,
    help="Shape every rank's link to this rate (tc units, e.g. 100mbit, 1gbit) in network namespaces; needs root "
    "and MPICH (launcher mode).",
)
@click.option(
    "--mpiexec",
    "mpiexec_path",
    default=None,
    help="mpiexec the launcher starts its jobs with [default: the one beside this Python, else PATH].",
)
@click.option(
    "--mpiexec-args",
    default="",
    help="Extra mpiexec arguments for every job, e.g. '-f hosts -ppn 1' (MPICH). As root under Open MPI, "
    "'--allow-run-as-root --oversubscribe' are added unless given.",
)
@click.option(
    "--job-timeout",
    "job_timeout",
    type=click.FloatRange(min=1),
    default=900.0,
    help="Seconds one job may run before the launcher ends it and fails (--timeout is each run's watchdog).",
)
@click.option(
    "--powersgd-rank", type=click.IntRange(min=1), default=2, help="Rank of the ddp-powersgd baseline's factors."
)
@_output_option("--json", "json_path", help="Write the rows as a JSON list here (its folder is made before measuring).")
@_output_option(
    "--plot",
    "plot_path",
    help="Write a bar chart of it/s here (PNG; its folder is made before measuring; needs matplotlib, psgrad's plot extra).",
)
@click.option(
    "--wide", is_flag=True, help="Also print overlap, server CPU, the ideal rate and the time breakdown per step."
)
@click.option(
    "--target-accuracy",
    type=click.FloatRange(0, 1, min_open=True),
    default=None,
    help="Time to accuracy: every row (and the DDP baselines) evaluates every --eval-steps steps (default: "
    "--steps/20) and the report ranks rows by training seconds to this test accuracy, with steps, bytes and "
    "final accuracy; --steps is then the cap.",
)
def bench(
    bench_codecs: str,
    baselines: list[str],
    warmup: int,
    repeat: int,
    workers: int,
    bandwidth: str | None,
    mpiexec_path: str | None,
    mpiexec_args: str,
    job_timeout: float,
    powersgd_rank: int,
    json_path: str | None,
    plot_path: str | None,
    wide: bool,
    target_accuracy: float | None,
    **options,
) -> None:
    """Compare codecs (and DDP) by it/s, bytes and time breakdown.

    Run it plainly (`psgrad bench --steps 20 ...`) and it launches one mpiexec job per codec and
    baseline itself, optionally on shaped links; under `mpiexec -n 3 psgrad bench ...` it runs the
    codecs inside that job.
    """
    import shlex

    from .bench import launcher as bench_module
    from .bench.netshape import ShapeError, parse_rate

    ignored = [flag for flag, name in BENCH_IGNORES.items() if options.get(name)]
    if ignored:
        raise click.UsageError(
            f"psgrad bench does not use {', '.join(ignored)}: its runs write no logs or checkpoints "
            "(--json and --plot keep its results)"
        )
    options["steps"] = options["steps"] or 20
    if target_accuracy and not options["eval_steps"]:
        options["eval_steps"] = max(1, (options["steps"] + warmup) // 20)
    cfg = config_from(options)
    _require_data(cfg)
    if plot_path is not None:
        from .plot import matplotlib_problem

        if (problem := matplotlib_problem("--plot")) is not None:
            raise click.UsageError(problem)
    specs = [s.strip() for s in bench_codecs.split(";") if s.strip()]
    if not specs and not baselines:
        raise click.BadParameter(
            "no rows to measure: give at least one codec spec (or --baselines)", param_hint="--codecs"
        )
    for item in specs + baselines:
        try:
            bench_module.item_config(item, cfg)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--codecs") from None
    if set_off_default("powersgd_rank") and "ddp-powersgd" not in baselines:
        raise click.UsageError("--powersgd-rank is the ddp-powersgd baseline's: add it to --baselines")
    header = (
        f"psgrad bench: model {cfg.model}, batch {cfg.batch_size}/worker, {cfg.steps} steps after {warmup} warm-up, "
        f"repeat {repeat}, data {cfg.dataset}, "
    )
    if bench_module.launched_by_mpi():
        if baselines or bandwidth:
            _abort_job("--baselines and --bandwidth start MPI jobs of their own: run 'psgrad bench' without mpiexec")
        from .comm.transport import Transport

        results = bench_module.run_in_mpi(cfg, specs, cfg.steps, warmup, repeat, target_accuracy)
        if Transport().rank != 0:
            return
        size = Transport().size
        rows = bench_module.summarize(results, cfg.servers, size - cfg.servers)
        bench_module.report(
            rows, header + f"{size} ranks in one job, loopback", json_path, plot_path, target=target_accuracy, wide=wide
        )
        return
    try:
        mpiexec = bench_module.find_mpiexec(mpiexec_path)
        results = bench_module.orchestrate(
            cfg,
            specs + baselines,
            cfg.steps,
            warmup,
            repeat,
            workers,
            mpiexec,
            shlex.split(mpiexec_args),
            job_timeout,
            bandwidth,
            powersgd_rank,
            target_accuracy,
        )
    except (bench_module.BenchError, ShapeError) as err:
        raise click.ClickException(str(err)) from None
    topologies = {item: bench_module.item_config(item, cfg)[1].topology for item in specs}
    rate = parse_rate(bandwidth) if bandwidth else None
    rows = bench_module.summarize(results, cfg.servers, workers, rate, topologies)
    where = f"{bandwidth} per link (shaped)" if bandwidth else "loopback (unshaped)"
    bench_module.report(
        rows,
        header + f"{workers} workers (+ {cfg.servers} server rank(s) on ps rows), {where}",
        json_path,
        plot_path,
        target=target_accuracy,
        wide=wide,
    )
