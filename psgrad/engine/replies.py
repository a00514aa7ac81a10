"""What a server's reply does to a worker's model, and how large a reply may be.

A reply to a layer is its new values (``params``: exact, the first time and whenever the down-link
is dense) or their change since the last reply (``delta``, coded with --down-codec). Both are
written into the worker's parameters; the reply of a multi-round codec (``code``) is a gradient,
which the worker engine applies with its optimizer instead.
"""

from __future__ import annotations

import time

import torch

from ..codecs import Codec, Message
from ..comm import wire
from ..comm.protocol import Layer, StepStats, copy_flat_into


def reply_bounds(layers: list[Layer], *, down_codec: str) -> list[int]:
    """The most bytes a reply to each layer may take: its exact values, or its down-coded delta
    (the first message of a layer is exact, later ones may be deltas)."""
    return [
        max(
            wire.max_message_bytes(spec, layer.shape, layer.name)
            for spec in ({down_codec, "none"} if layer.compress else {"none"})
        )
        for layer in layers
    ]


def apply_values(
    msg: Message,
    *,
    layer: Layer,
    params: dict[str, torch.Tensor],
    codecs: dict[str, Codec],
    device: torch.device,
    stats: StepStats,
) -> None:
    """Write a ``params`` reply into the layer's parameters, or add a ``delta`` reply to them.

    1. The reply's codec must be the down-codec or ``none`` (``codecs`` maps both names).
    2. A delta to a one-parameter layer decodes straight into the parameter (no dense temporary).
    3. Otherwise the decoded vector is copied (params) or added (delta) across the layer's
       parameters. Decoding counts in ``stats.decode``, the copy in ``stats.apply``.
    """
    start = time.perf_counter()
    codec = codecs.get(msg.codec)
    if codec is None:
        raise RuntimeError(f"{layer.name!r} arrived encoded with {msg.codec!r}, expected one of {sorted(codecs)}")
    if msg.kind == "delta" and len(layer.params) == 1:
        with torch.no_grad():
            codec.decode_add(msg, params[layer.params[0]])
        stats.decode += time.perf_counter() - start
        return
    values = codec.decode(msg, device=device).view(-1)
    mid = time.perf_counter()
    copy_flat_into(params, layer.params, values, add=msg.kind == "delta")
    stats.decode += mid - start
    stats.apply += time.perf_counter() - mid
