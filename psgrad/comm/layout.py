"""Rank layouts and gossip neighbourhoods: which ranks serve, which work, and whom each rank
talks to under every topology. Pure Python (no torch, no MPI), so the command line can offer and
check these choices without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# How a topology places servers and workers on ranks:
#   separate  — ranks 0..S-1 serve, the rest work (the parameter server, --servers S)
#   colocated — every rank works and also serves a shard of the layers (BytePS-style)
#   peers     — every rank works, nobody serves (all-to-all exchange)
#   gossip    — every rank works and talks to its neighbours only (decentralized, CHOCO-SGD)
LAYOUTS = {"ps": "separate", "colocated": "colocated", "alltoall": "peers", "ring": "gossip", "torus": "gossip"}
TOPOLOGIES = tuple(LAYOUTS)


@dataclass(frozen=True)
class RankLayout:
    """Which ranks serve and which work, for ``topology`` on ``world`` ranks."""

    world: int
    servers: int = 1
    topology: str = "ps"

    def __post_init__(self) -> None:
        if self.topology not in LAYOUTS:
            raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
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
    def kind(self) -> str:
        return LAYOUTS[self.topology]

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

    @staticmethod
    def ranks_needed(topology: str, workers: int, servers: int) -> int:
        """MPI ranks a job of ``workers`` workers needs under ``topology``."""
        return workers + (servers if LAYOUTS[topology] == "separate" else 0)


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


def grid_places(topology: str, grid: str | None) -> int | None:
    """How many ranks ``topology`` needs when its shape fixes that (a torus: rows x columns)."""
    if topology != "torus":
        return None
    rows, cols = parse_grid(grid or "")
    return rows * cols


def neighbours_of(topology: str, grid: str | None, rank: int, size: int) -> list[int]:
    """This rank's gossip neighbours under ``topology`` (ring, or torus with ``grid``)."""
    if topology == "ring":
        return ring_neighbours(rank, size)
    rows, cols = parse_grid(grid or "")
    if rows * cols != size:
        raise ValueError(f"--grid {grid} has {rows * cols} places for {size} ranks: start mpiexec -n {rows * cols}")
    return torus_neighbours(rank, rows, cols)
