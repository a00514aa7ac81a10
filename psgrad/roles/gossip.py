"""Decentralized gossip (``--topology ring`` / ``torus``): CHOCO-SGD, every rank talks to its
neighbours only (``psgrad.engine.gossip``). On a ring rank i talks to i - 1 and i + 1 mod N; on
an R x C torus (``--grid RxC``, ranks row-major) to the ranks above, below, left and right.
"""

from __future__ import annotations

from ..comm.layout import Topology, parse_grid, ring_neighbours, torus_neighbours, without_servers


def busiest_link(m: dict, servers: int, workers: int) -> float:
    """A rank's own upload: one message per layer and step to its neighbours."""
    return m["bytes_up"] / workers


def check_gossip(cfg) -> None:
    """What CHOCO-SGD cannot run: a consensus step outside (0, 1], and a codec with rounds."""
    from ..codecs import make_codec  # torch: not needed to build the command line

    if not 0 < cfg.consensus_step <= 1:
        raise ValueError(f"--consensus-step must be in (0, 1], got {cfg.consensus_step}")
    if make_codec(cfg.codec).multi_round:
        raise ValueError(
            f"--topology {cfg.topology} sends one message per layer and step to its neighbours, and {cfg.codec} "
            "needs rounds through a server: run it with --topology ps, colocated or alltoall, or choose a "
            "one-message codec here (psgrad codecs --list; svd:rank=R is PowerSGD's one-message cousin)"
        )


def check_torus(cfg) -> None:
    """A torus also needs its grid (rows x columns = the number of ranks)."""
    if not cfg.grid:
        raise ValueError("--topology torus needs --grid RxC (rows x columns = the number of ranks)")
    parse_grid(cfg.grid)
    check_gossip(cfg)


def torus_places(cfg) -> int:
    rows, cols = parse_grid(cfg.grid or "")
    return rows * cols


def torus_around(rank: int, size: int, cfg) -> list[int]:
    rows, cols = parse_grid(cfg.grid or "")
    if rows * cols != size:
        raise ValueError(f"--grid {cfg.grid} has {rows * cols} places for {size} ranks: start mpiexec -n {rows * cols}")
    return torus_neighbours(rank, rows, cols)


def _gossip(name: str, **shape) -> Topology:
    """A CHOCO-SGD topology called ``name``, shaped by ``shape`` (its check and neighbours)."""
    refuses, ignores = without_servers(name)
    # CHOCO-SGD's public copies already carry what the codec dropped into later steps
    public_copies = (
        f"--topology {name} keeps public copies of the models (CHOCO-SGD), which already carry what the codec "
        "dropped into later steps: use --feedback none and no --down-codec (there is no down-link)"
    )
    return Topology(
        name=name,
        kind="gossip",
        role="psgrad.engine.gossip:GossipRole",
        busiest_link=busiest_link,
        refuses={**refuses, "feedback": public_copies, "down_codec": public_copies},
        ignores=ignores,
        **shape,
    )


RING = _gossip("ring", check=check_gossip, neighbours=lambda rank, size, cfg: ring_neighbours(rank, size))
TORUS = _gossip("torus", check=check_torus, takes_grid=True, grid_places=torus_places, neighbours=torus_around)
