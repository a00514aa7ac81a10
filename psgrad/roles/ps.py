"""The parameter-server topology (``--topology ps``): ranks 0..S-1 serve, the others work.

A server rank's step is "serve until every layer it owns took step t's gradients"; server 0
also collects the workers' step statistics and evaluates (``psgrad.engine.ps``).
"""

from __future__ import annotations

from ..comm.layout import Topology, without_gossip


def busiest_link(m: dict, servers: int, workers: int) -> float:
    """A server's link: the larger of what all workers send it and what it sends back."""
    return max(m["bytes_up"], m["bytes_down"]) / servers


TOPOLOGY = Topology(
    name="ps",
    kind="separate",
    role="psgrad.engine.ps:ps_role",
    busiest_link=busiest_link,
    refuses={
        "serve_thread": "--serve-thread is for --topology colocated: a server rank of ps serves all the time anyway"
    },
    ignores=without_gossip("ps"),
)
