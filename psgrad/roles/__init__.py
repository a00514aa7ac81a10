"""The topologies, one ``Topology`` per file here (``comm.layout.Topology``): its rank layout,
the factory of its roles (in ``psgrad.engine``), its option rules, the options it ignores and its
bench row's busiest link. Pure Python: the command line offers and checks them without torch.

A new topology is one file here plus its line in ``TOPOLOGIES`` below.
"""

from __future__ import annotations

from ..comm.layout import Topology
from .alltoall import TOPOLOGY as ALLTOALL
from .colocated import TOPOLOGY as COLOCATED
from .gossip import RING, TORUS
from .ps import TOPOLOGY as PS

TOPOLOGIES: dict[str, Topology] = {t.name: t for t in (PS, COLOCATED, ALLTOALL, RING, TORUS)}


def topology_of(name: str) -> Topology:
    """The topology called ``name``; ValueError naming the choices for any other name."""
    try:
        return TOPOLOGIES[name]
    except KeyError:
        raise ValueError(f"--topology must be one of {', '.join(TOPOLOGIES)}, got {name!r}") from None
