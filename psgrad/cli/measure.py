"""``psgrad codecs`` (each codec's bytes and throughput), ``psgrad plot`` (runs' curves) and
``psgrad compare`` (runs' time to accuracy)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..choices import MODEL_NAMES
from ..options import on_command_line, set_off_default
from .checks import output_option, refuse_wrn_shape
from .group import main


def _codec_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
    from ..bench import codecbench
    from ..codecs import make_codec

    if value is None:
        return codecbench.DEFAULT_SPECS
    specs = tuple(s.strip() for s in value.split(";") if s.strip())
    if not specs:
        raise click.BadParameter("no codec specs: give at least one, e.g. 'qsgd:levels=4;topk:ratio=0.01'")
    for spec in specs:
        try:
            make_codec(spec)
        except ValueError as err:
            raise click.BadParameter(str(err)) from None
    return specs


def _sizes(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    from ..bench import codecbench

    try:
        return tuple(codecbench.parse_size(item) for item in value.split(",") if item.strip())
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


def _list_codecs() -> None:
    """``--list``: every codec's spec with its defaults and what it sends; a usage error when the
    command line gave another option too (--list measures nothing, so it would be ignored)."""
    ctx = click.get_current_context()
    given = [p.opts[0] for p in ctx.command.params if p.name != "list_codecs" and p.name and on_command_line(p.name)]
    if given:
        raise click.UsageError(
            f"--list prints every codec and measures nothing: it takes no other option (got {', '.join(given)})"
        )
    from ..codecs.base import _REGISTRY

    for name, codec in sorted(_REGISTRY.items()):
        values = {k: int(v) if isinstance(v, bool) else v for k, v in codec.defaults.items()}
        spec = name + (":" + ",".join(f"{k}={v}" for k, v in values.items()) if values else "")
        what = " ".join((codec.__doc__ or "").split("\n\n")[0].split()).replace("``", "")
        click.echo(f"{spec:<44} {what.split('. ')[0].rstrip('.')}")


@main.command()
@click.option(
    "--list",
    "list_codecs",
    is_flag=True,
    help="Print every codec's spec with its default parameters and what it sends, then exit (no measurement, so no other option).",
)
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
@click.option(
    "--depth", type=click.IntRange(min=10), default=16, help="With --model wrn: WideResNet depth (train's default)."
)
@click.option(
    "--widen-factor",
    type=click.IntRange(min=1),
    default=4,
    help="With --model wrn: width multiplier (train's default).",
)
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
@output_option(
    "--json",
    "json_path",
    allow_dash=True,
    help="Also write the rows (and the machine) as JSON here, as bench's --json does; '-' prints them instead of tables (a file's folder is made before measuring).",
)
def codecs(
    *,
    list_codecs: bool,
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
    bytes, with cold caches: at several gradient sizes, or over the layers of a model; beside each
    codec, the best accuracy psgrad measured with it."""
    if list_codecs:
        return _list_codecs()
    import torch

    from ..bench import codecbench
    from ..codecs import available_codecs, kernels_name
    from ..models import build_model
    from ..runtime.allocator import keep_freed_memory

    refuse_wrn_shape(model, depth)
    if model is not None and set_off_default("sizes"):
        raise click.UsageError("--sizes and --model are two ways to say what to code: give one")
    if model is None and set_off_default("classes"):
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
    click.echo(codecbench.ACCURACY_LEGEND)
    click.echo(f"available codecs: {', '.join(available_codecs())}")


