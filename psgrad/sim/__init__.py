"""``psgrad simulate``: a whole job as threads of one process. ``simulate`` runs the ranks;
``world`` is the world they share and ``local`` each rank's in-process transport (a
``comm.channel.Channel``, as the MPI transport is); ``stacked`` computes the workers' forwards and
backwards as one grouped model (``stacked_layers``). A simulation starts no MPI: the MPI transport
starts it only when one is made. The engines know none of this: a rank's transport hands its
``Backprop`` the shared pass it takes part in (``Channel.shared_pass``).
"""
