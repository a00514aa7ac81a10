"""All-to-all (``--topology alltoall``): no server; every rank exchanges every layer's encoded
gradient with all the others (``psgrad.engine.alltoall``).
"""

from __future__ import annotations

from ..comm.layout import Topology, without_gossip, without_servers


def busiest_link(m: dict, servers: int, workers: int) -> float:
    """A rank's own upload (every rank sends its block once, to all)."""
    return m["bytes_up"] / workers


_REFUSES, _IGNORES = without_servers("alltoall")

TOPOLOGY = Topology(
    name="alltoall",
    kind="peers",
    role="psgrad.engine.alltoall:PeerRole",
    busiest_link=busiest_link,
    refuses=_REFUSES,
    ignores={
        "down_codec": "--down-codec codes the servers' replies: --topology alltoall has no servers (each rank decodes "
        "every other rank's gradient)",
        **_IGNORES,
        **without_gossip("alltoall"),
    },
)
