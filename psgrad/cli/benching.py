"""``psgrad bench``: codecs and DDP compared by it/s, bytes and time to accuracy, as one mpiexec
job per row (optionally on shaped links) or inside the job it runs in."""

from __future__ import annotations

from pathlib import Path

import click

from ..options import SectionedCommand, config_from, run_options, set_off_default
from .checks import abort_job, output_option, require_data
from .group import main

JOB_TIMEOUT = 900.0
"""Seconds a bench job may run by default: a throughput row takes a few minutes."""

TARGET_JOB_TIMEOUT = 4 * 3600.0
"""... with --target-accuracy, where one row trains a model to an accuracy (WRN-16-4's 3,072 steps
took 23 min on 10 Mbit/s links here)."""

BENCH_IGNORES = {
    "--tensorboard": "tensorboard",
    "--checkpoint-every-steps": "checkpoint_every_steps",
    "--resume": "resume",
    "--overwrite": "overwrite",
}
"""Run options that mean nothing to ``psgrad bench`` (refused there rather than ignored)."""


def _baseline_list(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    from ..bench.baselines import BASELINES

    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise click.BadParameter(f"unknown baseline(s) {unknown}; choose from {', '.join(BASELINES)}")
    return names


def _bandwidth(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from ..bench.netshape import parse_rate

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
    default="none;qsgd:levels=16 --down-codec qsgd:levels=16;powersgd:rank=8",
    help="Codec specs to compare, separated by ';' (none is the speed-up baseline); a spec may be followed by "
    "train options for its row only, e.g. 'topk:ratio=0.01 --feedback ef --down-codec topk:ratio=0.01' (not "
    "--steps, --epochs, --log-dir, --resume or when to evaluate: those are the bench's, for every row), and "
    "by --api optimizer: the row trained by a plain torch loop with psgrad.DistributedOptimizer (docs/api.md). "
    "The default rows are the combinations at dense accuracy on the accuracy proxy and on a held-out real image set (docs/benchmarks.md).",
)
@click.option(
    "--baselines",
    default="",
    callback=_baseline_list,
    help="Extra rows, comma-separated: compute (the workers train at once, no communication), ddp (torch DDP, gloo), "
    "ddp-powersgd (DDP with the PowerSGD hook). Needs the launcher mode (no mpiexec).",
)
@click.option(
    "--warmup-steps",
    "warmup",
    type=click.IntRange(min=0),
    default=3,
    help="Steps per run excluded from the figures (the run's last step, which completes every exchange in flight, is too).",
)
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
    default=None,
    help="Seconds one job may run before the launcher ends it and fails its row (--timeout is each run's watchdog, "
    "which ends a hung rank sooner) [default: 900, or 4 hours with --target-accuracy: a run to an accuracy "
    "takes as long as it takes].",
)
@click.option(
    "--powersgd-rank", type=click.IntRange(min=1), default=2, help="Rank of the ddp-powersgd baseline's factors."
)
@output_option("--json", "json_path", help="Write the rows as a JSON list here (its folder is made before measuring).")
@output_option(
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
    help="Time to accuracy: every row (and the DDP baselines) evaluates every --eval-every-steps (default: "
    "--steps/20) and the report ranks rows by training seconds to this test accuracy, with steps, bytes and "
    "final accuracy; --steps is then the cap.",
)
def bench(
    *,
    bench_codecs: str,
    baselines: list[str],
    warmup: int,
    repeat: int,
    workers: int,
    bandwidth: str | None,
    mpiexec_path: str | None,
    mpiexec_args: str,
    job_timeout: float | None,
    powersgd_rank: int,
    json_path: str | None,
    plot_path: str | None,
    wide: bool,
    target_accuracy: float | None,
    **options,
) -> None:
    """Compare codecs (and DDP) by it/s, bytes and time breakdown, beside the accuracy psgrad measured of each.

    Run it plainly (`psgrad bench --steps 20 ...`) and it launches one mpiexec job per row and
    round itself, optionally on shaped links (a failed row is skipped from then on and named at the
    end, status 1); under `mpiexec -n 3 psgrad bench ...` every row runs inside that job.

    With --log-dir every row trained by psgrad train keeps its run's logs in
    LOG_DIR/NN-rR-ROW (NN the run, R the round): config.json, metrics.csv (one line per step,
    with the time each part took), eval.csv and row.txt, the row's whole spec; a launched job's
    output is its job.log.
    """
    from ..bench import launcher as bench_module

    cfg = _bench_settings(options, warmup=warmup, target_accuracy=target_accuracy, plot_path=plot_path)
    specs = _bench_rows(bench_codecs, baselines, cfg)
    header = (
        f"psgrad bench: model {cfg.model}, batch {cfg.batch_size}/worker, {cfg.steps} steps after {warmup} warm-up, "
        f"repeat {repeat}, data {cfg.dataset}, "
    )
    report = {"json_path": json_path, "plot_path": plot_path, "target": target_accuracy, "wide": wide}
    if bench_module.launched_by_mpi():
        if baselines or bandwidth:
            abort_job("--baselines and --bandwidth start MPI jobs of their own: run 'psgrad bench' without mpiexec")
        _bench_inside_mpi(cfg, specs, warmup=warmup, repeat=repeat, header=header, report=report)
        return
    _bench_by_launcher(
        cfg,
        specs,
        baselines,
        warmup=warmup,
        repeat=repeat,
        workers=workers,
        launch={
            "mpiexec_path": mpiexec_path,
            "mpiexec_args": mpiexec_args,
            "timeout": job_timeout or (TARGET_JOB_TIMEOUT if target_accuracy else JOB_TIMEOUT),
            "bandwidth": bandwidth,
            "powersgd_rank": powersgd_rank,
        },
        header=header,
        report=report,
    )


