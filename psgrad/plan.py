"""A cost model of one training step (``psgrad plan``): how long a step takes on links of a given
bandwidth and round-trip time, which link is the busiest, and what limits the step.

For a model's layer shapes, a codec (and down-link codec), a topology, N workers, a link
(bandwidth, RTT), the compute-only step time ``compute_s`` and local steps H:

1. Bytes a worker sends up per step, ``up``: each layer's message for a typical gradient
   (``message_bytes``: a seeded normal tensor, coded; 1-D parameters dense, in one bucket), and
   the bytes it receives back, ``down``: the down-link codec's messages, dense values without
   one, or PowerSGD's summed factors (as many as it sent; the down-link's for a layer sent whole).
2. Bytes on the busiest link, per direction (links are full duplex):
   - ``ps`` (S servers): a server's link carries N/S of every worker's up (in) and down (out);
   - ``colocated``: every rank serves 1/N of the layers and works: it sends (N-1)/N of its up and
     the replies of its shard to N-1 workers, (N-1)/N x down;
   - ``alltoall``: every rank sends its whole coded gradient to N-1 ranks (an all-gather);
   - ``ring`` (gossip): every rank sends its coded model change to its two neighbours;
   - ``ddp``: torch's ring all-reduce of the fp32 gradient, 2(N-1)/N x 4 bytes an element;
   - ``ddp-powersgd``: the same all-reduce of PowerSGD's P and Q factors (and the dense vectors).
3. Link time: the busiest direction's bits over ``bandwidth x efficiency`` (1: the shaped runs
   here moved a step's bytes at the full rate), and x ``fan_in_efficiency`` where several ranks
   send into that link at once (``Exchange.senders`` > 1: a ps server's, a colocated or
   alltoall rank's at N > 2, a ring rank's two neighbours): incast, whose losses idle the link.
   1 (none) by default; ``FAN_IN_EFFICIENCY`` is what this machine's shaped links reached.
4. Latency: message rounds x RTT a step: 1 for a one-round codec through servers, 2 for
   PowerSGD's two rounds; a ring all-reduce's 2(N-1) hops cost (N-1) RTT, twice for PowerSGD's
   two all-reduces; gossip one one-way trip.
5. Coding: the worker encodes its gradient and decodes the reply, 4 bytes an element at each
   codec's measured round-trip rate (``CODE_GBPS``, what ``psgrad codecs`` measures; the reply's
   codec is the down-link's, PowerSGD's own for PowerSGD, none for dense values).
6. The step: per-step exchanges overlap the link with the part of the rank's work they run
   beside (``overlap`` x (compute + psgrad's own work, 7); ``overlap_of``: psgrad's pushes from
   backward hooks and pulls before each layer's forward hide most of a step, fitted on this
   machine's shaped runs; torch DDP's PowerSGD hook, its gradients in one bucket, none; plain DDP,
   an assumption, half); what is left shows: ``compute + coding + own + max(0, link - overlap x
   (compute + own)) + latency``. With H local steps the
   exchange comes every H-th step and waits: ``compute + (coding + link + latency) / H``; with
   ``overlap_exchange`` it runs beside the steps until its reply is taken, tau (``overlap_steps``,
   H by default), less one: ``compute + (coding + max(0, link + latency - (tau-1) x compute)) / H``.
   With F fragments (``fragments``) each exchange is F turns in H steps, each with its own
   latency and tau: ``compute + (coding + sum over turns of max(0, turn + latency - (tau-1) x
   compute)) / H``, and never less than the link's share, ``(link - H x compute) / H``, a step.
   A turn moves link / F, except where every rank serves a shard (colocated): a fragment's layers
   need not split evenly over the ranks, and its turn lasts as long as the serial path through
   the rank serving most of it, its workers' pushes in and then its replies out
   (``fragment_turn_bytes``).
7. psgrad adds its own CPU work, a fixed cost for each layer an exchange moves (its hooks, the
   codec's calls, the messages, serving its share, applying the reply), whatever the layer's
   size: ``layer_overhead_s`` x the layers, once an exchange (every H-th step). By default
   ``PSGRAD_LAYER_OVERHEAD_S`` where every rank also serves, less ``SERVING_SHARE`` of it for a
   ``ps`` worker (``own_layer_overhead_s``). DDP's is none.
8. Utilisation is compute / step; the bottleneck is the largest cost beside compute (link,
   latency, coding or psgrad's overhead), or compute itself when none reaches a tenth of it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .codecs import make_codec
from .comm import wire
from .comm.protocol import plan_layers

CODE_GBPS = {"none": math.inf, "fp16": 12.0, "sign": 10.6, "topk": 6.9, "qsgd": 2.4, "powersgd": 1.7}
"""Round-trip (encode + decode) GB/s of the fp32 gradient at 4 M elements on the development VM
(docs/benchmarks.md, "Codec speed"); others 2.0. A GPU codes faster: pass ``code_gbps``."""

DEFAULT_CODE_GBPS = 2.0

EFFICIENCY = 1.0
"""Fraction of a link's rate that a step's traffic reaches."""

FAN_IN_EFFICIENCY = 0.74
"""Fraction of its rate a link reached on this machine's shaped links (``tc tbf``, a 50 ms queue)
when several ranks sent into it at once: the 1-server dense runs at 2, 4 and 8 workers
(docs/planning.md, "How well it predicts"), where only the server's port dropped packets. Not the
default: a fabric with deeper buffers or ECN loses less to incast."""

OVERLAP = {"ddp": 0.5, "ddp-powersgd": 0.0}
"""Fraction of the compute-only step that a per-step exchange runs beside: psgrad's
(``PSGRAD_OVERLAP``) fitted on the shaped runs here (docs/planning.md, "How well it predicts"); DDP with
the PowerSGD hook, whose one bucket is reduced after backward, none; plain DDP's buckets, reduced
during backward, half (assumed, not measured)."""

PSGRAD_OVERLAP = 0.85

PSGRAD_LAYER_OVERHEAD_S = 0.9e-3
"""psgrad's own CPU time an exchange costs a rank that works and serves (colocated, alltoall,
ring) for each layer it moves, beside compute, coding and the link: its hooks, the codec's Python
calls, the messages, serving its share, applying the reply. Fitted on the 100 Mbit/s WRN-16-4
colocated runs here, where the link is nearly free (16.6 ms a step over 18 layers). A cost a
message, not a byte: ResNet-20's 21 layers, a tenth of WRN-16-4's elements, cost 15 ms a step
unshaped on the AMD EPYC VM. A host CPU faster at Python pays less."""

SERVING_SHARE = 0.37
"""The part of ``PSGRAD_LAYER_OVERHEAD_S`` that is serving (decoding the workers' messages,
summing, coding the reply): 6.1 of 16.6 ms a step in ResNet-20's colocated breakdown (``psgrad
bench --wide``). A ``ps`` worker does not pay it: its servers are ranks of their own."""


def overlap_of(topology: str) -> float:
    """``OVERLAP`` of a topology (psgrad's own: ``PSGRAD_OVERLAP``)."""
    return OVERLAP.get(topology, PSGRAD_OVERLAP)


@dataclass(frozen=True)
class Scenario:
    """What ``plan`` costs: see the module docstring for each field's role."""

    shapes: Sequence[tuple[int, ...]]
    codec: str = "none"
    down_codec: str = "none"
    topology: str = "ps"
    workers: int = 2
    servers: int = 1
    bandwidth_bps: float = 100e6
    rtt_s: float = 0.0
    compute_s: float = 0.1
    local_steps: int = 1
    overlap_exchange: bool = False
    overlap_steps: int = 0  # the steps an overlapped exchange's reply is taken after; 0: local_steps
    fragments: int = 1  # --fragments: 1/F of the model exchanges every H/F steps
    code_gbps: float | None = None
    efficiency: float = EFFICIENCY
    fan_in_efficiency: float = 1.0  # FAN_IN_EFFICIENCY: this machine's shaped links
    overlap: float | None = None  # None: ``overlap_of(topology)``
    layer_overhead_s: float | None = None  # psgrad's own seconds a layer an exchange; None: own_layer_overhead_s


@dataclass(frozen=True)
class Plan:
    """A step's predicted time and its parts, in seconds; ``link_bytes`` on the busiest link's
    busier direction per exchange."""

    step_s: float
    link_bytes: float
    utilisation: float
    bottleneck: str
    parts: dict[str, float] = field(default_factory=dict)


def _elements(shapes: Sequence[tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes)


SAMPLE_ELEMENTS = 1 << 22
"""Layers above this many elements are coded from a sample of their rows (``message_bytes``)."""


@functools.lru_cache(maxsize=256)
def message_bytes(spec: str, shape: tuple[int, ...]) -> float:
    """Bytes of one layer's message under ``spec`` for a typical gradient of ``shape``.

    The wire's bound (``wire.max_message_bytes``) overstates what travels wherever the codec's
    output compresses: QSGD-16's levels are mostly 0 and 1, and blosc packs its message into 0.44
    of the bound. So:

    1. Dense values (``none``) take their bound, exact to the header.
    2. Otherwise encode a seeded standard-normal tensor of ``shape`` and measure its message; above
       ``SAMPLE_ELEMENTS`` elements, a tensor of fewer rows, whose ratio of message to bound
       scales the layer's bound (the codecs' compressibility does not depend on the row count:
       QSGD's norms are per bucket, PowerSGD's factors grow with the rows as its bound does).
    """
    bound = wire.max_message_bytes(spec, shape)
    if make_codec(spec).name == "none":
        return float(bound)
    sample = shape
    if math.prod(shape) > SAMPLE_ELEMENTS:
        row = math.prod(shape[1:])
        sample = (max(1, SAMPLE_ELEMENTS // row), *shape[1:])
    grad = torch.randn(sample, generator=torch.Generator().manual_seed(0))
    coded = len(wire.dumps(make_codec(spec).encode(grad, seed=0)))
    return bound * coded / wire.max_message_bytes(spec, sample)


def exchanged_layers(shapes: Sequence[tuple[int, ...]], *, owners: int = 1, codec_spec: str | None = None) -> list:
    """The layers psgrad's run plans for ``shapes`` (``protocol.plan_layers``): one message each,
    the 1-D parameters dense in one bucket, sharded over ``owners`` serving ranks as a run with
    ``codec_spec`` shards them."""
    named = [(f"p{i}", tuple(shape)) for i, shape in enumerate(shapes)]
    return plan_layers(named, granularity="layer", owners=owners, bucket_vectors=True, codec_spec=codec_spec)


def _layer_bytes(spec: str, layer) -> float:
    """A typical message of ``layer`` under ``spec``; a layer psgrad never compresses goes dense."""
    return message_bytes(spec if layer.compress else "none", tuple(layer.shape))


def coded_bytes(spec: str, shapes: Sequence[tuple[int, ...]]) -> float:
    """Bytes of one worker's coded gradient of ``shapes`` under ``spec``: each layer psgrad's run
    plans (``exchanged_layers``), a typical message of its shape (``message_bytes``)."""
    return sum(_layer_bytes(spec, layer) for layer in exchanged_layers(shapes))


def _rounds(spec: str) -> int:
    return 2 if make_codec(spec).name == "powersgd" else 1


@dataclass(frozen=True)
class Exchange:
    """How a topology exchanges a step (module docstring, 2 and 4)."""

    busiest: Callable[[int, int, float, float], float]  # (workers, servers, up, down) -> bytes
    senders: Callable[[int], int]  # workers -> ranks sending into the busiest link at once
    round_trips: Callable[[int, int], float]  # (workers, the codec's rounds) -> RTTs a step
    reply_coded: bool  # whether the reply is the codec's own (no down-link of its own)
    all_reduce: bool = False  # torch DDP: its own ring, no psgrad bookkeeping
    serves: bool = True  # a rank that works also serves (decodes the others' messages)
    sharded: bool = False  # every rank serves a shard of the layers (colocated)


def _ring_all_reduce(n: int, coded: float) -> float:
    return 2 * (n - 1) / n * coded


EXCHANGES = {
    "ps": Exchange(
        lambda n, servers, up, down: n * max(up, down) / servers,
        lambda n: n,
        lambda n, rounds: rounds,
        False,
        serves=False,
    ),
    "colocated": Exchange(
        lambda n, servers, up, down: (n - 1) / n * (up + down),
        lambda n: n - 1,
        lambda n, rounds: rounds,
        False,
        sharded=True,
    ),
    "alltoall": Exchange(lambda n, servers, up, down: (n - 1) * up, lambda n: n - 1, lambda n, rounds: rounds, True),
    "ring": Exchange(lambda n, servers, up, down: 2 * up, lambda n: min(2, n - 1), lambda n, rounds: 0.5, True),
    "ddp": Exchange(
        lambda n, servers, up, down: _ring_all_reduce(n, up), lambda n: 1, lambda n, rounds: n - 1, True, True
    ),
    "ddp-powersgd": Exchange(
        lambda n, servers, up, down: _ring_all_reduce(n, up),
        lambda n: 1,
        lambda n, rounds: rounds * (n - 1),
        True,
        True,
    ),
}
"""Each topology ``plan`` knows: psgrad's, and torch DDP's for comparison."""

TOPOLOGIES = tuple(EXCHANGES)


def exchange_of(topology: str) -> Exchange:
    if topology not in EXCHANGES:
        raise ValueError(f"unknown topology {topology!r}; choose one of {', '.join(TOPOLOGIES)}")
    return EXCHANGES[topology]


def _reply(s: Scenario, layer=None) -> str:
    """The codec of what a worker receives back (of ``layer``): its own codec's (PowerSGD's summed
    factors, an all-gather's or a ring's messages), else the down-link's, as for a layer PowerSGD
    sends whole."""
    factors = _rounds(s.codec) == 2 and (layer is None or make_codec(s.codec).compresses(tuple(layer.shape)))
    return s.codec if factors or exchange_of(s.topology).reply_coded else s.down_codec


def link_bytes(s: Scenario) -> float:
    """Bytes on the busiest link's busier direction per exchange (module docstring, 1-2)."""
    exchange = exchange_of(s.topology)
    # torch's all-reduce moves raw fp32, without psgrad's message headers
    plain = exchange.all_reduce and s.codec == "none"
    up = 4.0 * _elements(s.shapes) if plain else coded_bytes(s.codec, s.shapes)
    replies = (_layer_bytes(_reply(s, layer), layer) for layer in exchanged_layers(s.shapes))
    down = 4.0 * _elements(s.shapes) if _reply(s) == "none" else sum(replies)
    return exchange.busiest(s.workers, s.servers, up, down)


def fragment_turn_bytes(s: Scenario) -> list[float]:
    """Bytes on each fragment's turn (module docstring, 6): ``link_bytes`` / F where the layers'
    servers are not the workers; with a shard on every rank, the serial path through the rank that
    serves most of the fragment:

    1. psgrad's layer plan for N serving ranks (``protocol.plan_layers``, sharded by coded bytes)
       and its fragments (``engine.local.fragment_of``);
    2. for each fragment and serving rank, (N - 1) x (a worker's push + the reply) of the layers
       it serves: the other workers' pushes come in, then its replies go out to each of them;
    3. the largest of them, the turn's bytes.
    """
    if s.fragments == 1 or not exchange_of(s.topology).sharded:
        return [link_bytes(s) / s.fragments] * s.fragments
    from .engine.local import fragment_of

    layers = exchanged_layers(s.shapes, owners=s.workers, codec_spec=s.codec)
    fragment = fragment_of(layers, s.fragments)
    served = [[0.0] * s.workers for _ in range(s.fragments)]
    for layer in layers:
        pushed_and_replied = _layer_bytes(s.codec, layer) + _layer_bytes(_reply(s, layer), layer)
        served[fragment[layer.index]][layer.owner] += (s.workers - 1) * pushed_and_replied
    return [max(ranks) for ranks in served]


def latency_s(s: Scenario) -> float:
    """Round trips a step waits for (module docstring, 4)."""
    return exchange_of(s.topology).round_trips(s.workers, _rounds(s.codec)) * s.rtt_s


def _code_rate(spec: str, given: float | None) -> float:
    """GB/s ``spec`` codes at: ``given``, else ``CODE_GBPS``; dense values are not coded."""
    name = make_codec(spec).name
    if name == "none":
        return math.inf
    return given if given is not None else CODE_GBPS.get(name, DEFAULT_CODE_GBPS)


def coding_s(s: Scenario) -> float:
    """A worker's coding per exchange: its gradient up, the reply down (module docstring, 5)."""
    rates = (_code_rate(s.codec, s.code_gbps), _code_rate(_reply(s), s.code_gbps))
    return sum(0.0 if math.isinf(rate) else 4 * _elements(s.shapes) / (rate * 1e9) for rate in rates)


def own_layer_overhead_s(s: Scenario) -> float:
    """psgrad's own seconds a layer an exchange (module docstring, 7): ``s.layer_overhead_s`` when
    given; else ``PSGRAD_LAYER_OVERHEAD_S``, less its serving share for a ``ps`` worker; none for
    torch DDP."""
    if exchange_of(s.topology).all_reduce:
        return 0.0
    if s.layer_overhead_s is not None:
        return s.layer_overhead_s
    return PSGRAD_LAYER_OVERHEAD_S * (1.0 if exchange_of(s.topology).serves else 1 - SERVING_SHARE)


def plan(s: Scenario) -> Plan:
    """The predicted step of scenario ``s`` (module docstring, 6-8)."""
    if s.workers < 1 or s.local_steps < 1 or s.bandwidth_bps <= 0 or s.compute_s <= 0:
        raise ValueError("workers, local steps, bandwidth and compute time must be positive")
    if not 0 <= s.overlap_steps <= s.local_steps:
        raise ValueError(f"overlap_steps must be in [0, local_steps], got {s.overlap_steps}")
    if s.fragments < 1 or s.local_steps % s.fragments:
        raise ValueError(f"fragments must divide local_steps {s.local_steps}, got {s.fragments}")
    if not 0 < s.fan_in_efficiency <= 1:
        raise ValueError(f"fan_in_efficiency must be in (0, 1], got {s.fan_in_efficiency}")
    if s.layer_overhead_s is not None and s.layer_overhead_s < 0:
        raise ValueError(f"layer_overhead_s must be at least 0, got {s.layer_overhead_s}")
    exchange = exchange_of(s.topology)
    moved = link_bytes(s)
    incast = s.fan_in_efficiency if exchange.senders(s.workers) > 1 else 1.0
    link = moved * 8 / (s.bandwidth_bps * s.efficiency * incast)
    latency, coding, h = latency_s(s), coding_s(s), s.local_steps
    own = own_layer_overhead_s(s) * len(exchanged_layers(s.shapes)) / h
    if h == 1:
        overlap = overlap_of(s.topology) if s.overlap is None else s.overlap
        # the link moves while the rank computes and while it does its own message work
        exposed_link = max(0.0, link - overlap * (s.compute_s + own))
        parts = {"compute": s.compute_s, "coding": coding, "link": exposed_link, "latency": latency}
    elif s.overlap_exchange:
        hidden_behind = (s.overlap_steps or h) - 1
        f = s.fragments
        turns = [link * turn / moved for turn in fragment_turn_bytes(s)] if moved else [0.0] * f
        waited = sum(max(0.0, turn + latency - hidden_behind * s.compute_s) for turn in turns) / h
        waited = max(waited, (link - h * s.compute_s) / h)  # the link carries the model once in H steps
        share = waited / (link + f * latency) if link + latency > 0 else 0.0
        parts = {"compute": s.compute_s, "coding": coding / h, "link": link * share, "latency": f * latency * share}
    else:
        f = s.fragments
        parts = {"compute": s.compute_s, "coding": coding / h, "link": link / h, "latency": f * latency / h}
    parts["overhead"] = own
    step = sum(parts.values())
    extra = max((name for name in parts if name != "compute"), key=parts.get)
    bottleneck = extra if parts[extra] >= 0.1 * s.compute_s else "compute"
    return Plan(step, moved, s.compute_s / step, bottleneck, parts)


def measured_step_s(model: torch.nn.Module, *, batch_size: int, classes: int, repeat: int = 5) -> float:
    """The compute-only step of ``model`` on this machine, as one rank runs it (one torch thread,
    channels-last on the CPU): the median of ``repeat`` forwards and backwards of a random
    CIFAR-shaped batch of ``batch_size``, after two untimed ones."""
    import statistics
    import time

    import torch

    from .models.layout import in_layout, memory_format

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layout = memory_format("auto", torch.device("cpu"))
        model = model.to(memory_format=layout).train()
        images = in_layout(torch.randn(batch_size, 3, 32, 32), layout)
        labels = torch.randint(0, classes, (batch_size,))
        times = []
        for i in range(repeat + 2):
            start = time.perf_counter()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            if i >= 2:
                times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)
