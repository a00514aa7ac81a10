"""Who serves and who works, and which server owns which layer."""

from __future__ import annotations

import math
from dataclasses import dataclass


def shard_layers(sizes: list[int], servers: int) -> list[int]:
    """Owner server of each layer, balancing total size.

    1. Visit layers from largest to smallest (ties: lower index first).
    2. Give each to the server with the least total size so far (ties: lower server).
    """
    if servers < 1:
        raise ValueError(f"need at least one server, got {servers}")
    load = [0] * servers
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        server = min(range(servers), key=lambda s: (load[s], s))
        owner[index] = server
        load[server] += sizes[index]
    return owner


@dataclass(frozen=True)
class Roles:
    """Ranks 0..servers-1 serve, the rest work; with the alltoall topology every rank works."""

    world: int
    servers: int
    topology: str = "ps"

    def __post_init__(self) -> None:
        if self.topology not in ("ps", "alltoall"):
            raise ValueError(f"topology must be ps or alltoall, got {self.topology!r}")
        if self.topology == "ps" and self.world < self.servers + 1:
            raise ValueError(
                f"{self.world} MPI rank(s) cannot hold {self.servers} server(s) and a worker: "
                f"start at least {self.servers + 1} ranks (mpiexec -n {self.servers + 1} ...)"
            )
        if self.topology == "ps" and self.servers < 1:
            raise ValueError("the ps topology needs --servers >= 1")

    @property
    def server_ranks(self) -> list[int]:
        return [] if self.topology == "alltoall" else list(range(self.servers))

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(len(self.server_ranks), self.world))

    @property
    def num_workers(self) -> int:
        return len(self.worker_ranks)

    def is_server(self, rank: int) -> bool:
        return rank in self.server_ranks

    def worker_index(self, rank: int) -> int:
        return self.worker_ranks.index(rank)


VECTORS_LAYER = "__vectors__"


@dataclass(frozen=True)
class Layer:
    """One unit of communication: a parameter, the bucket of all 1-D parameters, or (granularity
    ``model``) all of them flattened. ``compress`` False: the layer always travels as exact fp32."""

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
    named_shapes: list[tuple[str, tuple[int, ...]]], granularity: str, servers: int, bucket_vectors: bool = False
) -> list[Layer]:
    """The layers every rank agrees on, from the model's ordered (name, shape) list.

    With ``bucket_vectors`` (granularity ``layer``), all parameters of at most one dimension —
    biases, normalisation scales and shifts — form one uncompressed layer, placed first:
    1. they are a tiny share of the bytes (0.1 % of WRN-16-4) but most of the messages
       (27 of 44), and every message costs encode, framing, a send and a decode;
    2. lossy codecs fit them badly (one sign scale for a handful of BatchNorm shifts);
    3. first, because backward produces it last (its last member is the first block's) and the
       forward pass needs it first, like the first convolution.
    """
    if granularity == "model":
        total = sum(math.prod(shape) for _, shape in named_shapes)
        return [Layer(0, "__model__", (total,), tuple(n for n, _ in named_shapes), 0)]
    if granularity != "layer":
        raise ValueError(f"granularity must be layer or model, got {granularity!r}")
    units: list[tuple[str, tuple[int, ...], tuple[str, ...], bool]] = []
    vectors = [(n, shape) for n, shape in named_shapes if len(shape) <= 1] if bucket_vectors else []
    if vectors:
        total = sum(math.prod(shape) for _, shape in vectors)
        units.append((VECTORS_LAYER, (total,), tuple(n for n, _ in vectors), False))
    units += [(n, tuple(shape), (n,), True) for n, shape in named_shapes if not (bucket_vectors and len(shape) <= 1)]
    owners = shard_layers([math.prod(shape) for _, shape, _, _ in units], servers)
    return [
        Layer(i, name, shape, params, owners[i], compress) for i, (name, shape, params, compress) in enumerate(units)
    ]
