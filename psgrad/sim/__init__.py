"""``psgrad simulate``: a whole job as threads of one process. ``simulate`` runs the ranks,
``local`` is the in-process transport they share, ``stacked`` computes the workers' forwards and
backwards as one grouped model, and ``deferred_mpi`` keeps mpi4py from starting MPI in a process
that needs none. The engines know none of this: a rank's transport hands its ``Backprop`` the
shared pass it takes part in (``Transport.shared_pass``).
"""

from . import deferred_mpi  # noqa: F401 -- first, before anything of the simulation imports mpi4py's MPI
