"""What the commands check before they start work: output folders, data, resumable checkpoints;
and how one rank's usage error ends every rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click


def output_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An output file's folder is made (or refused) now: a measurement of minutes must not end
    unable to write its result. '-' (standard output) passes."""
    if value is None or value == "-":
        return value
    from ..checkpoint import folder_problem

    folder = Path(value).parent
    problem = folder_problem(folder)
    if problem is not None:
        raise click.BadParameter(f"{value}: its folder {folder} {problem}")
    # the file itself: a read-only file, or a folder that takes no new file whatever its mode
    # says (root passes every mode check), is refused now, not at the end
    existed = Path(value).exists()
    try:
        with open(value, "ab"):
            pass
    except OSError as err:
        raise click.BadParameter(f"{value}: cannot be written: {err.strerror or err}") from None
    if not existed:
        Path(value).unlink(missing_ok=True)
    return value


def output_option(*decls: str, allow_dash: bool = False, default: str | None = None, help: str):
    """A file option whose folder ``output_file`` makes (or refuses) when the command starts."""
    return click.option(
        *decls,
        type=click.Path(dir_okay=False, allow_dash=allow_dash),
        default=default,
        callback=output_file,
        help=help,
    )


def refuse_wrn_shape(model: str | None, depth: int) -> None:
    """--depth and --widen-factor of a command that builds one of psgrad's models by name
    (``psgrad codecs``, ``psgrad plan``): a WideResNet's depth is 6n+4, and a depth or width set
    for another model, or for none, is a usage error, as ``psgrad train`` says it."""
    from ..choices import option_flag, wrn_depth_problem
    from ..options import set_off_default

    if model == "wrn" and (problem := wrn_depth_problem(depth)) is not None:
        raise click.BadParameter(problem, param_hint="--depth")
    for name in ("depth", "widen_factor"):
        if model != "wrn" and set_off_default(name):
            where = f"to --model {model}" if model else "without --model wrn"
            raise click.UsageError(f"{option_flag(name)} shapes a WideResNet: it means nothing {where}")


def require_resumable(cfg, ranks: int, fix: Callable[[int], str]) -> None:
    """With --resume: a missing or incomplete checkpoint, or one written by another number of
    ranks, is a usage error said once, before any rank builds a model (``fix(ranks written)`` says
    how to start the job instead)."""
    from .. import checkpoint

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


def require_data(cfg) -> None:
    """A missing CIFAR folder or archive is a usage error, said once, before any rank builds a model."""
    from ..data import missing_data

    problem = missing_data(cfg.dataset, cfg.data_dir)
    if problem is not None:
        raise click.UsageError(problem)


def abort_job(message: str) -> None:
    """A usage error on one rank must end every rank, or the others would wait for it forever."""
    from ..comm.transport import Transport, on_job_end
    from ..runtime import job_end_hooks

    click.echo(f"Error: {message}", err=True)
    on_job_end(**job_end_hooks())
    Transport().abort(2)
