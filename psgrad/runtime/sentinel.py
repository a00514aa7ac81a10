"""Names the rank that died first, when the launcher's cleanup leaves no one else to say it.

When one rank is SIGKILLed (or crashes, or is OOM-killed), mpiexec kills every other rank at
once, and its own message names whichever process it reaped first — often not the one that died.
No survivor lives long enough to notice anything. So each rank starts a tiny sentinel process:
1. The rank holds the write end of the sentinel's stdin; the sentinel blocks reading it.
2. A rank that ends cleanly writes ``bye`` first; the sentinel exits silently.
3. A rank that dies closes the pipe without ``bye`` (the kernel closes a dying process's files
   before its parent, the launcher, hears of the death). The sentinel then claims the job's
   *first death* file with an exclusive create; only the first claimant prints, naming its rank.
   The ranks the launcher killed afterwards find the claim taken and stay silent. The claimant
   then closes its copy of the job's output (mpiexec waits for every copy) and removes the
   claim 10 s later, once the other sentinels have seen it.
4. A rank that aborts the job deliberately (psgrad's own error or watchdog verdict) claims the
   file itself before aborting, so the ranks the abort takes down stay silent too.
   Either way, a rank that ends without ``bye`` cannot finalize MPI: the sentinel removes the MPI
   library's shared-memory segments the rank named when it started (``shm PATH`` lines,
   runtime/segments.py), which MPI_Finalize would have removed.
5. In a process that ends with its job (``psgrad train``, a ``psgrad bench`` job:
   ``hold_goodbyes()``), the goodbye at the end of training is only ``done``; ``bye`` follows
   from ``farewell()``, right after MPI_Finalize. A rank that dies in between (in the final
   barrier, MPI_Finalize or the interpreter's teardown) is named too, as having died after its
   training ended. A process that goes on after ``train.run`` (a script, the test suite) says
   ``bye`` at once: its sentinel must not outlive the job.
6. A rank of a multi-rank launch starts its sentinel as its first act (``start_early``), before
   it imports torch or starts MPI, and the watchdog adopts it later with the job's claim file
   (``job`` line). Until then the sentinel reads the rank's /proc/PID/maps every
   ``POLL_SECONDS``, and on Linux the moment a file is created in /dev/shm (inotify), for the
   MPI library's segments until it sees them (MPI maps them once, as it starts), and removes
   them if the rank dies:
   a rank killed while MPI starts, or one the launcher kills in ``MPI_Init`` because another
   rank died before it got there, once left MPICH's file in /dev/shm for good (no code of
   psgrad's runs in ``MPI_Init``). It names no one: before the job agrees on a claim file there
   is no first death to settle. A rank that leaves normally before adoption says ``bye`` at exit.

The claim file lives in the log dir when there is one (shared between nodes on most clusters),
else in the node's temp dir (then each node may name its own first).

7. With a log dir, whoever claims the first death also appends one JSON line to the log dir's
   ``failures.jsonl``: the rank, its role, the step it was in (the rank tells its sentinel each
   step it starts, ``at_step``), ``how`` ("died" or "aborted") and the reason. It is written
   before the claimant lets go of the job's output, so it is there when mpiexec returns:
   ``launch/mpirun.sh --max-restarts`` reads it to say which rank failed where
   (psgrad/runtime/restarts.py).

The sentinel runs this file as a script (stdlib only: no torch, ~10 MB, ~20 ms to start):
``python -I sentinel.py PID [CLAIM RANK ROLE RECORD]`` (without the claim: started early, see 6;
RECORD empty without a log dir).
"""

from __future__ import annotations

import atexit
import datetime
import importlib.util
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

_BYE = b"bye\n"
_SEGMENT = b"shm "
_ABORT = b"abort\n"
_DONE = b"done\n"
_JOB = b"job "
_STEP = b"step "
FAILURES = "failures.jsonl"
_TIDY_AFTER = 10.0  # seconds: the other ranks' sentinels check the claim within milliseconds
POLL_SECONDS = 0.02  # an early sentinel's look at the rank's maps (0.7 ms a look), until it sees its segments


