"""Roles by topology: ``ROLES[cfg.topology](ctx)`` gives this rank's role.

A new topology is one file here (a ``context.Role`` subclass, or a function that picks one by
rank) plus its line below, and its rank layout in ``comm.layout.LAYOUTS``. Roles never import
each other: what they share is in ``comm.protocol`` and ``engine``.
"""

from __future__ import annotations

from collections.abc import Callable

from ..context import Role, RunContext
from .alltoall import PeerRole
from .colocated import ColocatedRole
from .gossip import GossipRole
from .ps import ps_role

ROLES: dict[str, Callable[[RunContext], Role]] = {
    "ps": ps_role,
    "colocated": ColocatedRole,
    "alltoall": PeerRole,
    "ring": GossipRole,
    "torus": GossipRole,
}
