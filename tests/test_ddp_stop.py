"""A SIGTERM in a torch DDP script is saved, not lost, once the script asks ``psgrad.should_stop()``
(psgrad/ddpstop.py): every rank stops after the same step, saves, and resumes to the model of an
uninterrupted run, bit for bit."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import SCRIPTS, interrupt_when, run_bounded

SCRIPT = str(SCRIPTS / "ddp_stop.py")
MORE = 4  # steps trained after the stop, resumed and straight


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, *args]


def _stopped(tmp_path, *, to: str) -> tuple[int, str]:
    """Train until a SIGTERM to every process (``"everything"``: torchrun, which passes it on, and
    its ranks, as a scheduler signals a job) or to rank 1 alone; the step both ranks saved after."""

    def pids(err: str) -> list[int]:
        ranks = dict(re.findall(r"rank (\d) pid (\d+) trains", err))
        return [int(pid) for rank, pid in ranks.items() if to == "everything" or rank == "1"]

    ready = lambda err: len(re.findall(r"rank \d pid \d+ trains", err)) == 2  # noqa: E731
    target = None if to == "everything" else pids
    proc = interrupt_when(_torchrun(str(tmp_path), "stop"), ready, tmp_path / "err", timeout=120,
                          sig=signal.SIGTERM, target=target)  # fmt: skip
    saved = [tmp_path / f"ckpt-{rank}.pt" for rank in (0, 1)]
    assert all(path.exists() for path in saved), proc.stderr[-3000:]
    steps = {torch.load(path, weights_only=True)["step"] for path in saved}
    assert len(steps) == 1, (steps, proc.stderr[-3000:])
    agreed = re.findall(r"^\[psgrad rank (\d)\] SIGTERM on (.*?): every rank stops after this step", proc.stderr,
                        re.MULTILINE)  # fmt: skip
    assert sorted(rank for rank, _ in agreed) == ["0", "1"], proc.stderr[-3000:]
    return steps.pop(), agreed[0][1]


def test_a_sigterm_to_every_process_is_saved_after_one_step_and_resumes_bit_exact(tmp_path):
    """A scheduler's SIGTERM to torchrun and its ranks (torchrun sends its own on): each rank saves
    after the same step, and the resumed run ends with the model of a run never stopped
    (error-feedback memories, the hook's step and momentum included), bit for bit."""
    step, said = _stopped(tmp_path, to="everything")
    assert said == "ranks 0, 1", said
    for mode in ("resume", "straight"):
        proc = run_bounded(_torchrun(str(tmp_path), mode, str(step + 1 + MORE)), timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        resumed = torch.load(tmp_path / f"resume-{rank}.pt", weights_only=True)
        straight = torch.load(tmp_path / f"straight-{rank}.pt", weights_only=True)
        for name, value in straight.items():
            torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=f"rank {rank}: {name}")


def test_a_sigterm_to_one_rank_stops_both_after_the_same_step(tmp_path):
    """``kill PID`` of rank 1: rank 0, never signalled, stops after the same step."""
    _, said = _stopped(tmp_path, to="rank 1")
    assert said == "rank 1", said


_ALONE = """
import os, signal, sys, time
import torch.distributed as dist
import psgrad
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
psgrad.should_stop()
os.kill(os.getpid(), signal.SIGTERM)
if sys.argv[1] == "again":
    time.sleep(2.5)  # past the 2 s in which a second SIGTERM is the first delivered again
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
calls = 1
while not psgrad.should_stop():
    calls += 1
print("stopped after", calls, "calls")
"""


@pytest.mark.parametrize("again", [False, True])
def test_a_second_sigterm_ends_the_process_as_without_saved_stops(tmp_path, again):
    """The first SIGTERM is noted and the ranks agree a few steps later; a second, later one runs
    the handler there was before (the default: the process ends by the signal)."""
    code = textwrap.dedent(_ALONE.format(store=tmp_path / "store"))
    proc = subprocess.run([sys.executable, "-c", code, "again" if again else "once"], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    if again:
        assert proc.returncode == -signal.SIGTERM and "stopped after" not in proc.stdout, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0 and "stopped after 4 calls" in proc.stdout, proc.stderr[-3000:]


def test_asked_outside_a_job_it_says_what_it_needs():
    """Neither ``psgrad.init`` nor torch.distributed: the error names both ways in."""
    code = "import psgrad\npsgrad.should_stop()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "psgrad.should_stop() needs psgrad.init(...) first (your own loop), or torch.distributed" in proc.stderr


def test_a_rank_that_never_asks_is_named_instead_of_hanging(tmp_path):
    """``if rank == 0 and psgrad.should_stop()``: rank 0 waits for rank 1's votes, which never
    come. It names rank 1 within seconds, and the job ends, instead of waiting for the process
    group's timeout (30 min)."""
    proc = run_bounded(_torchrun(str(tmp_path), "rank0_asks", "1000"), timeout=90)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert (
        "psgrad.should_stop() was called on rank 0, not on rank 1, which would never vote on a stop: "
        "call it after each optimizer step on every rank" in proc.stderr
    ), proc.stderr[-3000:]


def test_store_votes_read_every_ranks_vote_name_the_missing_and_keep_few_keys():
    """Two ranks' channels on one store: a vote read holds both ranks' values in rank order; a
    vote rank 1 never wrote names rank 1 once the patience is over; each rank keeps the keys of
    its last few votes only, so a long run does not fill the store."""
    import torch.distributed as dist

    from psgrad.ddpstop import _KEPT, StoreVotes

    store = dist.HashStore()
    ranks = [StoreVotes(store, rank=rank, size=2, patience=lambda: 0.2) for rank in (0, 1)]
    for vote in range(3 * _KEPT):
        reads = [channel.iallgather_sizes(10 * vote + rank) for rank, channel in enumerate(ranks)]
        for handle, out in reads:
            handle.wait()
            assert out.tolist() == [10 * vote, 10 * vote + 1]
    kept = [vote for vote in range(3 * _KEPT) if store.check([f"psgrad/stop/{vote}/0"])]
    assert kept == list(range(2 * _KEPT, 3 * _KEPT))
    handle, _ = ranks[0].iallgather_sizes(7)
    with pytest.raises(RuntimeError, match=r"called on rank 0, not on rank 1, which would never vote"):
        handle.wait()
    late, out = ranks[1].iallgather_sizes(8)  # rank 0's helper thread stops polling for it
    late.wait()
    assert out.tolist() == [7, 8]


def test_store_votes_leave_the_store_to_a_helper_thread():
    """A vote's round trips to the store's host (a link's latency each, on the host of rank 0)
    are the helper thread's: the training thread only hands the vote over and takes the result."""
    import threading

    import torch.distributed as dist

    from psgrad.ddpstop import StoreVotes

    class Recording:
        def __init__(self) -> None:
            self.inner, self.threads = dist.HashStore(), set()

        def __getattr__(self, name: str):
            self.threads.add(threading.current_thread().name)
            return getattr(self.inner, name)

    store = Recording()
    ranks = [StoreVotes(store, rank=rank, size=2, patience=lambda: 5.0) for rank in (0, 1)]
    for vote in range(5):
        reads = [channel.iallgather_sizes(vote) for channel in ranks]
        for handle, out in reads:
            handle.wait()
            assert out.tolist() == [vote, vote]
    assert store.threads == {"psgrad-stop-votes"}