def _bench_settings(options: dict, *, warmup: int, target_accuracy: float | None, plot_path: str | None):
    """The bench's run settings: the run options bench uses (the others refused), 20 steps unless
    told, evaluation every 1/20 of the run when timing to an accuracy; its data and plot checked."""
    ignored = [flag for flag, name in BENCH_IGNORES.items() if options.get(name)]
    if ignored:
        raise click.UsageError(
            f"psgrad bench does not use {', '.join(ignored)}: its runs write no checkpoints or TensorBoard files "
            "(--json and --plot keep its results, --log-dir each row's logs)"
        )
    log_dir = options.get("log_dir")
    if log_dir and Path(log_dir).exists() and any(Path(log_dir).iterdir()):
        raise click.BadParameter(
            f"{log_dir} is not empty: give a new folder for the rows' logs", param_hint="--log-dir"
        )
    options["steps"] = options["steps"] or 20
    if target_accuracy and not options["eval_every_steps"]:
        options["eval_every_steps"] = max(1, (options["steps"] + warmup) // 20)
    cfg = config_from(options)
    require_data(cfg)
    if plot_path is not None:
        from ..plot import matplotlib_problem

        if (problem := matplotlib_problem("--plot")) is not None:
            raise click.UsageError(problem)
    return cfg


def _bench_rows(bench_codecs: str, baselines: list[str], cfg) -> list[str]:
    """The codec rows of ``--codecs``, each with its own options checked (as are the baselines')."""
    from ..bench.rows import item_config

    specs = [s.strip() for s in bench_codecs.split(";") if s.strip()]
    if not specs and not baselines:
        raise click.BadParameter(
            "no rows to measure: give at least one codec spec (or --baselines)", param_hint="--codecs"
        )
    for item in specs + baselines:
        try:
            item_config(item, cfg)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--codecs") from None
    if set_off_default("powersgd_rank") and "ddp-powersgd" not in baselines:
        raise click.UsageError("--powersgd-rank is the ddp-powersgd baseline's: add it to --baselines")
    return specs


def _bench_inside_mpi(cfg, specs: list[str], *, warmup: int, repeat: int, header: str, report: dict) -> None:
    """Under ``mpiexec -n N psgrad bench``: every row runs inside this one job; rank 0 reports."""
    from ..bench import launcher as bench_module
    from ..bench import results as bench_results
    from ..comm.transport import Transport

    results = bench_module.run_in_mpi(
        cfg, specs, steps=cfg.steps, warmup=warmup, repeat=repeat, target=report["target"]
    )
    if Transport().rank != 0:
        return
    size = Transport().size
    rows = bench_results.summarize(results, servers=cfg.servers, workers=size - cfg.servers)
    rows = _with_accuracy(rows, cfg, powersgd_rank=0)  # no baselines inside one job
    bench_results.report(rows, header + f"{size} ranks in one job, loopback", **report)


def _with_accuracy(rows: list, cfg, *, powersgd_rank: int) -> list:
    """Each row beside what psgrad measured of its accuracy: a speed alone ranks nothing."""
    from dataclasses import replace

    from ..bench.rows import measured_accuracy

    return [replace(row, **measured_accuracy(row.codec, cfg, powersgd_rank=powersgd_rank)) for row in rows]


def _bench_by_launcher(
    cfg,
    specs: list[str],
    baselines: list[str],
    *,
    warmup: int,
    repeat: int,
    workers: int,
    launch: dict,
    header: str,
    report: dict,
) -> None:
    """Plain ``psgrad bench``: one mpiexec job per row and round, on shaped links if asked."""
    import shlex

    from ..bench import launcher as bench_module
    from ..bench import results as bench_results
    from ..bench.jobs import BenchError, find_mpiexec
    from ..bench.netshape import ShapeError, parse_rate
    from ..bench.rows import item_config

    bandwidth = launch["bandwidth"]
    try:
        measured = bench_module.orchestrate(
            cfg,
            specs + baselines,
            steps=cfg.steps,
            warmup=warmup,
            repeat=repeat,
            workers=workers,
            mpiexec=find_mpiexec(launch["mpiexec_path"]),
            mpiexec_args=shlex.split(launch["mpiexec_args"]),
            timeout=launch["timeout"],
            bandwidth=bandwidth,
            powersgd_rank=launch["powersgd_rank"],
            target=report["target"],
        )
    except (BenchError, ShapeError) as err:
        raise click.ClickException(str(err)) from None
    failed = "".join(f"\n  {item}: {reason}" for item, reason in measured.failed.items())
    if not any(measured.results.values()):
        raise click.ClickException(f"every row failed, no table:{failed}")
    rows = bench_results.summarize(
        measured.results,
        servers=cfg.servers,
        workers=workers,
        bandwidth_bits=parse_rate(bandwidth) if bandwidth else None,
        topologies={item: item_config(item, cfg)[1].topology for item in specs},
    )
    where = f"{bandwidth} per link (shaped)" if bandwidth else "loopback (unshaped)"
    rows = _with_accuracy(rows, cfg, powersgd_rank=launch["powersgd_rank"])
    bench_results.report(
        rows, header + f"{workers} workers (+ {cfg.servers} server rank(s) on ps rows), {where}", **report
    )
    if measured.interrupted is not None:  # after the table of the runs before it: the stop's own status
        raise measured.interrupted
    if failed:  # after the table: the rows it lacks, and a status a script can see
        raise click.ClickException(
            f"{len(measured.failed)} of {len(measured.results)} rows failed, not in the table:{failed}"
        )
