#!/usr/bin/env bash
# Start a psgrad job over the nodes of a hostfile, with whichever MPI is on PATH (or the venv's
# pip MPICH): MPICH / Intel MPI (hydra) or Open MPI 4 / 5.
#
#   launch/mpirun.sh [--dry-run] [--ranks-per-node G] [--server-node shared|own]
#                    [--max-restarts K [--restart-from-scratch]] HOSTFILE NRANKS COMMAND...
#
# HOSTFILE: one node a line, in either syntax — "node0", "node0 slots=4" (Open MPI) or "node0:4"
#   (MPICH); '#' starts a comment. It is translated into the syntax of the MPI found.
# --ranks-per-node G: G ranks on every node (one per GPU: each worker takes cuda:<its index among the node's workers>),
#   in place of the hostfile's slot counts; without it each node takes its hostfile count (else 1).
#   Rank 0, the parameter server, shares node 0 with G - 1 workers (--server-node shared).
# --server-node own: the first node runs the server alone (it may be a CPU-only node: the server
#   takes no GPU), the others G workers each; NRANKS = 1 + G x (nodes - 1).
# --max-restarts K: when the job fails (a rank killed, crashed, cut off), start it again with
#   --resume LOG_DIR from the newest complete checkpoint of the command's --log-dir, up to K times;
#   one line per restart names the rank, the step and the checkpoint. A usage error (status 2), a
#   gradient that is not finite (3) or a checkpoint problem or full disk (4) is never restarted; 5: failed
#   again after K restarts; 6: failed before its first checkpoint (--restart-from-scratch starts
#   such a job again from step 0). docs/launch.md, "Failures".
# --dry-run: print the translated hostfile and the command instead of running it.
# MPIEXEC=path picks the launcher. As root, Open MPI also gets --allow-run-as-root --oversubscribe.
set -euo pipefail
usage() { sed -n '5,22p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "launch/mpirun.sh: $*" >&2; exit 2; }

DRY=0; PER_NODE=1; PER_NODE_SET=0; SERVER=shared; RESTARTS=""; SCRATCH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --ranks-per-node) [ $# -ge 2 ] || usage; PER_NODE="$2"; PER_NODE_SET=1; shift 2 ;;
    --server-node) [ $# -ge 2 ] || usage; SERVER="$2"; shift 2 ;;
    --max-restarts) [ $# -ge 2 ] || usage; RESTARTS="$2"; shift 2 ;;
    --restart-from-scratch) SCRATCH=1; shift ;;
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
[ -z "$RESTARTS" ] || [[ "$RESTARTS" =~ ^[0-9]+$ ]] || die "--max-restarts must be a whole number, got '$RESTARTS'"
[ "$SCRATCH" = 0 ] || [ -n "$RESTARTS" ] || die "--restart-from-scratch needs --max-restarts K"
if [ -n "$RESTARTS" ]; then
  found=0; for word in "$@"; do case "$word" in --log-dir|--log-dir=*) found=1 ;; esac; done
  [ "$found" = 1 ] || die "--max-restarts needs the command's --log-dir DIR (where the checkpoints it resumes from are)"
fi
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

# Nodes of the hostfile, whatever its syntax, and the slots each line gives ("node0 slots=4",
# "node0:4"; none: empty). --ranks-per-node replaces them; without it they are honoured.
NODES=(); GIVEN=()
while IFS= read -r line || [ -n "$line" ]; do
  line="${line%%#*}"; read -r first rest <<<"$line" || true
  [ -n "${first:-}" ] || continue
  NODES+=("${first%%:*}")
  given=""; counted=0
  if [[ "$first" == *:* ]]; then given="${first##*:}"; counted=1
  elif [[ "${rest:-}" =~ slots=([^[:space:]]*) ]]; then given="${BASH_REMATCH[1]}"; counted=1; fi
  [ "$counted" = 0 ] || [[ "$given" =~ ^[1-9][0-9]*$ ]] || die "hostfile '$HOSTS': bad slot count '$given' for ${first%%:*}"
  GIVEN+=("$given")
