#!/usr/bin/env bash
# One rank per node from a hostfile, with whichever MPI is on PATH (or the venv's MPICH).
#   launch/mpirun.sh HOSTFILE NRANKS psgrad train --codec qsgd ...
# Open MPI: --map-by ppr:1:node --hostfile;  MPICH (hydra): -f HOSTFILE -ppn 1.
set -euo pipefail
HOSTS="$1"; N="$2"; shift 2
HERE="$(cd "$(dirname "$0")/.." && pwd)"
MPIEXEC="${MPIEXEC:-$(command -v mpiexec || echo "$HERE/.venv/bin/mpiexec")}"
if "$MPIEXEC" --version 2>&1 | grep -qi "open mpi"; then
  EXTRA=()
  [ "$(id -u)" = 0 ] && EXTRA=(--allow-run-as-root --oversubscribe)
  exec "$MPIEXEC" "${EXTRA[@]}" -n "$N" --map-by ppr:1:node --hostfile "$HOSTS" -x PATH -x OMP_NUM_THREADS=1 "$@"
else
  exec "$MPIEXEC" -n "$N" -f "$HOSTS" -ppn 1 -genv OMP_NUM_THREADS 1 "$@"
fi
