#!/usr/bin/env bash
# Create (or reuse) .venv and install psgrad with what it needs; idempotent and quick when done.
#   bash launch/setup.sh          runtime: torch (CPU wheel), MPICH from pip, psgrad
#   bash launch/setup.sh test     + pytest, hypothesis, ruff, matplotlib
# PSGRAD_VENV=path picks another venv; PSGRAD_SYSTEM_MPI=1 skips the pip MPICH (use an mpi4py
# built against your system MPI instead, see docs/launch.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${PSGRAD_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build on a CPU box.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch ${PSGRAD_TORCH:-2.13.0}"
  "${PIP[@]}" "torch==${PSGRAD_TORCH:-2.13.0}" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
fi
EXTRAS="plot"
[ "${PSGRAD_SYSTEM_MPI:-0}" = "1" ] || EXTRAS="$EXTRAS,mpich"
[ "${1:-}" = "test" ] && EXTRAS="$EXTRAS,test"
echo "[setup] installing psgrad[$EXTRAS]"
"${PIP[@]}" -e ".[$EXTRAS]" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
"$VENV/bin/python" -c "import psgrad, mpi4py.MPI" || { echo "[setup] psgrad or mpi4py failed to import"; exit 1; }
echo "[setup] ready: $VENV ($("$VENV/bin/python" -c 'import torch, mpi4py.MPI as M; from psgrad.codecs import kernels_name; print("torch", torch.__version__, "|", M.Get_library_version().splitlines()[0], "|", kernels_name(), "codec kernels")'))"