done <"$HOSTS"
[ ${#NODES[@]} -gt 0 ] || die "hostfile '$HOSTS' names no node"

SLOTS=(); FROM_HOSTFILE=0
for i in "${!NODES[@]}"; do
  if [ "$SERVER" = own ] && [ "$i" = 0 ]; then SLOTS+=(1)
  elif [ "$PER_NODE_SET" = 0 ] && [ -n "${GIVEN[$i]}" ]; then SLOTS+=("${GIVEN[$i]}"); FROM_HOSTFILE=1
  else SLOTS+=("$PER_NODE"); fi
done
CAPACITY=0; for s in "${SLOTS[@]}"; do CAPACITY=$((CAPACITY + s)); done
if [ "$N" -gt "$CAPACITY" ]; then
  if [ "$PER_NODE_SET" = 1 ]; then why="--ranks-per-node $PER_NODE replaces the hostfile's slot counts"
  elif [ "$FROM_HOSTFILE" = 1 ]; then why="the hostfile's slot counts; --ranks-per-node G sets G on every node"
  else why="one rank a node; --ranks-per-node G sets G"; fi
  die "$N ranks do not fit: ${#NODES[@]} nodes give $CAPACITY slots ($why)"
fi

TRANSLATED="$(mktemp "${TMPDIR:-/tmp}/psgrad-hosts.XXXXXX")"
[ "$DRY" = 1 ] || trap 'rm -f "$TRANSLATED"' EXIT  # a dry run keeps it: the command it prints names it
for i in "${!NODES[@]}"; do
  if [ "$FLAVOR" = openmpi ]; then echo "${NODES[$i]} slots=${SLOTS[$i]}"; else echo "${NODES[$i]}:${SLOTS[$i]}"; fi
done >"$TRANSLATED"

if [ "$FLAVOR" = openmpi ]; then
  CMD=("$MPIEXEC")
  [ "$(id -u)" = 0 ] && CMD+=(--allow-run-as-root --oversubscribe)
  if [ "$SERVER" = own ] || [ "$FROM_HOSTFILE" = 1 ]; then CMD+=(--map-by slot); else CMD+=(--map-by "ppr:$PER_NODE:node"); fi
  CMD+=(-n "$N" --hostfile "$TRANSLATED" -x PATH -x OMP_NUM_THREADS=1 "$@")
else
  CMD=("$MPIEXEC" -n "$N" -f "$TRANSLATED")
  [ "$SERVER" = own ] || [ "$FROM_HOSTFILE" = 1 ] || CMD+=(-ppn "$PER_NODE")
  CMD+=(-genv OMP_NUM_THREADS 1 "$@")
fi

if [ -n "$RESTARTS" ]; then  # the supervisor runs the job and starts it again (psgrad/runtime/restarts.py)
  PYTHON="${PSGRAD_PYTHON:-$( [ -x "$HERE/.venv/bin/python" ] && echo "$HERE/.venv/bin/python" || command -v python3)}"
  SUPERVISE=("$PYTHON" -m psgrad.runtime.restarts --max-restarts "$RESTARTS" --remove-when-done "$TRANSLATED")
  [ "$SCRATCH" = 1 ] && SUPERVISE+=(--restart-from-scratch)
  CMD=("${SUPERVISE[@]}" -- "${CMD[@]}")
fi

if [ "$DRY" = 1 ]; then
  echo "# $FLAVOR hostfile $TRANSLATED (kept for the command below):"
  sed 's/^/#   /' "$TRANSLATED"
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
if [ -n "$RESTARTS" ]; then  # signals must reach the supervisor itself; it removes the hostfile when done
  trap - EXIT
  exec "${CMD[@]}"
fi
"${CMD[@]}"
