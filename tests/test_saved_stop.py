"""A SIGTERM in your own loop is saved, not lost, once the loop asks ``psgrad.should_stop()``
(psgrad/userloop/savedstop.py): every worker stops after the same step, saves, and resumes to the
model of an uninterrupted run, bit for bit, whichever rank the signal reached."""

from __future__ import annotations

import re
import signal
import sys

import pytest
import torch
from conftest import SCRIPTS, descendants, interrupt_when, mpiexec, run_script

SCRIPT = "saved_stop.py"
RANKS = {"ps": 3, "colocated": 2}
MORE = 4  # steps trained after the stop, resumed and straight


def _stopped(tmp_path, topology: str, *, to: str | None, mode: str = "stop"):
    """Run the loop until a SIGTERM to mpiexec's process group (``to`` None: hydra passes it on to
    the ranks), to every process of the ranks (``"everything"``), to the last worker (``"worker"``)
    or to the serving rank (``"server"``); every worker's saved step."""

    cmd = [
        mpiexec(),
        "-n",
        str(RANKS[topology]),
        sys.executable,
        str(SCRIPTS / SCRIPT),
        str(tmp_path),
        topology,
        mode,
    ]
    role = {"worker": RANKS[topology] - 1, "server": 0}.get(to or "")

    def pid(err: str) -> int | list[int]:
        if to == "everything":  # as a scheduler signals a job: its ranks' own processes too
            return [p for rank in re.findall(r"\b\d=[a-z+]+:(\d+)", err) for p in descendants(int(rank))]
        return int(re.search(rf"\b{role}=[a-z+]+:(\d+)", err).group(1))

    trains = f"worker {RANKS[topology] - 2} trains"
    proc = interrupt_when(cmd, lambda err: trains in err, tmp_path / "err", timeout=120, sig=signal.SIGTERM,
                          target=pid if to else None)  # fmt: skip
    workers = range(RANKS[topology] - 2, RANKS[topology])
    saved = [tmp_path / f"ckpt-{rank}.pt" for rank in workers]
    status = 0 if mode == "stop_loader" else 143  # the script's own: it returns, or exits with 143
    assert proc.returncode == status and all(path.exists() for path in saved), proc.stderr[-3000:]
    steps = {torch.load(path, weights_only=True)["step"] for path in saved}
    assert len(steps) == 1, (steps, proc.stderr[-3000:])
    agreed = re.findall(r"^\[psgrad rank (\d)\] SIGTERM on (.*?): every worker stops after this step", proc.stderr,
                        re.MULTILINE)  # fmt: skip
    assert sorted(int(rank) for rank, _ in agreed) == list(workers), proc.stderr[-3000:]
    return steps.pop(), {on for _, on in agreed}, proc.stderr


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_a_sigterm_to_every_rank_is_saved_after_one_step_and_resumes_bit_exact(tmp_path, topology):
    """A scheduler's SIGTERM to every process: each worker saves after the same step, the job ends
    with the script's status, and the resumed run ends with the model of a run never stopped
    (compression memories and momentum included), bit for bit."""
    step, _, err = _stopped(tmp_path, topology, to=None)
    assert "Traceback" not in err, err[-3000:]
    end = str(step + 1 + MORE)
    for mode in ("resume", "straight"):
        proc = run_script(SCRIPT, str(tmp_path), topology, mode, end, n=RANKS[topology], timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(RANKS[topology] - 2, RANKS[topology]):
        resumed = torch.load(tmp_path / f"resume-{rank}.pt", weights_only=True)
        straight = torch.load(tmp_path / f"straight-{rank}.pt", weights_only=True)
        for name, value in straight.items():
            torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("topology, to", [("ps", "worker"), ("colocated", "worker"), ("ps", "server")])
def test_a_sigterm_to_one_rank_stops_every_worker_after_the_same_step(tmp_path, topology, to):
    """``kill PID`` of one worker, or of the serving rank (which serves on and tells the workers):
    every worker stops after the same step, saying which rank the signal reached."""
    _, said, _ = _stopped(tmp_path, topology, to=to)
    assert said == ({"a serving rank"} if to == "server" else {f"rank {RANKS[topology] - 1}"}), said


def test_a_loop_whose_dataloader_workers_keep_on_after_sigterm_saves_its_stop(tmp_path):
    """A scheduler's SIGTERM reaches the DataLoader's worker processes too: with a
    ``worker_init_fn`` that ignores it (docs/api.md), the loop goes on to the agreed step and saves."""
    _, _, err = _stopped(tmp_path, "ps", to="everything", mode="stop_loader")
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]


def test_a_loop_that_does_not_ask_stops_at_once(tmp_path):
    """Without ``should_stop()`` a SIGTERM stops the job at once, with the signal's status."""
    cmd = [mpiexec(), "-n", "3", sys.executable, str(SCRIPTS / SCRIPT), str(tmp_path), "ps", "unasked"]
    proc = interrupt_when(cmd, lambda err: "worker 1 trains" in err, tmp_path / "err", timeout=120, sig=signal.SIGTERM)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "every worker stops after this step" not in proc.stderr, proc.stderr[-3000:]
    assert "terminated (SIGTERM) at saved_stop.py" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_a_loop_that_asks_on_one_worker_only_names_the_other_instead_of_hanging(tmp_path, topology):
    """``should_stop()`` on the first worker alone: that worker would wait on the other's vote for
    ever (until the watchdog's minute); it fails within seconds instead, naming the other."""
    last = RANKS[topology] - 1
    proc = run_script(SCRIPT, str(tmp_path), topology, "one_asks", n=RANKS[topology], timeout=120)
    assert proc.returncode != 0, proc.stderr[-3000:]
    named = f"psgrad.should_stop() was called on this worker (rank {last - 1}), not on worker rank {last}"
    assert named in proc.stderr, proc.stderr[-3000:]


def test_a_worker_behind_between_exchanges_is_waited_for_not_named(tmp_path):
    """With local steps the workers wait for one another only at exchanges: a worker 4 steps (6 s)
    behind asks later, and the first waits for it instead of naming it."""
    proc = run_script(SCRIPT, str(tmp_path), "colocated", "lagging", n=2, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
