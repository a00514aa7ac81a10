"""A summing server's down-link memory, carried in the first worker's checkpoint.

A server that only sums (your own loop, ``psgrad.userloop``) codes each mean gradient with
``--down-codec`` inside error feedback: what the code dropped waits in the server's memory for
later steps. A colocated rank checkpoints its own server part; a serving-only rank (``--topology
ps``) has no checkpoint of its own, since your loop saves on the workers. So, between steps:

1. Save: the first worker asks each serving-only rank for its memory (a control message, behind
   the worker's earlier control traffic); the rank answers on ``TAG_MEMORY`` with the residuals
   of its compressed layers, in layer order, as one exact fp32 message; the worker keeps them per
   rank in its ``state_dict``.
2. Load: the first worker sends each rank its residuals back on ``TAG_MEMORY`` and waits for the
   rank's acknowledgement, so no later gradient of the worker's can be coded before the memory is
   in place.
A memory is consistent between steps: it changes only when a layer's mean is coded, and that needs
the first worker's next gradient, which waits for the exchange to end.
"""

from __future__ import annotations

import torch

from ..codecs import Message
from ..comm import wire
from ..comm.channel import Handle
from ..comm.envelope import Envelope, parse
from ..comm.protocol import TAG_CONTROL, TAG_MEMORY, Layer, control_message, tensor_message
from ..comm.transport import Transport
from ..feedback import NoFeedback

MEMORY_LAYER = "__down_memory__"
_ACK_BYTES = 4096


def memory_layers(layers: list[Layer], server: int) -> list[Layer]:
    """The layers whose means ``server`` codes through its memory: its own compressed ones."""
    return [layer for layer in layers if layer.owner == server and layer.compress]


def memory_bound(layers: list[Layer], server: int) -> int:
    """The most bytes ``server``'s memory message may take."""
    numel = sum(layer.numel for layer in memory_layers(layers, server))
    return wire.max_message_bytes("none", (numel,), MEMORY_LAYER)


def memory_message(
    state: dict[str, torch.Tensor], *, layers: list[Layer], server: int, step: int, sender: int
) -> Message:
    """``state`` (an error feedback's ``state_dict``) as one flat exact message, in layer order.

    A layer not yet coded has no residual; it travels as zeros, unless no layer has one (meta
    ``empty``: the memory before the first step)."""
    owned = memory_layers(layers, server)
    parts = []
    for layer in owned:
        residual = state.get(f"residual/{layer.name}")
        if residual is not None and residual.numel() != layer.numel:
            raise ValueError(
                f"the down-link memory of {layer.name!r} holds {residual.numel()} values, this run's layer "
                f"{layer.numel}: load it into a job with the same model, --servers and --bucket-vectors"
            )
        parts.append(torch.zeros(layer.numel) if residual is None else residual.detach().reshape(-1).float().cpu())
    flat = torch.cat(parts) if parts else torch.zeros(0)
    msg = tensor_message("params", MEMORY_LAYER, step=step, sender=sender, flat=flat)
    if not state:
        msg.meta["empty"] = 1
    return msg


def memory_state(msg: Message, *, layers: list[Layer], server: int) -> dict[str, torch.Tensor]:
    """The ``state_dict`` a memory message stands for (its sender and kind already checked)."""
    if msg.meta.get("empty"):
        return {}
    owned = memory_layers(layers, server)
    flat = wire.codec_of(msg).decode(msg).reshape(-1)
    if flat.numel() != sum(layer.numel for layer in owned):
        raise wire.WireError(
            f"a down-link memory of {flat.numel()} values for server rank {server}, which codes "
            f"{sum(layer.numel for layer in owned)}"
        )
    state, offset = {}, 0
    for layer in owned:
        state[f"residual/{layer.name}"] = flat[offset : offset + layer.numel].view(layer.shape).clone()
        offset += layer.numel
    return state


# ---------------------------------------------------------------------- the server's side
def answer(
    msg: Message, *, feedback: NoFeedback, layers: list[Layer], rank: int, worker: int, transport: Transport
) -> Handle:
    """On a serving-only rank: the first worker's request (a control message ``memory``) or its
    memory to load (a ``params`` message of ``MEMORY_LAYER``); returns the answer's send."""
    if msg.kind == "control":
        reply = memory_message(feedback.state_dict(), layers=layers, server=rank, step=msg.step, sender=rank)
    else:
        Envelope("params", MEMORY_LAYER, msg.step, worker).check(msg)
        feedback.load_state_dict(memory_state(msg, layers=layers, server=rank))
        reply = control_message("memory_loaded", rank, msg.step)
    return transport.isend(wire.dumps(reply), worker, TAG_MEMORY)


# ---------------------------------------------------------------------- the first worker's side
def fetch(
    *, transport: Transport, layers: list[Layer], servers: list[int], rank: int, step: int, idle=None
) -> dict[int, dict[str, torch.Tensor]]:
    """Every serving-only rank's memory, by rank (see the module docstring, step 1)."""
    receives = {
        server: transport.irecv(memory_bound(layers, server), server, TAG_MEMORY, key=("memory", server))
        for server in servers
    }
    sends = [transport.isend(wire.dumps(control_message("memory", rank, step)), s, TAG_CONTROL) for s in servers]
    memories = {}
    for server, handle in receives.items():
        handle.wait(idle)
        msg = _parse(handle)
        Envelope("params", MEMORY_LAYER, step, server).check(msg)
        memories[server] = memory_state(msg, layers=layers, server=server)
    transport.wait_all(sends, idle)
    return memories


def restore(
    memories: dict[int, dict[str, torch.Tensor]],
    *,
    transport: Transport,
    layers: list[Layer],
    servers: list[int],
    rank: int,
    step: int,
    idle=None,
) -> None:
    """Send every serving-only rank its memory and wait until each has it (module docstring, step 2)."""
    if sorted(memories) != sorted(servers):
        raise ValueError(
            f"this state_dict holds the down-link memory of serving ranks {sorted(memories)}, this job's are "
            f"{sorted(servers)}: load it into a job of the same topology and --servers"
        )
    messages = {s: memory_message(memories[s], layers=layers, server=s, step=step, sender=rank) for s in servers}
    receives = {s: transport.irecv(_ACK_BYTES, s, TAG_MEMORY, key=("memory", s)) for s in servers}
    sends = [transport.isend(wire.dumps(msg), s, TAG_MEMORY) for s, msg in messages.items()]
    for server, handle in receives.items():
        handle.wait(idle)
        msg = _parse(handle)
        Envelope("control", "", step, server).check(msg)  # a control message names no layer
        if msg.meta.get("op") != "memory_loaded":
            raise RuntimeError(f"server rank {server} answered a down-link memory with {msg.meta.get('op')!r}")
    transport.wait_all(sends, idle)


def _parse(handle: Handle) -> Message:
    return parse(handle.payload(), sender=handle.peer, what="down-link memory message", max_bytes=len(handle.buffer))
