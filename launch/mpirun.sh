#!/usr/bin/env bash
# Start a psgrad job over the nodes of a hostfile, with whichever MPI is on PATH (or the venv's
# pip MPICH): MPICH / Intel MPI (hydra) or Open MPI 4 / 5.
#
#   launch/mpirun.sh [--dry-run] [--ranks-per-node G] [--server-node shared|own] HOSTFILE NRANKS COMMAND...
#
# HOSTFILE: one node a line, in either syntax — "node0", "node0 slots=4" (Open MPI) or "node0:4"
#   (MPICH); '#' starts a comment. It is translated into the syntax of the MPI found.
# --ranks-per-node G: G ranks on every node (one per GPU: each worker takes cuda:<its index among the node's workers>).
#   Default 1. Rank 0, the parameter server, shares node 0 with G - 1 workers (--server-node shared).
# --server-node own: the first node runs the server alone (it may be a CPU-only node: the server
#   takes no GPU), the others G workers each; NRANKS = 1 + G x (nodes - 1).
# --dry-run: print the translated hostfile and the command instead of running it.
# MPIEXEC=path picks the launcher. As root, Open MPI also gets --allow-run-as-root --oversubscribe.
set -euo pipefail
usage() { sed -n '5,14p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "launch/mpirun.sh: $*" >&2; exit 2; }

DRY=0; PER_NODE=1; SERVER=shared
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --ranks-per-node) [ $# -ge 2 ] || usage; PER_NODE="$2"; shift 2 ;;
    --server-node) [ $# -ge 2 ] || usage; SERVER="$2"; shift 2 ;;
    -h|--help) usage ;;
    --) shift; break ;;
    -*) die "unknown option $1" ;;
    *) break ;;
  esac
done
[ $# -ge 3 ] || usage
HOSTS="$1"; N="$2"; shift 2
[[ "$PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "--ranks-per-node must be a positive integer, got '$PER_NODE'"
[[ "$N" =~ ^[1-9][0-9]*$ ]] || die "NRANKS must be a positive integer, got '$N'"
case "$SERVER" in shared|own) ;; *) die "--server-node must be shared or own, got '$SERVER'" ;; esac
[ -r "$HOSTS" ] || die "cannot read hostfile '$HOSTS'"

HERE="$(cd "$(dirname "$0")/.." && pwd)"
MPIEXEC="${MPIEXEC:-$(command -v mpiexec || echo "$HERE/.venv/bin/mpiexec")}"
[ -x "$MPIEXEC" ] || command -v "$MPIEXEC" >/dev/null || die "no mpiexec: install MPI or run 'bash launch/setup.sh'"

# Open MPI 4 says "mpiexec (OpenRTE) 4.x", Open MPI 5 "mpiexec (Open MPI) 5.x"; hydra (MPICH,
# Intel MPI) prints "HYDRA build details".
VERSION="$("$MPIEXEC" --version 2>&1 || true)"
if grep -qiE "open mpi|openrte" <<<"$VERSION"; then FLAVOR=openmpi
elif grep -qi "hydra" <<<"$VERSION"; then FLAVOR=hydra
else die "cannot tell which MPI '$MPIEXEC' is (neither Open MPI nor MPICH/Intel MPI): $(head -1 <<<"$VERSION")"
fi

# Nodes of the hostfile, whatever its syntax (slot counts are replaced by the layout asked for).
NODES=()
while IFS= read -r line || [ -n "$line" ]; do
  line="${line%%#*}"; read -r first _ <<<"$line" || true
  [ -n "${first:-}" ] || continue
  NODES+=("${first%%:*}")
done <"$HOSTS"
[ ${#NODES[@]} -gt 0 ] || die "hostfile '$HOSTS' names no node"

SLOTS=()
for i in "${!NODES[@]}"; do
  if [ "$SERVER" = own ] && [ "$i" = 0 ]; then SLOTS+=(1); else SLOTS+=("$PER_NODE"); fi
done
CAPACITY=0; for s in "${SLOTS[@]}"; do CAPACITY=$((CAPACITY + s)); done
if [ "$N" -gt "$CAPACITY" ]; then
  die "$N ranks do not fit: ${#NODES[@]} nodes x the layout give $CAPACITY slots (check --ranks-per-node)"
fi

TRANSLATED="$(mktemp "${TMPDIR:-/tmp}/psgrad-hosts.XXXXXX")"
trap 'rm -f "$TRANSLATED"' EXIT
for i in "${!NODES[@]}"; do
  if [ "$FLAVOR" = openmpi ]; then echo "${NODES[$i]} slots=${SLOTS[$i]}"; else echo "${NODES[$i]}:${SLOTS[$i]}"; fi
done >"$TRANSLATED"

if [ "$FLAVOR" = openmpi ]; then
  CMD=("$MPIEXEC")
  [ "$(id -u)" = 0 ] && CMD+=(--allow-run-as-root --oversubscribe)
  if [ "$SERVER" = own ]; then CMD+=(--map-by slot); else CMD+=(--map-by "ppr:$PER_NODE:node"); fi
  CMD+=(-n "$N" --hostfile "$TRANSLATED" -x PATH -x OMP_NUM_THREADS=1 "$@")
else
  CMD=("$MPIEXEC" -n "$N" -f "$TRANSLATED")
  [ "$SERVER" = own ] || CMD+=(-ppn "$PER_NODE")
  CMD+=(-genv OMP_NUM_THREADS 1 "$@")
fi

if [ "$DRY" = 1 ]; then
  echo "# $FLAVOR hostfile $TRANSLATED:"
  sed 's/^/#   /' "$TRANSLATED"
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
"${CMD[@]}"
