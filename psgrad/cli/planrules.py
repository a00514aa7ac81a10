"""Which plans ``psgrad plan`` accepts: the options' own rules, the options a plan would ignore,
and the runs ``psgrad train`` (or torch DDP) could not start, each a usage error or a reason."""

from __future__ import annotations

import click

DDP_CODEC = {"ddp": "none", "ddp-powersgd": "powersgd"}
"""The codec each of torch DDP's steps that plan compares with runs: plain, or its PowerSGD hook."""


def check_options(
    *,
    codecs: tuple[str, ...],
    local_steps: int,
    overlap_exchange: bool,
    overlap_steps: int,
    fragments: int,
    step_ms: float | None,
    matrices: str | None,
) -> None:
    """The options' rules that click's types cannot state, as usage errors."""
    from ..codecs import make_codec

    try:
        for spec in codecs:
            make_codec(spec)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    if overlap_steps and not overlap_exchange:
        raise click.UsageError("--overlap-steps shapes --overlap-exchange: give --overlap-exchange")
    if overlap_steps > local_steps:
        raise click.UsageError(f"--overlap-steps {overlap_steps}: at most --local-steps {local_steps}")
    if local_steps % fragments:
        raise click.UsageError(f"--fragments {fragments} must divide --local-steps {local_steps}")
    if step_ms is None and matrices is not None:
        raise click.UsageError("--matrices describes a model psgrad cannot time: give its --step-ms")


def refuse_unused(
    *, model: str, depth: int, matrices: str | None, step_ms: float | None, topologies: tuple[str, ...]
) -> None:
    """An option the plan would ignore is a usage error, as train's are: what describes psgrad's
    model beside --matrices, a WideResNet's shape for another model, --vector-params without
    --matrices, --batch-size (for timing) beside --step-ms, --servers where no planned topology
    has ranks that only serve."""
    from ..options import set_off_default
    from ..roles import TOPOLOGIES
    from .checks import refuse_wrn_shape

    given = {name for name in ("model", "depth", "widen_factor", "classes", "vector_params", "batch_size", "servers")
             if set_off_default(name)}  # fmt: skip
    if matrices is not None and given & {"model", "classes", "depth", "widen_factor"}:
        raise click.UsageError(
            "--matrices describes the model: --model, --depth, --widen-factor and --classes mean nothing beside it"
        )
    refuse_wrn_shape(model if matrices is None else None, depth)
    if "vector_params" in given and matrices is None:
        raise click.UsageError("--vector-params adds to --matrices: give --matrices, or nothing for psgrad's models")
    if "batch_size" in given and step_ms is not None:
        raise click.UsageError("--batch-size is for timing --model's step here: it means nothing beside --step-ms")
    if "servers" not in given:
        return
    planned = {name: TOPOLOGIES.get(name) for name in topologies}  # None: DDP's, without server ranks too
    if all(psgrads is None or "servers" in psgrads.ignores for psgrads in planned.values()):
        name, psgrads = next(iter(planned.items()))
        raise click.UsageError(
            psgrads.ignores["servers"] if psgrads else f"--servers means nothing to --topology {name}"
        )


def why_refused(*, topology: str, codec: str, down_codec: str, local_steps: int, **exchange) -> str | None:
    """Why a run cannot be started, or None: for psgrad's topologies, the checks and refusals
    ``psgrad train`` makes of the same settings (``--local-steps 1`` is train's per-step exchange
    unless an exchange option is given); for DDP's, the one codec each runs (none, or PowerSGD's
    hook), no down-link and no local steps."""
    from ..config import RunConfig
    from ..config.refusals import refuse_unused as refuse_unused_settings

    settings = run_settings(topology=topology, codec=codec, down_codec=down_codec, local_steps=local_steps, **exchange)
    if topology in DDP_CODEC:
        if codec.split(":")[0] != DDP_CODEC[topology]:
            return f"--topology {topology} all-reduces " + (
                "PowerSGD's factors (torch's hook): give --codec powersgd:rank=R" if DDP_CODEC[topology] != "none"
                else "the dense gradient: --codec none (--topology ddp-powersgd for torch's PowerSGD hook)"
            )  # fmt: skip
        if down_codec != "none" or settings["local_steps"]:  # local steps, or an exchange option
            return f"--topology {topology} is torch DDP's step: no --down-codec, --local-steps or exchange options"
        return None
    try:
        refuse_unused_settings(list(settings), RunConfig(**settings).validate())
    except ValueError as err:
        return str(err)
    return None


def run_settings(*, topology: str, codec: str, down_codec: str, local_steps: int, **exchange) -> dict:
    """The ``psgrad train`` settings of a plan: ``--local-steps 1`` without an exchange option is
    train's per-step exchange (``local_steps`` 0)."""
    exchanging = exchange["overlap_exchange"] or exchange["overlap_steps"] or exchange["fragments"] > 1
    per_step = local_steps == 1 and not exchanging
    return {"topology": topology, "codec": codec, "down_codec": down_codec,
            "local_steps": 0 if per_step else local_steps, **exchange}  # fmt: skip
