"""Topologies and rank layouts: which ranks serve, which work, whom each rank talks to, and what
each topology asks of the run's settings. Pure Python (no torch, no MPI), so the command line can
offer and check these choices without importing torch. Each topology is declared once, as a
``Topology`` in its own file of ``psgrad/roles/``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# How a topology places servers and workers on ranks:
#   separate  — ranks 0..S-1 serve, the rest work (the parameter server, --servers S)
#   colocated — every rank works and also serves a shard of the layers (BytePS-style)
#   peers     — every rank works, nobody serves (all-to-all exchange)
#   gossip    — every rank works and talks to its neighbours only (decentralized, CHOCO-SGD)
KINDS = ("separate", "colocated", "peers", "gossip")


def _no_rules(cfg: Any) -> None:
    """A topology without option rules of its own."""


@dataclass(frozen=True)
class Topology:
    """One way of placing and connecting ranks, declared once in ``psgrad/roles/<name>.py``.

    ``role`` names the factory (``"module:attribute"``, ``ctx -> Role``) that builds a rank's part;
    it is imported only when a rank starts, so settings and the command line stay free of torch.
    ``refuses`` maps a setting (RunConfig field) this topology cannot run away from its default
    to why, and ``check(cfg)`` raises ValueError for any other setting it cannot run (both hold
    whatever set the value); ``ignores`` maps a run option that means nothing here to why (refused
    when the command line sets it); ``busiest_link(m, servers, workers)`` turns a bench row's
    per-step byte counts into bytes on its busiest link; ``takes_grid`` says whether ``--grid``
    shapes it, ``grid_places(cfg)`` the number of ranks its shape fixes (None: any), and
    ``neighbours(rank, size, cfg)`` a gossip rank's neighbours.
    """

    name: str
    kind: str
    role: str
    busiest_link: Callable[[dict, int, int], float]
    check: Callable[[Any], None] = _no_rules
    refuses: Mapping[str, str] = field(default_factory=dict)
    ignores: Mapping[str, str] = field(default_factory=dict)
    takes_grid: bool = False
    grid_places: Callable[[Any], int | None] = lambda cfg: None
    neighbours: Callable[[int, int, Any], list[int]] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"topology {self.name}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @property
    def has_servers(self) -> bool:
        """Whether some rank serves (and replies to) the workers' gradients."""
        return self.kind in ("separate", "colocated")

    def rank_layout(self, *, world: int, servers: int = 1) -> RankLayout:
        """Which of ``world`` ranks serve and which work under this topology."""
        return RankLayout(world=world, servers=servers, kind=self.kind)

    def ranks_needed(self, *, workers: int, servers: int) -> int:
        """MPI ranks a job of ``workers`` workers needs under this topology."""
        return workers + (servers if self.kind == "separate" else 0)

    def make_role(self, ctx: Any) -> Any:
        """This rank's part of the run (``context.Role``), built by the topology's factory."""
        module, _, attribute = self.role.partition(":")
        return getattr(importlib.import_module(module), attribute)(ctx)


@dataclass(frozen=True)
class RankLayout:
    """Which ranks serve and which work, for a topology of ``kind`` on ``world`` ranks."""

    world: int
    servers: int = 1
    kind: str = "separate"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layout kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "separate":
            if self.servers < 1:
                raise ValueError("the ps topology needs --servers >= 1")
            if self.world < self.servers + 1:
                raise ValueError(
                    f"{self.world} MPI rank(s) cannot hold {self.servers} server(s) and a worker: "
                    f"start at least {self.servers + 1} ranks (mpiexec -n {self.servers + 1} ...), or run every rank in "
                    "this process with psgrad simulate --workers N"
                )

    @property
    def server_ranks(self) -> list[int]:
        return {"separate": list(range(self.servers)), "colocated": list(range(self.world))}.get(self.kind, [])

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.servers, self.world)) if self.kind == "separate" else list(range(self.world))

    @property
    def num_workers(self) -> int:
        return len(self.worker_ranks)

    def is_server(self, rank: int) -> bool:
        return rank in self.server_ranks

    def is_worker(self, rank: int) -> bool:
        return rank in self.worker_ranks

    def worker_index(self, rank: int) -> int:
        return self.worker_ranks.index(rank)

    def role_name(self, rank: int) -> str:
        serves, works = self.is_server(rank), self.is_worker(rank)
        return "server+worker" if serves and works else "server" if serves else "worker" if works else "peer"


def without_gossip(name: str) -> dict[str, str]:
    """Why CHOCO-SGD's options mean nothing to topology ``name`` (one that does not gossip)."""
    return {
        option: f"--{option.replace('_', '-')} is CHOCO-SGD's: it means nothing to --topology {name} "
        "(use --topology ring or torus)"
        for option in ("consensus_step", "consensus_every_steps")
    }


def without_servers(name: str) -> dict[str, str]:
    """What topology ``name``, in which nobody serves, cannot run or ignores: ``(refuses, ignores)``."""
    refuses = {
        "push": f"--push after needs servers (--topology ps or colocated): {name} exchanges every layer before any update",
        "serve_thread": f"--serve-thread is for --topology colocated: {name} has no servers",
        "mode": "--mode async needs servers (--topology ps or colocated)",
    }
    return refuses, {"servers": f"--servers counts the server ranks of --topology ps: {name} has none"}


# gossip neighbourhoods
def ring_neighbours(rank: int, size: int) -> list[int]:
    """The ranks ``rank`` exchanges with on a ring of ``size`` (none alone, one for two)."""
    return sorted({(rank - 1) % size, (rank + 1) % size} - {rank})


def parse_grid(text: str) -> tuple[int, int]:
    """``"2x3"`` -> (2, 3): rows and columns of a torus."""
    rows, sep, cols = text.lower().partition("x")
    if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) < 1 or int(cols) < 1:
        raise ValueError(f"--grid must look like RxC with R, C >= 1 (e.g. 2x4), got {text!r}")
    return int(rows), int(cols)


def torus_neighbours(rank: int, rows: int, cols: int) -> list[int]:
    """The ranks ``rank`` exchanges with on a ``rows`` x ``cols`` torus (row-major ranks): up,
    down, left and right with wrap-around, each once (a side of 1 or 2 has fewer distinct ones)."""
    r, c = divmod(rank, cols)
    around = {
        ((r - 1) % rows) * cols + c,
        ((r + 1) % rows) * cols + c,
        r * cols + (c - 1) % cols,
        r * cols + (c + 1) % cols,
    }
    return sorted(around - {rank})
