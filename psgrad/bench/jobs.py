"""Starting one mpiexec job of ``psgrad bench``: which mpiexec, the flags it needs as root, and
running it to its end, a timeout or a Ctrl-C, with its output kept for the error (and ``--log-dir``)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from .netshape import mpiexec_banner


class BenchError(RuntimeError):
    """A bench job failed or overran; the message carries its output, ``reason`` the one line
    that says why (a rank's own error line when the job printed one)."""

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message.splitlines()[0]


def find_mpiexec(given: str | None) -> str:
    """``given``, else the mpiexec beside this Python (the pip mpich), else the one on PATH."""
    if given:
        return given
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise BenchError("no mpiexec found: run bash launch/setup.sh (pip mpich) or pass --mpiexec PATH")
    return found


OPENMPI_ROOT_FLAGS = ("--allow-run-as-root", "--oversubscribe")


def is_open_mpi(mpiexec: str) -> bool:
    """Whether ``mpiexec --version`` names Open MPI (4: "OpenRTE", 5: "Open MPI")."""
    try:
        version = mpiexec_banner(mpiexec)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in version or "OpenRTE" in version


def launcher_args(mpiexec: str, given: list[str]) -> list[str]:
    """The extra mpiexec arguments of every job: ``given``, and as root under Open MPI also
    ``--allow-run-as-root --oversubscribe`` (as launch/mpirun.sh adds them): Open MPI refuses to
    start as root without the first, and without the second a job may not use more ranks than
    the machine has cores, which a bench row of 1 server + 2 workers on 2 cores needs."""
    if os.geteuid() != 0 or not is_open_mpi(mpiexec):
        return given
    return [*given, *(flag for flag in OPENMPI_ROOT_FLAGS if flag not in given)]


def run_job(
    cmd: list[str],
    env: dict[str, str],
    timeout: float,
    *,
    log: Path | None = None,
    on_line: Callable[[str], None] | None = None,
) -> None:
    """Run one mpiexec job in its own process group; on timeout or Ctrl-C end the whole group.
    ``log``: where its output goes as well, whatever the end; ``on_line``: called with each line
    of its output as it comes (a run to an accuracy takes hours: its progress)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    chunks: list[bytes] = []
    reader = threading.Thread(target=_read, args=(proc.stdout, chunks, on_line), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
        reader.join(timeout=_GRACE)  # a rank that outlives mpiexec holds the pipe: it goes below
    except BaseException as err:
        _end_group(proc)
        reader.join(timeout=_GRACE)
        out = b"".join(chunks)
        _keep(log, out)
        if isinstance(err, subprocess.TimeoutExpired):
            raise BenchError(
                f"timed out after {timeout:.0f} s (raise --job-timeout for longer jobs): {shlex.join(cmd)}\n{_tail(out)}",
                reason=f"timed out after {timeout:.0f} s (raise --job-timeout for longer jobs)",
            ) from None
        raise
    if reader.is_alive():
        _end_group(proc)
        reader.join(timeout=_GRACE)
    out = b"".join(chunks)
    _keep(log, out)
    if proc.returncode != 0:
        raise BenchError(
            f"exit status {proc.returncode}: {shlex.join(cmd)}\n{_tail(out)}",
            reason=_said(out) or f"exit status {proc.returncode}",
        )


_GRACE = 5.0
"""Seconds a job's process group gets after SIGTERM, and its output after the job ended."""


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the job's whole process group, each with ``_GRACE`` to end."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=_GRACE)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def _read(stream, chunks: list[bytes], on_line: Callable[[str], None] | None) -> None:
    """The job's output, line by line, into ``chunks`` and to ``on_line``, until it ends."""
    for line in iter(stream.readline, b""):
        chunks.append(line)
        if on_line is not None:
            try:
                on_line(line.decode(errors="replace").rstrip("\n"))
            except Exception:  # noqa: BLE001  progress must not stop the reading: the job would block on a full pipe
                pass


def _keep(log: Path | None, out: bytes | None) -> None:
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_bytes(out or b"")


def row_log_dir(base: str | None, index: int, round_: int, item: str) -> str | None:
    """``--log-dir``: the folder of the ``index``-th job, BASE/NN-rR-ROW (the row's spec, made a name)."""
    if base is None:
        return None
    return str(Path(base) / f"{index:02d}-r{round_ + 1}-{re.sub(r'[^A-Za-z0-9=.,:-]+', '_', item).strip('_')[:80]}")


def _said(out: bytes | None) -> str | None:
    """The line in which a failing rank said why (``[psgrad rank N] ...``: runtime/failure.py,
    the agreement), a rank's own failure before the peers it took down; None when the job died
    without one (a crash, a killed rank)."""
    said = [
        line.strip() for line in (out or b"").decode(errors="replace").splitlines() if line.startswith("[psgrad rank ")
    ]
    own = [line for line in said if "PeerFailure" not in line]
    return (own or said or [None])[0]


def _tail(out: bytes | None, lines: int = 40) -> str:
    return "\n".join((out or b"").decode(errors="replace").splitlines()[-lines:])