def claim(path: str | Path, text: str) -> bool:
    """Create ``path`` holding ``text`` unless it exists; True if this call created it."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return True  # cannot coordinate (read-only dir): better a line too many than none
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError:  # a full disk: the empty file claims as well, and the rank must go on to abort
        pass
    return True


def record_failure(path: str | Path | None, **fields: object) -> None:
    """Append ``fields`` as one JSON line to ``path`` (the log dir's ``failures.jsonl``; nothing
    without one). Best effort: a full disk must not keep a failing rank from aborting."""
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(json.dumps(fields) + "\n")
    except OSError:
        pass


_held: list[Sentinel] = []  # sentinels told "done", waiting for farewell()
_holding = False


def hold_goodbyes() -> None:
    """This process ends when its job does: from now on a rank's goodbye waits for ``farewell()``
    (which also runs at interpreter exit, for a process that leaves without calling it)."""
    global _holding
    if not _holding:
        _holding = True
        atexit.register(farewell)


def goodbyes_held() -> bool:
    """Whether a sentinel of this process waits for ``farewell()``."""
    return bool(_held)


def farewell() -> None:
    """The process is about to leave, its MPI finalized: every held sentinel hears ``bye``."""
    while _held:
        _held.pop()._tell(_BYE)


_early: Sentinel | None = None  # started before MPI, not yet adopted


def start_early() -> None:
    """Start this rank's sentinel now, before MPI starts (module docstring, 6); the watchdog adopts
    it (``adopt_early``). A process that leaves before that, normally, says goodbye at exit."""
    global _early
    if _early is None:
        _early = Sentinel(None)
        atexit.register(_leave_unadopted)


def adopt_early(
    claim_path: Path, *, rank: int, role: str, segments: Sequence[str], record: Path | None = None
) -> Sentinel | None:
    """The sentinel ``start_early`` started, now told the job (``Sentinel.adopt``), or None if there
    is none (a script that calls ``train.run`` itself; a second run in one process)."""
    global _early
    early, _early = _early, None
    if early is not None:
        early.adopt(claim_path, rank=rank, role=role, segments=segments, record=record)
    return early


def _leave_unadopted() -> None:
    if _early is not None:
        _early._tell(_BYE)


class Sentinel:
    """The rank's side: start the process, then ``bye()`` on a clean end or ``claim()`` before a
    deliberate abort."""

    def __init__(
        self,
        claim_path: Path | None,
        *,
        rank: int = -1,
        role: str = "",
        segments: Sequence[str] = (),
        record: Path | None = None,
    ) -> None:
        """``segments``: the MPI library's shared-memory files of the job, removed if the rank dies;
        ``record``: the log dir's ``failures.jsonl`` (module docstring, 7), or None.
        Without ``claim_path`` the sentinel starts early (module docstring, 6): ``adopt`` it later."""
        self.claim_path, self.rank, self.role, self.record = claim_path, rank, role, record
        self.step: int | None = None
        job = [] if claim_path is None else [str(claim_path), str(rank), role, str(record or "")]
        self.proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), *job],
            stdin=subprocess.PIPE,
            start_new_session=True,  # the launcher's cleanup kills the rank's process group, not this
            close_fds=True,
        )
        self._name(segments)

    def adopt(
        self, claim_path: Path, *, rank: int, role: str, segments: Sequence[str] = (), record: Path | None = None
    ) -> None:
        """An early sentinel learns the job's claim file, the rank, its segments and the failure
        record: from now on it is what ``Sentinel(claim_path, rank=..., role=..., ...)``
        would have started."""
        self.claim_path, self.rank, self.role, self.record = claim_path, rank, role, record
        fields = (os.fsencode(str(claim_path)), str(rank).encode(), role.encode(), os.fsencode(str(record or "")))
        self._tell(_JOB + b"\t".join(fields) + b"\n", last=False)
        self._name(segments)

    def _name(self, segments: Sequence[str]) -> None:
        if segments:
            self._tell(b"".join(_SEGMENT + os.fsencode(path) + b"\n" for path in segments), last=False)

    def _tell(self, word: bytes, last: bool = True) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write(word)
                if last:
                    self.proc.stdin.close()
                else:
                    self.proc.stdin.flush()
            except OSError:
                pass

    def at_step(self, step: int) -> None:
        """The rank starts training step ``step`` (a failure record names it)."""
        self.step = step
        self._tell(_STEP + str(step).encode() + b"\n", last=False)

    def bye(self) -> None:
        """The rank's work ended cleanly (see the module docstring for a held goodbye)."""
        if _holding:
            self._tell(_DONE, last=False)
            _held.append(self)
        else:
            self._tell(_BYE)

    def claim(self, reason: str) -> bool:
        """This rank ends the job on purpose: take the claim so no sentinel blames its victims
        (the sentinel removes the claim file a little later). True if this rank claimed first."""
        first = self.claim_path is not None and claim(self.claim_path, f"rank {self.rank}: {reason}\n")
        if first:
            record_failure(self.record, rank=self.rank, role=self.role, step=self.step, how="aborted", reason=reason)
        self._tell(_ABORT)
        return first


