"""Start a failed job again from its newest complete checkpoint: ``launch/mpirun.sh --max-restarts K``.

``python -m psgrad.runtime.restarts --max-restarts K [--restart-from-scratch] -- COMMAND...``
runs COMMAND (an ``mpiexec`` or ``srun`` line of ``psgrad train … --log-dir DIR``) and supervises it:

1. It ends with status 0: done.
2. The supervisor itself was stopped (Ctrl-C, SIGTERM, which it passes on to the job): end with
   the signal's status, no restart.
3. Status 2 (a usage error), 3 (a gradient that is not finite) or 4 (a checkpoint that cannot be
   written or resumed from; runtime/exits.py): starting again would fail the same way. End with that status.
4. Any other failure (a rank killed, crashed or cut off): read the first failure the job recorded
   in ``DIR/failures.jsonl`` (runtime/sentinel.py, 7: which rank, in which step, how) and find
   DIR's newest complete checkpoint.
   - The failure came after training ended (``model.pt`` written): the run is complete; end with 0.
   - No restart left: end with ``GAVE_UP``.
   - A checkpoint: say one line (the rank, the step, the checkpoint) and run COMMAND again with
     ``--resume DIR`` in place of any ``--resume``/``--overwrite``. psgrad's resume is bit-exact,
     so the run ends with the model an uninterrupted one would have.
   - None: with ``--restart-from-scratch``, run COMMAND again with ``--overwrite``; otherwise end
     with ``NO_CHECKPOINT``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import CheckpointError, resolve, step_of
from .exits import GAVE_UP, NO_CHECKPOINT, USAGE, WOULD_FAIL_AGAIN
from .sentinel import FAILURES


@dataclass(frozen=True)
class Failure:
    """The first failure a job recorded (``failures.jsonl``), or what its status says without one."""

    rank: int | None = None
    role: str = ""
    step: int | None = None
    how: str = ""
    reason: str = ""

    def describe(self, status: int) -> str:
        if self.rank is None:
            return f"the job failed with status {status} (no rank recorded why)"
        where = f" in step {self.step}" if self.step is not None else ""
        return f"rank {self.rank} ({self.role}) {self.how}{where}: {self.reason}"


def log_dir_of(command: Sequence[str]) -> str | None:
    """The ``--log-dir`` of COMMAND (``--log-dir DIR`` or ``--log-dir=DIR``; the last one given)."""
    found = None
    for i, word in enumerate(command):
        if word == "--log-dir" and i + 1 < len(command):
            found = command[i + 1]
        elif word.startswith("--log-dir="):
            found = word.split("=", 1)[1]
    return found


def _without(command: Sequence[str], flag: str, *, takes_value: bool) -> list[str]:
    """COMMAND without ``flag`` (and its value, ``flag VALUE`` or ``flag=VALUE``)."""
    kept, skip = [], False
    for word in command:
        if skip:
            skip = False
        elif word == flag:
            skip = takes_value
        elif not (takes_value and word.startswith(flag + "=")):
            kept.append(word)
    return kept


def again(command: Sequence[str], *, add: Sequence[str]) -> list[str]:
    """COMMAND without its ``--resume`` and ``--overwrite``, with ``add`` at the end of each part
    of an MPMD launch (parts are separated by a lone ``:``)."""
    words = _without(_without(command, "--resume", takes_value=True), "--overwrite", takes_value=False)
    words = [w for w in words if w != "--no-overwrite"]
    out: list[str] = []
    for word in words:
        if word == ":":
            out += [*add, word]
        else:
            out.append(word)
    return [*out, *add]


def first_failure(record: Path, *, since: int) -> Failure:
    """The first failure written to ``record`` after byte ``since`` (an empty ``Failure`` if none)."""
    try:
        with open(record, "rb") as f:
            f.seek(since)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return Failure()
    for line in lines:
        try:
            fields = json.loads(line)
            return Failure(
                rank=int(fields["rank"]),
                role=str(fields.get("role", "")),
                step=None if fields.get("step") is None else int(fields["step"]),
                how=str(fields.get("how", "failed")),
                reason=str(fields.get("reason", "")),
            )
        except (ValueError, KeyError, TypeError):
            continue
    return Failure()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class Supervisor:
    """Runs a command; a SIGTERM or SIGINT to this process stops the restarts, and a SIGTERM is
    passed on to the job (a Ctrl-C reaches it through the terminal's process group). A context
    manager: the process's own handlers come back at its end."""

    def __init__(self) -> None:
        self.stopped: int | None = None
        self.child: subprocess.Popen | None = None
        self._before: dict[int, object] = {}

    def __enter__(self) -> Supervisor:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._before[signum] = signal.signal(signum, self._stop)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._before.items():
            signal.signal(signum, handler)

    def _stop(self, signum: int, _frame: object) -> None:
        first = self.stopped is None
        self.stopped = signum
        # Ctrl-C at a terminal reaches the whole process group, mpiexec included: pass on only a
        # SIGTERM (a second SIGINT makes mpiexec kill the ranks before they say where they stopped)
        if first and self.child is not None and signum == signal.SIGTERM:
            self.child.send_signal(signum)

    def run(self, command: Sequence[str]) -> int:
        self.child = subprocess.Popen(list(command))
        try:
            return self.child.wait()
        finally:
            self.child = None


def say(line: str) -> None:
    print(f"[psgrad restart] {line}", file=sys.stderr, flush=True)


def supervise(command: Sequence[str], *, max_restarts: int, from_scratch: bool) -> int:
    """Run ``command`` until it succeeds, fails for good, or ``max_restarts`` restarts are used
    (module docstring); return the exit status to end with."""
    log_dir = log_dir_of(command)
    if log_dir is None:
        say(
            "--max-restarts needs the training command's --log-dir DIR: the checkpoints a restart resumes from are there"
        )
        return USAGE
    with Supervisor() as supervisor:
        return _restarts(supervisor, command, log_dir=log_dir, max_restarts=max_restarts, from_scratch=from_scratch)


def _restarts(
    supervisor: Supervisor, command: Sequence[str], *, log_dir: str, max_restarts: int, from_scratch: bool
) -> int:
    """``supervise``'s loop, under ``supervisor``."""
    record = Path(log_dir) / FAILURES
    current, restarts = list(command), 0
    while True:
        since = _size(record)
        status = supervisor.run(current)
        if supervisor.stopped is not None:
            say(f"stopped by signal {supervisor.stopped}: not restarting")
            return 128 + supervisor.stopped
        if status == 0:
            return 0
        if status in WOULD_FAIL_AGAIN:
            if restarts or status != USAGE:
                say(
                    f"not restarting after {WOULD_FAIL_AGAIN[status]} (status {status}): it would fail the same way again"
                )
            return status
        failure = first_failure(record, since=since)
        what = failure.describe(status if status >= 0 else 128 - status)
        if "after its training ended" in failure.reason and (Path(log_dir) / "model.pt").is_file():
            say(f"{what}; training had ended and {log_dir}/model.pt is written: the run is complete")
            return 0
        if restarts >= max_restarts:
            say(f"{what}; giving up after {max_restarts} restart(s) (status {GAVE_UP})")
            return GAVE_UP
        restarts += 1
        try:
            newest = resolve(log_dir)
        except CheckpointError:
            if not from_scratch:
                say(
                    f"{what}; {log_dir} holds no complete checkpoint to resume from: not restarting (status "
                    f"{NO_CHECKPOINT}; --restart-from-scratch starts such a run again from step 0)"
                )
                return NO_CHECKPOINT
            say(f"restart {restarts} of {max_restarts}: {what}; no checkpoint yet: starting again from step 0")
            current = again(command, add=["--overwrite"])
            continue
        lost = ""
        if failure.step is not None:
            lost = f", {max(0, failure.step - step_of(newest))} step(s) to train again"
        say(f"restart {restarts} of {max_restarts}: {what}; resuming from {newest}{lost}")
        current = again(command, add=["--resume", log_dir])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m psgrad.runtime.restarts",
        description="Run a psgrad training job; when it fails, start it again from the newest complete checkpoint "
        "in its --log-dir (launch/mpirun.sh --max-restarts).",
    )
    parser.add_argument("--max-restarts", type=int, required=True, help="Restarts at most (>= 0).")
    parser.add_argument(
        "--restart-from-scratch",
        action="store_true",
        help="Restart a job that failed before its first complete checkpoint from step 0 (with --overwrite).",
    )
    parser.add_argument(
        "--remove-when-done",
        metavar="FILE",
        help="A temporary file of the launcher's (its translated hostfile) to remove once the job is over.",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launch command.")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.max_restarts < 0 or not command:
        parser.error("--max-restarts must be >= 0 and a command must follow --")
    try:
        return supervise(command, max_restarts=args.max_restarts, from_scratch=args.restart_from_scratch)
    finally:
        if args.remove_when_done:
            Path(args.remove_when_done).unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
