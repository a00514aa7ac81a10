"""``psgrad plan``: the cost model's predicted step (psgrad/plan.py) over workers and links."""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import click

from ..choices import MODEL_NAMES
from .group import main
from .planrules import DDP_CODEC, check_options, refuse_unused, run_settings, why_refused

if TYPE_CHECKING:  # the model loads torch: not for --help
    from ..plan import Scenario


def _numbers(kind: type, what: str):
    def parse(ctx: click.Context, param: click.Parameter, value: str) -> tuple:
        try:
            items = tuple(kind(item) for item in value.split(",") if item.strip())
        except ValueError:
            raise click.BadParameter(f"a comma-separated list of {what}, got {value!r}") from None
        if not items or min(items) <= 0:
            raise click.BadParameter(f"a comma-separated list of positive {what}, got {value!r}")
        return items

    return parse


def _rates(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    from ..bench.netshape import parse_rate

    try:
        return tuple(parse_rate(item) for item in value.split(",") if item.strip())
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


def _matrices(text: str) -> list[tuple[int, ...]]:
    """``COUNTxMxN,...`` (e.g. ``96x2048x2048,48x2048x8192``) as that many (M, N) shapes."""
    shapes: list[tuple[int, ...]] = []
    for item in text.split(","):
        count, *dims = (int(part) for part in item.strip().lower().split("x"))
        if len(dims) != 2 or count < 1 or min(dims) < 1:
            raise ValueError(item)
        shapes += [tuple(dims)] * count
    return shapes


def _matrix_shapes(matrices: str, vectors: int) -> list[tuple[int, ...]]:
    """``--matrices`` (and ``--vector-params``) as the layer shapes they describe."""
    try:
        shapes = _matrices(matrices)
    except ValueError as err:
        raise click.BadParameter(
            f"COUNTxMxN items, e.g. 96x2048x2048,48x2048x8192, got {err}", param_hint="--matrices"
        ) from None
    return [*shapes, (vectors,)] if vectors else shapes


@main.command()
@click.option("--model", type=click.Choice(MODEL_NAMES), default="wrn", help="psgrad's model whose layers travel.")
@click.option(
    "--depth", type=click.IntRange(min=10), default=16, help="--model wrn: its depth (6n+4: 10, 16, 22, 28, 40)."
)
@click.option("--widen-factor", type=click.IntRange(min=1), default=4, help="--model wrn: its width.")
@click.option("--classes", type=click.IntRange(min=1), default=100, help="--model: its output classes.")
@click.option(
    "--matrices",
    default=None,
    help="Layers of a model psgrad does not build, as COUNTxMxN items, e.g. 96x2048x2048,48x2048x8192 "
    "(a 24-layer transformer of width 2048); replaces --model.",
)
@click.option(
    "--vector-params",
    type=click.IntRange(min=0),
    default=0,
    help="With --matrices: parameters in 1-D tensors (biases, norms).",
)
@click.option(
    "--codec",
    "codecs",
    multiple=True,
    default=("none",),
    show_default=True,
    help="The up-link codec spec (psgrad codecs --list); give it again to compare codecs in one table.",
)
@click.option(
    "--down-codec",
    "down_codecs",
    multiple=True,
    default=("none",),
    show_default=True,
    help="The down-link codec spec (none: dense values); give it again to compare, as --codec.",
)
@click.option(
    "--topology",
    "topologies",
    type=click.Choice(("ps", "colocated", "alltoall", "ring", "ddp", "ddp-powersgd")),
    multiple=True,
    default=("colocated",),
    show_default=True,
    help="psgrad's topologies, torch DDP's ring all-reduce, or DDP with its PowerSGD hook (--codec powersgd:rank=R); "
    "give it again to compare: every topology with every --codec and --down-codec that can run on it.",
)
@click.option(
    "--workers", default="2", show_default=True, callback=_numbers(int, "worker counts"), help="Workers, e.g. 2,4,8."
)
@click.option(
    "--servers", type=click.IntRange(min=1), default=1, show_default=True, help="--topology ps: server ranks."
)
@click.option(
    "--bandwidth",
    default="100mbit,10mbit,1mbit",
    show_default=True,
    callback=_rates,
    help="Each link's rate, one or more (tc's units: kbit, mbit, gbit).",
)
@click.option(
    "--rtt-ms",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Round-trip time of a link, ms (modelled: this machine's links cannot add delay, so it is not measured).",
)
@click.option(
    "--step-ms",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="The compute-only step of one worker, ms [default: --model's forward and backward of --batch-size "
    "images, timed here on one thread; a GPU's step time must be given].",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Per worker, for timing --model's step (without --step-ms).",
)
@click.option(
    "--local-steps",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Exchange every H-th step (--local-steps).",
)
@click.option("--overlap-exchange", is_flag=True, help="With --local-steps: the exchange runs beside the next steps.")
@click.option(
    "--overlap-steps",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="With --overlap-exchange: the steps the exchange has to arrive in (psgrad train --overlap-steps); 0: H.",
)
@click.option(
    "--fragments",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --local-steps H: fragments of the model that exchange in turn, one every H/F steps (psgrad train --fragments).",
)
@click.option(
    "--code-gbps",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="The codecs' round-trip rate, GB/s of fp32 gradient [default: what psgrad codecs measured on the development VM].",
)
@click.option(
    "--fan-in-efficiency",
    type=click.FloatRange(min=0, max=1, min_open=True),
    default=1.0,
    show_default=True,
    help="Fraction of its rate a link reaches when several ranks send into it at once (incast: a ps server's, "
    "a colocated rank's past 2 workers); 1 loses nothing, 0.74 is what psgrad bench --bandwidth's shaped links reached.",
)
@click.option(
    "--layer-overhead-ms",
    type=click.FloatRange(min=0),
    default=None,
    help="psgrad's own CPU time an exchange costs a rank for each layer it moves (hooks, codec calls, messages, "
    "serving) [default: fitted on the development VM, 0.9 where every rank serves too, 0.57 for a ps worker; "
    "a host CPU faster at Python pays less].",
)
def plan(
    *,
    model: str,
    depth: int,
    widen_factor: int,
    classes: int,
    matrices: str | None,
    vector_params: int,
    codecs: tuple[str, ...],
    down_codecs: tuple[str, ...],
    topologies: tuple[str, ...],
    workers: tuple[int, ...],
    servers: int,
    bandwidth: tuple[int, ...],
    rtt_ms: float,
    step_ms: float | None,
    batch_size: int,
    local_steps: int,
    overlap_exchange: bool,
    overlap_steps: int,
    fragments: int,
    code_gbps: float | None,
    fan_in_efficiency: float,
    layer_overhead_ms: float | None,
) -> None:
    """Predict a step's time on links you do not have: a cost model of the bytes on the busiest
    link, round trips, coding and overlap, validated on this machine's shaped runs (docs/planning.md, "How well it predicts")."""
    import dataclasses

    from ..plan import Scenario

    exchange = {"overlap_exchange": overlap_exchange, "overlap_steps": overlap_steps, "fragments": fragments}
    check_options(
        codecs=(*codecs, *down_codecs), local_steps=local_steps, step_ms=step_ms, matrices=matrices, **exchange
    )
    refuse_unused(model=model, depth=depth, matrices=matrices, step_ms=step_ms, topologies=topologies)
    runnable, refused = _combinations(topologies=topologies, codecs=codecs, down_codecs=down_codecs,
                                      local_steps=local_steps, **exchange)  # fmt: skip
    shapes, step_ms = _shapes_and_step(
        model=model, depth=depth, widen_factor=widen_factor, classes=classes, matrices=matrices,
        vector_params=vector_params, step_ms=step_ms, batch_size=batch_size,
    )  # fmt: skip
    given = Scenario(
        shapes=shapes, servers=servers, rtt_s=rtt_ms / 1e3, compute_s=step_ms / 1e3,
        local_steps=local_steps, code_gbps=code_gbps, fan_in_efficiency=fan_in_efficiency,
        layer_overhead_s=None if layer_overhead_ms is None else layer_overhead_ms / 1e3, **exchange,
    )  # fmt: skip
    plans = [
        dataclasses.replace(given, topology=topology, codec=codec, down_codec=down)
        for topology, codec, down in runnable
    ]
    labels = [_label(i) for i in range(len(plans))] if len(plans) > 1 else [""]
    _say_what_is_planned(plans=plans, labels=labels, refused=refused)
    _say_table(plans=plans, labels=labels, workers=workers, bandwidth=bandwidth)
    click.echo()  # what the speeds are worth: the accuracy psgrad measured (docs/benchmarks.md)
    for label, planned in zip(labels, plans, strict=True):
        lines = _accuracy(topology=planned.topology, codec=planned.codec, down_codec=planned.down_codec,
                          local_steps=local_steps, **exchange)  # fmt: skip
        for i, line in enumerate(lines):
            click.echo(f"{label}: {line}" if label and not i else f"{'   ' if label else ''}{line}")


def _combinations(
    *, topologies: tuple[str, ...], codecs: tuple[str, ...], down_codecs: tuple[str, ...], local_steps: int, **exchange
) -> tuple[list[tuple[str, str, str]], list[str]]:
    """Every topology with every codec and down-link codec, each once, in the order given: those
    a run could start with, and a reason for each that it could not. One combination that cannot
    run is a usage error, as is a comparison of which none can."""
    runnable, refused = [], []
    combinations = list(itertools.product(*map(dict.fromkeys, (topologies, codecs, down_codecs))))
    for topology, codec, down in combinations:
        why = why_refused(topology=topology, codec=codec, down_codec=down, local_steps=local_steps, **exchange)
        if why is None:
            runnable.append((topology, codec, down))
        else:
            refused.append(why if len(combinations) == 1 else f"{codec} up, {down} down, {topology}: {why}")
    if not runnable:
        raise click.UsageError(
            refused[0] if len(refused) == 1 else "no combination can run:\n  " + "\n  ".join(refused)
        )
    return runnable, refused


def _label(index: int) -> str:
    """A, B, ..., Z, AA, AB, ...: the name of a compared combination in the table."""
    letter = chr(ord("A") + index % 26)
    return letter if index < 26 else _label(index // 26 - 1) + letter


def _say_what_is_planned(*, plans: list[Scenario], labels: list[str], refused: list[str]) -> None:
    """The header: one line for one combination; for several, what they share, then a line for
    each (its label, codecs, topology and psgrad's own cost a layer); then each one not planned."""
    first = plans[0]
    params = f"{sum(math.prod(shape) for shape in first.shapes) / 1e6:,.1f} M parameters"
    if len(plans) == 1:
        click.echo(f"{params}, {_combination(first)}, {_exchange(first)}{_own_cost(first)}")
    else:
        click.echo(f"{params}, {_exchange(first)}")
        for label, planned in zip(labels, plans, strict=True):
            click.echo(f"  {label}: {_combination(planned)}{_own_cost(planned)}")
    for why in refused:
        click.echo(f"  not planned: {why}")


def _combination(s: Scenario) -> str:
    return f"{s.codec} up, {s.down_codec} down, {s.topology}"


def _exchange(s: Scenario) -> str:
    """Compute, links and exchanges, in words."""
    return (
        f"compute {s.compute_s * 1e3:.1f} ms a step, RTT {s.rtt_s * 1e3:g} ms (modelled)"
        + (f", fan-in efficiency {s.fan_in_efficiency:g}" if s.fan_in_efficiency < 1 else "")
        + f", local steps {s.local_steps}"
        + (f" in {s.fragments} fragments" if s.fragments > 1 else "")
        + (f" overlapped by {s.overlap_steps or s.local_steps}" if s.overlap_exchange else "")
    )


def _own_cost(s: Scenario) -> str:
    from ..plan import own_layer_overhead_s

    own = own_layer_overhead_s(s)
    return f", psgrad's own {own * 1e3:.2g} ms a layer" if own else ""


def _say_table(
    *, plans: list[Scenario], labels: list[str], workers: tuple[int, ...], bandwidth: tuple[int, ...]
) -> None:
    """A row for each worker count, link and combination, the combinations side by side."""
    import dataclasses

    from ..plan import plan as predict

    plan_column = f"{'plan':>4}  " if len(plans) > 1 else ""
    click.echo(
        f"{plan_column}{'workers':>7}  {'link':>11}  {'step ms':>9}  {'x compute':>9}  {'link MB/exchange':>16}  bottleneck"
    )
    for n in workers:
        for rate in bandwidth:
            for label, planned in zip(labels, plans, strict=True):
                result = predict(dataclasses.replace(planned, workers=n, bandwidth_bps=rate))
                click.echo(
                    (f"{label:>4}  " if plan_column else "")
                    + f"{n:>7}  {_rate(rate):>11}  {result.step_s * 1e3:>9.1f}  {_fraction(result.utilisation):>9}  "
                    f"{result.link_bytes / 1e6:>16.3f}  {result.bottleneck}"
                )


def _accuracy(*, topology: str, **settings) -> list[str]:
    """What psgrad measured of the planned run's accuracy (``accuracy_lines``): torch DDP's ring
    all-reduce is dense, and its PowerSGD hook is judged by psgrad's PowerSGD of the same rank
    (at rank 2, the one rank measured both ways, the two matched)."""
    from ..accuracy import accuracy_lines
    from ..config import RunConfig

    ddp = topology in DDP_CODEC
    lines = accuracy_lines(RunConfig(**run_settings(topology="colocated" if ddp else topology, **settings)))
    if ddp and DDP_CODEC[topology] == "powersgd":
        lines[0] = lines[0].replace("accuracy", "accuracy of psgrad's powersgd (torch's hook matched it at rank 2)", 1)
    return lines


def _shapes_and_step(
    *,
    matrices: str | None,
    vector_params: int,
    step_ms: float | None,
    model: str,
    depth: int,
    widen_factor: int,
    classes: int,
    batch_size: int,
) -> tuple[list[tuple[int, ...]], float]:
    """The layer shapes that travel and the compute-only step in ms: ``--matrices`` as given, or
    ``--model`` built here, its step timed here when ``--step-ms`` is not given."""
    if matrices is not None:
        assert step_ms is not None  # check_options
        return _matrix_shapes(matrices, vector_params), step_ms
    from ..models import build_model

    built = build_model(model, classes, depth=depth, widen_factor=widen_factor)
    shapes = [tuple(p.shape) for p in built.parameters()]
    if step_ms is None:
        from ..plan import measured_step_s

        step_ms = 1e3 * measured_step_s(built, batch_size=batch_size, classes=classes)
        click.echo(
            f"compute-only step measured here: {step_ms:.1f} ms (--model {model}, batch {batch_size}, one thread)"
        )
    return shapes, step_ms


def _fraction(value: float) -> str:
    """A fraction of compute-only speed: two decimals, or two significant digits below 0.1, so a
    badly link-bound cell reads 0.00016, not 0.00."""
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


def _rate(bits: int) -> str:
    for unit, size in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= size:
            return f"{bits / size:g} {unit}"
    return f"{bits} bit/s"
