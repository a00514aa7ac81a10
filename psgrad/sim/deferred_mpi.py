"""Imported first by ``psgrad.simulate``: MPI starts with the first MPI transport, not when mpi4py
is imported.

``psgrad simulate`` runs every rank in one process and needs no MPI, but the modules it shares with
``psgrad train`` import ``comm.transport``, whose ``from mpi4py import MPI`` initialises MPI by
default. Where a lone process cannot start MPI (UCX misconfigured, an MPI that needs its launcher)
that aborted the simulation before its first step.

1. If mpi4py's MPI module is not loaded yet, its initialisation at import is turned off, and its
   finalisation at exit turned on (it finalises only an MPI that was started).
2. ``transport.start_mpi`` starts MPI (thread level multiple, as mpi4py would) where an MPI
   transport, or the world's size or rank, is first needed.
A process that imported mpi4py's MPI module before this one keeps mpi4py's defaults.
"""

import sys

import mpi4py

if "mpi4py.MPI" not in sys.modules:
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = True
