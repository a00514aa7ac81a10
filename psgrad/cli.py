"""The ``psgrad`` command line: a thin layer over the Python API."""

from __future__ import annotations

import json

import click
import torch

from . import codecbench
from .codecs import available_codecs, make_codec


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="psgrad")
def main() -> None:
    """psgrad: data-parallel training through a parameter server whose every gradient is encoded."""


def _codec_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
    if value is None:
        return codecbench.DEFAULT_SPECS
    specs = tuple(s.strip() for s in value.split(";") if s.strip())
    for spec in specs:
        try:
            make_codec(spec)
        except ValueError as err:
            raise click.BadParameter(str(err)) from None
    return specs


@main.command()
@click.option("--size", type=click.IntRange(min=1), default=1 << 20, help="Gradient elements (fp32) to encode.")
@click.option("--repeat", type=click.IntRange(min=1), default=5, help="Timed runs per codec; the median is reported.")
@click.option(
    "--codecs",
    "specs",
    default=None,
    callback=_codec_list,
    help="Codec specs separated by ';' (e.g. 'qsgd:levels=4;topk:ratio=0.01'); default: a representative set.",
)
@click.option("--threads", type=click.IntRange(min=1), default=1, help="torch threads (1 = what one MPI rank uses).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (machine, rows) instead of a table.")
def codecs(size: int, repeat: int, specs: tuple[str, ...], threads: int, as_json: bool) -> None:
    """Bytes on the wire and encode/decode throughput of every codec, against a memcpy."""
    torch.set_num_threads(threads)
    rows = codecbench.run(specs, size=size, repeat=repeat)
    if as_json:
        click.echo(
            json.dumps({"machine": codecbench.machine(), "size": size, "rows": codecbench.as_dicts(rows)}, indent=1)
        )
        return
    click.echo(f"{size} fp32 elements ({size * 4 / 1e6:.1f} MB), median of {repeat}, {threads} thread(s)")
    click.echo(codecbench.table(rows))
    click.echo(f"available codecs: {', '.join(available_codecs())}")
