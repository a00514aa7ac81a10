"""Colocated servers (``--topology colocated``): every rank works *and* serves a shard of the
layers, BytePS's answer to the parameter server's extra machine (``psgrad.engine.colocated``).
"""

from __future__ import annotations

from ..comm.layout import Topology, without_gossip


def busiest_link(m: dict, servers: int, workers: int) -> float:
    """Every byte leaves one rank and enters another, and the ranks are alike: a rank's egress is
    the step's total over the ranks."""
    return (m["bytes_up"] + m["bytes_down"]) / workers


TOPOLOGY = Topology(
    name="colocated",
    kind="colocated",
    role="psgrad.engine.colocated:ColocatedRole",
    busiest_link=busiest_link,
    ignores={
        "servers": "--servers counts the server ranks of --topology ps: every rank serves a shard under colocated",
        **without_gossip("colocated"),
    },
)
