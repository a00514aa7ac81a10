#!/usr/bin/env bash
# Create (or reuse) .venv and install psgrad with what it needs; idempotent and quick when done.
#   bash launch/setup.sh          runtime: torch, MPICH from pip, psgrad
#   bash launch/setup.sh test     + pytest (and pytest-xdist), hypothesis, ruff, matplotlib
# PSGRAD_VENV=path picks another venv; PSGRAD_SYSTEM_MPI=1 skips the pip MPICH (use an mpi4py
# built against your system MPI instead, see docs/launch.md). torch: PSGRAD_TORCH=version (default
# 2.13.0) from pip's index, or from PSGRAD_TORCH_INDEX=url (https://download.pytorch.org/whl/cpu for
# the CPU-only build, .../whl/cu126 for a CUDA one): PyPI's Linux wheel bundles CUDA (several GB).
# A venv that has torch keeps it.
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
# (found, not imported: importing torch takes seconds; the last line below imports it anyway)
if ! "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)"; then
  echo "[setup] installing torch ${PSGRAD_TORCH:-2.13.0}${PSGRAD_TORCH_INDEX:+ from $PSGRAD_TORCH_INDEX}"
  INDEX=(); [ -z "${PSGRAD_TORCH_INDEX:-}" ] || INDEX=(--index-url "$PSGRAD_TORCH_INDEX")
  "${PIP[@]}" "${INDEX[@]}" "torch==${PSGRAD_TORCH:-2.13.0}" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
fi
EXTRAS="plot"
[ "${PSGRAD_SYSTEM_MPI:-0}" = "1" ] || EXTRAS="$EXTRAS,mpich"
[ "${1:-}" = "test" ] && EXTRAS="$EXTRAS,test"
# What the install depends on (the built kernels included); when that is unchanged since the
# last install here with these extras or more, pip is skipped (~10 s).
STAMP="$VENV/.psgrad-installed"
installed_from() {
  echo "$(pwd) $(cat setup.cfg setup.py pyproject.toml psgrad/codecs/_kernels.c | sha256sum | cut -c1-16)" \
    "$(cd psgrad/codecs && ls _kernels*.so 2>/dev/null | tr '\n' ' ')"
}
up_to_date() {
  [ -f "$STAMP" ] && [ "$(head -n 1 "$STAMP")" = "$(installed_from)" ] || return 1
  local extra
  for extra in ${EXTRAS//,/ }; do grep -qx "$extra" <(tail -n +2 "$STAMP") || return 1; done
}
if ! up_to_date; then
  echo "[setup] installing psgrad[$EXTRAS]"
  rm -f "$STAMP"
  "${PIP[@]}" -e ".[$EXTRAS]" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
fi
# Byte-code for psgrad's own modules (an editable install leaves none): with PYTHONDONTWRITEBYTECODE
# set, as on some CI machines, every process would compile them again (~0.5 s, each MPI rank).
# compileall redoes only the files changed since; a stale .pyc is never used, only recompiled.
"$VENV/bin/python" -m compileall -q -j 0 psgrad > /dev/null
READY="$("$VENV/bin/python" -c 'import torch, mpi4py.MPI as M; from psgrad.codecs import kernels_name; print("torch", torch.__version__, "|", M.Get_library_version().splitlines()[0], "|", kernels_name(), "codec kernels")')" \
  || { rm -f "$STAMP"; echo "[setup] psgrad, torch or mpi4py failed to import"; exit 1; }
[ -f "$STAMP" ] || { installed_from; tr ',' '\n' <<< "$EXTRAS"; } > "$STAMP"
echo "[setup] ready: $VENV ($READY)"
