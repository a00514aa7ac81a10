"""The topology settings of a run: which rank serves what, and when it may go on."""

from __future__ import annotations

from dataclasses import dataclass

from ..roles import TOPOLOGIES
from ..settings import (
    TOPOLOGY,
    setting,
    unless,
)


@dataclass
class TopologySettings:
    """Rank roles, serving and staleness."""

    topology: str = setting(
        "ps",
        section=TOPOLOGY,
        choices=TOPOLOGIES.keys(),  # a live view: a topology registered later is a choice too
        help="ps: server ranks and worker ranks; colocated: every rank works and serves a shard of the layers (no extra server rank); alltoall: no server, every rank exchanges with every other; ring / torus: no server, every rank gossips with its ring or torus neighbours only (CHOCO-SGD).",
        your_loop=True,
    )
    servers: int = setting(
        1,
        section=TOPOLOGY,
        low=1,
        help="--topology ps: server ranks (0..S-1); layers are sharded over them by size.",
        your_loop=True,
    )
    mode: str = setting(
        "sync",
        section=TOPOLOGY,
        choices=("sync", "async"),
        help="sync: average all workers per step; async: apply each worker's gradient on arrival.",
        your_loop=True,
    )
    staleness: int = setting(
        0,
        section=TOPOLOGY,
        low=0,
        unused=(
            unless(
                lambda cfg: cfg.mode == "async",
                "--staleness bounds how far --mode async lets a worker run ahead: it means nothing to --mode sync",
            ),
        ),
        help="async: how many steps a worker may run ahead of the slowest.",
    )
    serve_thread: bool = setting(
        False,
        section=TOPOLOGY,
        help="colocated: also serve this rank's shard from a helper thread, not only between the worker's hooks and inside its waits (measured slower on 2 cores, docs/benchmarks.md).",
    )
    consensus_step: float = setting(
        0.5,
        section=TOPOLOGY,
        low=0,
        high=1,
        low_open=True,
        help="ring or torus: gamma of CHOCO-SGD's consensus step x += gamma sum_j w_ij (x_hat_j - x_hat_i); 1 with codec none is exact gossip averaging, lossy codecs need less (docs/training.md).",
    )
    grid: str | None = setting(
        None,
        section=TOPOLOGY,
        help="torus: RxC, rows x columns of the torus (= the number of ranks, placed row-major); each rank gossips with the ranks above, below, left and right of it, wrapping around.",
    )
    consensus_every_steps: int = setting(
        10,
        section=TOPOLOGY,
        low=0,
        help="ring or torus: log the consensus distance (1/N) sum ||x_i - x_mean||^2 in metrics.csv every N steps and at the last (one allreduce of the model each time; 0: never).",
    )