@main.command()
@click.argument("log_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@output_option(
    "-o",
    "--output",
    default="psgrad.png",
    help="Image to write, in the format its suffix names (png, pdf, svg, ...); its folder is made if missing.",
)
def plot(log_dirs: tuple[str, ...], output: str) -> None:
    """Loss and test accuracy of runs (their --log-dir) against step, wall time and bytes sent.

    A folder without a metrics.csv stands for the runs in it: `psgrad plot runs/bench` draws
    every row of a `psgrad bench --log-dir runs/bench` that trained, each labelled by its row,
    and names the rows that logged no steps."""
    from ..plot import image_format_problem, matplotlib_problem, plot_runs
    from ..runlogs import MetricsFileError, rows_not_drawn

    if (problem := matplotlib_problem("psgrad plot")) is not None:
        raise click.ClickException(problem)
    if (problem := image_format_problem(Path(output))) is not None:
        raise click.UsageError(problem)
    try:
        path = plot_runs([Path(d) for d in log_dirs], Path(output))
    except (FileNotFoundError, MetricsFileError) as err:
        raise click.UsageError(str(err)) from None
    click.echo(f"wrote {path}")
    if skipped := rows_not_drawn([Path(d) for d in log_dirs]):
        click.echo(
            f"not drawn, no steps logged (DDP, compute-only and --api optimizer rows): {', '.join(skipped)}", err=True
        )


@main.command()
@click.argument("log_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--target-accuracy",
    type=click.FloatRange(0, 1, min_open=True),
    default=None,
    help="Test accuracy the runs race to [default: the highest one every evaluated run reached].",
)
@output_option(
    "--json",
    "json_path",
    allow_dash=True,
    help="Also write the runs' figures and the target as JSON here; '-' prints them instead of the table.",
)
def compare(log_dirs: tuple[str, ...], target_accuracy: float | None, json_path: str | None) -> None:
    """Runs (their --log-dir) side by side, ranked by their time to one test accuracy.

    Each row: the steps logged, the wall time of training, MB sent a step, the last and best test
    accuracy, and the steps, seconds and MB to the target, the seconds also as a multiple of the
    fastest run's (evaluation pauses left out). A folder without a metrics.csv stands for the runs
    in it, as in psgrad plot. When the default target lies 2 points or more below another run's
    best accuracy, a note names both runs: a run that stops learning early can rank first there."""
    from ..runlogs import MetricsFileError, rows_not_drawn, run_dirs
    from ..runtable import common_target, figures, low_target_note, ranked, table

    try:
        runs = [figures(d) for d in run_dirs([Path(d) for d in log_dirs])]
    except (FileNotFoundError, MetricsFileError) as err:
        raise click.UsageError(str(err)) from None
    target = target_accuracy if target_accuracy is not None else common_target(runs)
    records = ranked(runs, target)
    if json_path is not None:
        # NaN (not reached, never evaluated) as null: strict JSON readers refuse NaN
        plain = [{k: None if isinstance(v, float) and v != v else v for k, v in r.items()} for r in records]
        text = json.dumps({"target_accuracy": target, "runs": plain}, indent=1)
        if json_path == "-":
            click.echo(text)
            return
        Path(json_path).write_text(text + "\n")
    click.echo(_target_line(target, chosen=target_accuracy is not None))
    click.echo(table(records, target))
    click.echo(
        "seconds: wall time of training; to target: at the first evaluation that reached it (evaluate more often "
        "for a finer time: --eval-every-steps), evaluation pauses left out; MB: sent up and down, every worker"
        + (
            "; steps missing: its metrics.csv lacks steps before the target"
            if any(r["rows_missing"] for r in records)
            else ""
        )
    )
    if target_accuracy is None and (note := low_target_note(records, target)):
        click.echo(note)
    if len(data := {r["data"] for r in records if r["data"] != "?"}) > 1:
        click.echo(
            f"note: the runs were scored on different data ({', '.join(sorted(data))}): their accuracies do not compare"
        )
    if skipped := rows_not_drawn([Path(d) for d in log_dirs]):
        click.echo(
            f"not compared, no steps logged (DDP, compute-only and --api optimizer rows): {', '.join(skipped)}",
            err=True,
        )


def _target_line(target: float | None, *, chosen: bool) -> str:
    if target is None:
        return "no run was evaluated (eval.csv): no time to accuracy"
    if chosen:
        return f"target: test accuracy {target:.3f}"
    return (
        f"target: test accuracy {target:.3f}, the highest every evaluated run reached (--target-accuracy sets another)"
    )
