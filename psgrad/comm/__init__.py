"""Communication floors: ``wire`` (Message <-> bytes), ``protocol`` (what roles share), and
``transport`` (the only importer of mpi4py; import it only where MPI may start)."""