def _watch(pid: str, job: Sequence[str] = ()) -> None:
    """The sentinel's side: read the rank's words until it closes the pipe (or dies); an early
    sentinel (no ``job``: claim path, rank, role, failure record) looks at the rank's segments
    meanwhile, until it is adopted."""
    claim_path, rank, role, record = (*job, "", "", "")[:4] if job else (None, "", "", "")  # record may be left out
    segments = _segments_module()
    words: list[bytes] = []
    step: int | None = None  # the last step the rank started (kept apart: one word a step)
    seen: list[str] = []  # an early sentinel's look at the rank's segments
    pending = b""
    stdin = sys.stdin.fileno()
    started = time.monotonic()
    creations = _creations(segments.SHM_DIR) if claim_path is None else None
    soon = False  # a file was just created there: look again in a moment (MPI maps it right after)
    while True:
        if creations is not None and (claim_path is not None or seen):  # no more looks: its events would pile up
            os.close(creations)
            creations = None
        if claim_path is None and not seen:  # started early, not adopted, nothing seen yet: look
            # (an MPI that maps no such file, Open MPI, is looked at less often after a minute)
            wait = 0.001 if soon else POLL_SECONDS if time.monotonic() - started < 60 else 1.0
            ready = select.select([stdin] if creations is None else [stdin, creations], [], [], wait)[0]
            soon = creations is not None and creations in ready
            if soon:
                _drain(creations)
            if stdin not in ready:
                seen = segments.job_segments(f"/proc/{pid}/maps")
                continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:  # the rank closed the pipe, or died
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if line.startswith(_STEP):
                step = int(line[len(_STEP) :])
            elif line.startswith(_JOB):
                claim_path, rank, role, record = (os.fsdecode(field) for field in line[len(_JOB) :].split(b"\t"))
            else:
                words.append(line + b"\n")
    if words[-1:] == [_BYE]:
        return
    told = [os.fsdecode(word[len(_SEGMENT) :].rstrip(b"\n")) for word in words if word.startswith(_SEGMENT)]
    segments.remove(told or seen)  # MPI_Finalize, which removes them, will not run (runtime/segments.py)
    if claim_path is None:  # died before the job agreed on a claim file: there is no first death to settle
        return
    _settle_death(words, pid=pid, claim_path=claim_path, rank=rank, role=role, step=step, record=record)


def _settle_death(
    words: list[bytes], *, pid: str, claim_path: str, rank: str, role: str, step: int | None, record: str
) -> None:
    """A rank died with the job's claim file agreed: unless it ended the job on purpose, claim
    the first death, record it (module docstring, 7) and say which rank died when, then tidy up
    and remove the claim."""
    if _ABORT not in words:
        now = datetime.datetime.now().strftime("%H:%M:%S.%f")
        if not claim(claim_path, f"rank {rank} ({role}, pid {pid}) died at {now}\n"):
            return
        when = (
            "after its training ended (in the final barrier, MPI_Finalize or the interpreter's exit)"
            if _DONE in words
            else "without a word"
        )
        cause = "killed, crashed or out of memory"
        reason = cause if _DONE not in words else f"{cause}, after its training ended"
        record_failure(record, rank=int(rank), role=role, step=step, how="died", reason=reason)
        during = f" in step {step}" if step is not None and _DONE not in words else ""
        print(
            f"[psgrad sentinel] rank {rank} ({role}, pid {pid} on {socket.gethostname()}) died {when}{during} at "
            f"{now}: {cause}. It died first; mpiexec ended the other ranks after it "
            "(its own message may name another PID).",
            file=sys.stderr,
            flush=True,
        )
    # mpiexec ends only when every process holding the job's output has closed it: tidy up
    # without it, or a job would outlive its dead rank by _TIDY_AFTER seconds
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.dup2(devnull, sys.stderr.fileno())
    time.sleep(_TIDY_AFTER)
    try:
        os.unlink(claim_path)
    except OSError:
        pass


_IN_CREATE = 0x100  # inotify(7)


def _creations(directory: str) -> int | None:
    """A non-blocking inotify descriptor that turns readable when a file is created in
    ``directory``, or None where there is none (not Linux). An early sentinel then looks at the
    rank's mappings the moment MPI creates its segment, not up to ``POLL_SECONDS`` later: a rank
    killed in between (mpiexec ending the job because another rank died as it started) had left
    the file behind (1 run in 20 of the start-up signal test)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, AttributeError):
        return None
    if fd < 0:
        return None
    if libc.inotify_add_watch(fd, os.fsencode(directory), _IN_CREATE) < 0:
        os.close(fd)
        return None
    return fd


def _drain(fd: int) -> None:
    """Read every pending event of the non-blocking ``fd``."""
    try:
        while os.read(fd, 1 << 12):
            pass
    except BlockingIOError:
        pass


def _segments_module() -> ModuleType:
    """runtime/segments.py, loaded from beside this file: the sentinel runs without psgrad's package
    (whose import would load torch)."""
    spec = importlib.util.spec_from_file_location("psgrad_segments", Path(__file__).with_name("segments.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    _watch(sys.argv[1], sys.argv[2:6])
