"""What every role shares: the layer plan, tags, seeds, step statistics and the
gradient message a worker sends. Pure Python and torch: importing it does not start MPI.

Roles never import each other; whatever two of them must agree on lives here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import nn

from ..codecs import Codec, Message, make_codec
from ..feedback import NoFeedback
from . import wire
from .envelope import Envelope

# ---------------------------------------------------------------------- tags
TAG_CONTROL = 1  # worker -> server: stats, BatchNorm buffers and stop, in the order sent
TAG_VALUES = 2  # server -> server 0: a server's layer values for evaluation
TAG_USER = 3  # first worker -> the others: psgrad.userloop's broadcasts
TAG_MEMORY = 4  # first worker <-> a serving-only rank: its down-link memory, for your checkpoint
TAG_LAYER_BASE = 16  # + layer index: gradients up and parameters down (direction tells them apart)


def layer_tag(index: int) -> int:
    """The MPI tag of layer ``index``."""
    return TAG_LAYER_BASE + index


# ---------------------------------------------------------------------- the layer plan
def shard_layers(sizes: list[float], servers: int) -> list[int]:
    """Owner (0..servers-1) of each layer, balancing total size.

    1. Visit layers from largest to smallest (ties: lower index first).
    2. Give each to the server with the least total size so far (ties: lower server).
    """
    if servers < 1:
        raise ValueError(f"need at least one server, got {servers}")
    load = [0.0] * servers
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        server = min(range(servers), key=lambda s: (load[s], s))
        owner[index] = server
        load[server] += sizes[index]
    return owner


VECTORS_LAYER = "__vectors__"


@dataclass(frozen=True)
class Layer:
    """One unit of communication: a parameter, the bucket of all 1-D parameters, or (granularity
    ``model``) all of them flattened. ``owner`` is the serving rank; ``compress`` False: the layer
    always travels as exact fp32."""

    index: int
    name: str
    shape: tuple[int, ...]
    params: tuple[str, ...]
    owner: int
    compress: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def plan_layers(
    named_shapes: list[tuple[str, tuple[int, ...]]],
    *,
    granularity: str,
    owners: list[int] | int,
    bucket_vectors: bool = False,
    codec_spec: str | None = None,
) -> list[Layer]:
    """The layers every rank agrees on, from the model's ordered (name, shape) list.

    ``owners`` are the serving ranks (an int S means ranks 0..S-1); layers are balanced over them
    by the bytes their gradient message may take on the wire under ``codec_spec`` (the run's
    codec; uncompressed layers, the vector bucket, are dense), or without one by element count.
    With ``bucket_vectors`` (granularity ``layer``), all parameters of at most one dimension —
    biases, normalisation scales and shifts — form one uncompressed layer, placed first:
    1. they are a tiny share of the bytes (0.1 % of WRN-16-4) but most of the messages
       (27 of 44), and every message costs encode, framing, a send and a decode;
    2. lossy codecs fit them badly (one sign scale for a handful of BatchNorm shifts);
    3. first, because backward produces it last (its last member is the first block's) and the
       forward pass needs it first, like the first convolution.
    """
    ranks = list(range(owners)) if isinstance(owners, int) else list(owners) or [0]
    cost = _coded_cost(codec_spec) if codec_spec else (lambda shape, compress: float(math.prod(shape)))
    if granularity == "model":
        total = sum(math.prod(shape) for _, shape in named_shapes)
        return [Layer(0, "__model__", (total,), tuple(n for n, _ in named_shapes), ranks[0])]
    if granularity != "layer":
        raise ValueError(f"granularity must be layer or model, got {granularity!r}")
    units: list[tuple[str, tuple[int, ...], tuple[str, ...], bool]] = []
    vectors = [(n, shape) for n, shape in named_shapes if len(shape) <= 1] if bucket_vectors else []
    if vectors:
        total = sum(math.prod(shape) for _, shape in vectors)
        units.append((VECTORS_LAYER, (total,), tuple(n for n, _ in vectors), False))
    units += [(n, tuple(shape), (n,), True) for n, shape in named_shapes if not (bucket_vectors and len(shape) <= 1)]
    shard = shard_layers([cost(shape, compress) for _, shape, _, compress in units], len(ranks))
    return [
        Layer(i, name, shape, params, ranks[shard[i]], compress)
        for i, (name, shape, params, compress) in enumerate(units)
    ]


def _coded_cost(codec_spec: str) -> Callable[[tuple[int, ...], bool], float]:
    """A layer's cost for ``plan_layers``: the bytes its gradient message may take on the wire."""
    return lambda shape, compress: float(wire.max_message_bytes(codec_spec if compress else "none", shape))


def flat_parts(flat: torch.Tensor, targets: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive slices of ``flat``, each viewed in the shape of its one of ``targets``."""
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in targets]), targets, strict=True)]


def copy_flat_into(params: dict[str, torch.Tensor], names: tuple[str, ...], flat: torch.Tensor, add: bool = False):
    """Write (or with ``add``, add) consecutive slices of ``flat`` into the named parameters, in one
    foreach call (a model's 25 parameters one by one took twice as long, in torch's dispatch)."""
    targets = [params[name] for name in names]
    if not targets:  # a model without BatchNorm statistics
        return
    parts = flat_parts(flat, targets)
    with torch.no_grad():
        (torch._foreach_add_ if add else torch._foreach_copy_)(targets, parts)


def buffers_vector(model: nn.Module) -> torch.Tensor:
    """All floating BatchNorm statistics as one fp32 vector (integer counters are not averaged)."""
    tensors = [b.detach().float().view(-1) for b in model.buffers() if b.is_floating_point()]
    return torch.cat(tensors) if tensors else torch.zeros(0)


def load_buffers_vector(model: nn.Module, flat: torch.Tensor) -> None:
    floating = [b for b in model.buffers() if b.is_floating_point()]
    copy_flat_into(dict(enumerate(floating)), tuple(range(len(floating))), flat)


# ---------------------------------------------------------------------- seeds and messages
SERVER_STREAM = 1 << 20  # the "sender" of a server's down-link seeds: no worker index reaches it
SHARED_STREAM = 1 << 21  # every sender's stream for a codec that shares its randomness (up and down)


def message_seed(run_seed: int, step: int, layer: int, stream: int) -> int:
    """One seed per (run seed, step, layer, stream): random codecs never share a stream.

    Workers use their worker index as the stream and servers ``SERVER_STREAM`` (a layer has one
    owner), so the same run draws the same numbers whichever ranks play the parts: colocated
    servers equal separate ones bit for bit, random codecs included.
    """
    return ((run_seed * 1_000_003 + step) * 65_537 + layer * 4_099 + stream) % (2**63)


_EXACT = make_codec("none")


class NonFiniteError(RuntimeError):
    """A gradient or a server's sum holds NaN or Inf (``--on-nonfinite abort``)."""


def nonfinite_text(values: torch.Tensor, what: str) -> str | None:
    """None when every value is finite, else a sentence for the error.

    One reduction, no temporary: NaN and Inf propagate through a sum (a finite sum that overflows
    counts too: the values are then too large to train on anyway)."""
    if bool(torch.isfinite(values.sum())):
        return None
    bad = values.numel() - int(torch.isfinite(values).sum())
    return f"{what} has {bad} NaN/Inf values of {values.numel()} (lower --lr, or --on-nonfinite skip)"


def skip_update(total: torch.Tensor, what: str, policy: str, marked: bool = False) -> bool:
    """Whether a layer stays as it is this step: a sender marked its gradient skipped, or the
    summed gradient ``total`` is not finite (with policy abort that raises NonFiniteError)."""
    if marked:
        return True
    problem = nonfinite_text(total, what)
    if problem is not None and policy == "abort":
        raise NonFiniteError(problem)
    return problem is not None


def encode_gradient(
    feedback: NoFeedback,
    layer: Layer,
    grad: torch.Tensor,
    *,
    step: int,
    sender: int,
    stream: int,
    run_seed: int,
    on_nonfinite: str = "abort",
) -> Message:
    """Feedback -> codec for one layer's gradient: the message a worker sends (an uncompressed
    layer skips feedback and codec: it goes exact).

    A non-finite gradient never reaches the feedback (its memory would stay NaN for good):
    ``abort`` raises NonFiniteError; ``skip`` sends exact zeros marked ``meta["skip"]`` and every
    receiver leaves the layer as it is for this step. (A multi-round layer sends the first round
    of a zero gradient instead, so that its rounds stay well-formed.)"""
    grad = grad.detach().reshape(layer.shape)
    problem = nonfinite_text(grad, f"step {step}: rank {sender}'s gradient of {layer.name!r}")
    rounds = layer_rounds(feedback.codec, layer)
    if problem is not None and on_nonfinite == "abort":
        raise NonFiniteError(problem)
    if problem is not None and rounds == 1:
        payload = _EXACT.encode(torch.zeros_like(grad))
    elif layer.compress:
        if problem is not None:
            grad = torch.zeros_like(grad)
        shared = feedback.codec.shares_randomness
        seed = message_seed(run_seed, step, layer.index, SHARED_STREAM if shared else stream)
        payload = feedback.encode(layer.name, grad, seed)
    else:
        payload = _EXACT.encode(grad)
    return Envelope("grad", layer.name, step, sender).seal(payload, skip=problem is not None)


def layer_rounds(codec: Codec, layer: Layer) -> int:
    """Messages per step of ``layer`` under ``codec`` (an uncompressed layer: one, exact)."""
    return codec.rounds(layer.shape) if layer.compress else 1


def add_code(total: dict[str, torch.Tensor], msg: Message) -> None:
    """Add ``msg``'s arrays into ``total``, name by name (a multi-round codec's sum in code space;
    the first message's arrays are copied, never kept: they may live in a reused receive buffer)."""
    for name, arr in msg.arrays.items():
        total[name] = total[name].add_(arr) if name in total else arr.float().clone()


def code_message(
    layer: Layer,
    round_: int,
    arrays: dict[str, torch.Tensor],
    *,
    codec: Codec,
    step: int,
    sender: int,
    skip: bool = False,
) -> Message:
    """A server's reply to one round of a multi-round codec: the aggregated code (kind ``code``)."""
    payload = Message(codec.name, dict(codec.params), layer.shape, "float32", arrays, meta={"round": round_})
    return Envelope("code", layer.name, step, sender, round_).seal(payload, skip=skip)


def layer_values(params: dict[str, torch.Tensor], layer: Layer) -> torch.Tensor:
    """A copy of ``layer``'s parameters as one flat tensor (on their device)."""
    return torch.cat([params[n].detach().reshape(-1) for n in layer.params])


def layer_grad(params: dict[str, torch.Tensor], layer: Layer) -> torch.Tensor:
    """``layer``'s gradient as one flat tensor (zeros for parameters that got none)."""
    parts = [
        (params[n].grad if params[n].grad is not None else torch.zeros_like(params[n])).reshape(-1)
        for n in layer.params
    ]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class GradientGate:
    """Tells when the last parameter of a layer got its gradient in this step's backward.

    Per-parameter hooks fire one at a time; a layer of several parameters (the 1-D bucket) is
    complete only with the last of them.
    """

    def __init__(self, layers: list[Layer]) -> None:
        self.layers = layers
        self.reset()

    def reset(self) -> None:
        self.missing = {layer.index: len(layer.params) for layer in self.layers}

    def arrived(self, layer: Layer) -> bool:
        """Count one parameter of ``layer`` in; True when it was the last one."""
        self.missing[layer.index] -= 1
        return self.missing[layer.index] == 0


def upload_bound(feedback: NoFeedback, layer: Layer) -> int:
    """Largest gradient message a worker may send for ``layer`` (the feedback may send more than
    the codec's own bound, e.g. DGC's warm-up)."""
    if not layer.compress:
        return wire.max_message_bytes("none", layer.shape, layer.name)
    return max(wire.max_message_bytes(spec, layer.shape, layer.name) for spec in feedback.codec_specs())


def control_message(op: str, sender: int, step: int = 0, **meta) -> Message:
    return Message("none", {}, (0,), "float32", {}, kind="control", step=step, sender=sender, meta={"op": op, **meta})


def tensor_message(kind: str, layer: str, *, step: int, sender: int, flat: torch.Tensor) -> Message:
    """An exact fp32 message (BatchNorm buffers, a server's values)."""
    return Envelope(kind, layer, step, sender).seal(_EXACT.encode(flat))


# ---------------------------------------------------------------------- step statistics
@dataclass
class StepStats:
    """One worker's step: seconds per phase and bytes it sent and received."""

    step: int = 0
    loss: float = 0.0
    load: float = 0.0  # loading the step's batch (before the step's own time, step_time, starts)
    forward: float = 0.0
    backward: float = 0.0
    encode: float = 0.0
    push_wait: float = 0.0
    pull_wait: float = 0.0
    decode: float = 0.0
    apply: float = 0.0
    serve: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    step_time: float = 0.0
    nonfinite: int = 0  # layers this worker sent as skipped (--on-nonfinite skip)
    outer: int = 0  # 1: the step ended with an exchange of --local-steps (the outer optimizer's step)


TIME_KEYS = tuple(
    f.name
    for f in fields(StepStats)
    if f.name not in ("step", "loss", "bytes_up", "bytes_down", "step_time", "nonfinite", "outer")
)
"""The phases of a step, in order (the bench's breakdown columns)."""
