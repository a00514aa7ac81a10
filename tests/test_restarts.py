"""Restarts (launch/mpirun.sh --max-restarts, psgrad/runtime/restarts.py), the failure record
the sentinel writes, --keep-checkpoints, and the exit statuses a restart is decided by."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, metrics_rows, mpiexec, run_bounded

from psgrad import checkpoint
from psgrad.comm.protocol import NonFiniteError
from psgrad.runtime import exits, restarts, sentinel
from psgrad.runtime.failure import exit_status

LAUNCH = Path(__file__).parent.parent / "launch" / "mpirun.sh"


# ---------------------------------------------------------------- the command a restart runs
def test_a_restart_resumes_the_log_dir_in_place_of_any_resume_or_overwrite():
    command = [
        "mpiexec",
        "-n",
        "3",
        "psgrad",
        "train",
        "--overwrite",
        "--resume=old",
        "--log-dir",
        "runs/a",
        "--lr",
        "1",
    ]
    assert restarts.again(command, add=["--resume", "runs/a"]) == [
        "mpiexec", "-n", "3", "psgrad", "train", "--log-dir", "runs/a", "--lr", "1", "--resume", "runs/a",
    ]  # fmt: skip
    mpmd = ["mpiexec", "-n", "1", "psgrad", "server", "--resume", "x", ":", "-n", "2", "psgrad", "worker"]
    assert restarts.again(mpmd, add=["--overwrite"]) == [
        "mpiexec", "-n", "1", "psgrad", "server", "--overwrite", ":", "-n", "2", "psgrad", "worker", "--overwrite",
    ]  # fmt: skip


def test_the_log_dir_is_found_in_either_spelling():
    assert restarts.log_dir_of(["train", "--log-dir", "a"]) == "a"
    assert restarts.log_dir_of(["train", "--log-dir=b"]) == "b"
    assert restarts.log_dir_of(["train", "--lr", "1"]) is None


def test_the_first_failure_since_the_attempt_began_is_read(tmp_path):
    record = tmp_path / "failures.jsonl"
    record.write_text(json.dumps({"rank": 1, "role": "worker", "step": 3, "how": "died", "reason": "old"}) + "\n")
    since = record.stat().st_size
    with open(record, "a") as f:
        f.write("not json\n")
        f.write(json.dumps({"rank": 0, "role": "server", "step": 9, "how": "died", "reason": "killed"}) + "\n")
        f.write(json.dumps({"rank": 2, "role": "worker", "step": 9, "how": "died", "reason": "later"}) + "\n")
    failure = restarts.first_failure(record, since=since)
    assert (failure.rank, failure.step, failure.reason) == (0, 9, "killed")
    assert restarts.first_failure(record, since=record.stat().st_size) == restarts.Failure()
    assert restarts.first_failure(tmp_path / "absent", since=0) == restarts.Failure()


# ---------------------------------------------------------------- the supervisor's decisions
FAKE_JOB = """
import json, sys
from pathlib import Path
args = sys.argv[1:]
log = Path(args[args.index("--log-dir") + 1])
with open(log / "calls.txt", "a") as f:
    f.write(" ".join(args) + "\\n")
statuses = (log / "statuses").read_text().split()
status = int(statuses[0]) if statuses else 0
(log / "statuses").write_text(" ".join(statuses[1:]))
if status not in (0, 2, 3, 4):
    with open(log / "failures.jsonl", "a") as f:
        f.write(json.dumps({"rank": 1, "role": "worker", "step": 12, "how": "died", "reason": "killed"}) + "\\n")
sys.exit(status)
"""


def _supervise(tmp_path, statuses, *, checkpoint_at=None, max_restarts=2, from_scratch=False):
    """Run a fake job that exits with ``statuses`` in turn under the supervisor; returns its status
    and the argument lists the job was started with."""
    log = tmp_path / "log"
    log.mkdir(parents=True)
    (log / "statuses").write_text(" ".join(map(str, statuses)))
    if checkpoint_at is not None:
        _checkpoints(log, [checkpoint_at])
    job = tmp_path / "job.py"
    job.write_text(FAKE_JOB)
    status = restarts.supervise(
        [sys.executable, str(job), "--log-dir", str(log), "--overwrite"],
        max_restarts=max_restarts,
        from_scratch=from_scratch,
    )
    return status, (log / "calls.txt").read_text().splitlines()


def test_a_killed_job_is_resumed_from_its_newest_checkpoint(tmp_path, capfd):
    status, calls = _supervise(tmp_path, [9, 0], checkpoint_at=10)
    assert status == 0 and len(calls) == 2
    assert (
        calls[1].endswith(f"--log-dir {tmp_path / 'log'} --resume {tmp_path / 'log'}") and "--overwrite" not in calls[1]
    )
    line = capfd.readouterr().err
    assert "restart 1 of 2: rank 1 (worker) died in step 12: killed; resuming from" in line and "ckpt-step10" in line
    assert "2 step(s) to train again" in line


@pytest.mark.parametrize("final", [exits.USAGE, exits.NONFINITE, exits.CHECKPOINT])
def test_what_would_fail_again_is_not_restarted(tmp_path, final):
    status, calls = _supervise(tmp_path, [final, 0], checkpoint_at=10)
    assert status == final and len(calls) == 1


def test_restarts_end_when_they_are_used_up(tmp_path):
    status, calls = _supervise(tmp_path, [9, 1, 9, 0], checkpoint_at=10, max_restarts=2)
    assert status == exits.GAVE_UP and len(calls) == 3


def test_no_checkpoint_no_restart_unless_from_scratch(tmp_path):
    status, calls = _supervise(tmp_path, [9, 0])
    assert status == exits.NO_CHECKPOINT and len(calls) == 1
    status, calls = _supervise(tmp_path / "again", [9, 0], from_scratch=True)
    assert status == 0 and len(calls) == 2 and calls[1].endswith("--overwrite")


def test_the_supervisor_needs_a_log_dir(capfd):
    assert restarts.supervise(["true"], max_restarts=1, from_scratch=False) == exits.USAGE
    assert "--log-dir" in capfd.readouterr().err


def test_statuses_of_the_stops_that_would_fail_again():
    assert exit_status(NonFiniteError("x")) == exits.NONFINITE
    assert exit_status(checkpoint.CheckpointError("x")) == exits.CHECKPOINT
    assert exit_status(RuntimeError("x")) == exits.FAILED


# ---------------------------------------------------------------- the failure record
def test_a_dying_rank_is_recorded_with_the_step_it_was_in(tmp_path):
    record = tmp_path / sentinel.FAILURES
    watcher = sentinel.Sentinel(tmp_path / "claim", rank=2, role="worker", record=record)
    watcher.at_step(6)
    watcher.at_step(7)
    watcher.proc.stdin.close()  # the rank dies
    deadline = 100
    while not record.exists() and deadline:
        subprocess.run(["sleep", "0.05"])
        deadline -= 1
    watcher.proc.kill()
    fields = json.loads(record.read_text())
    assert (fields["rank"], fields["step"], fields["how"]) == (2, 7, "died")


def test_a_deliberate_abort_is_recorded_once(tmp_path):
    record = tmp_path / sentinel.FAILURES
    watcher = sentinel.Sentinel(tmp_path / "claim", rank=0, role="server", record=record)
    watcher.at_step(4)
    watcher.claim("NonFiniteError: step 4")  # the rank writes the record itself, then aborts
    other = sentinel.Sentinel(tmp_path / "claim", rank=1, role="worker", record=record)
    other.claim("taken down with it")  # the claim is taken: no second record
    for proc in (watcher.proc, other.proc):  # each would wait to tidy the claim away
        proc.kill()
    lines = record.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["reason"] == "NonFiniteError: step 4"


# ---------------------------------------------------------------- --keep-checkpoints
def _checkpoints(log: Path, complete: list[int], cut_off: list[int] = ()) -> None:
    for step in complete:
        checkpoint.step_dir(log, step).mkdir(parents=True)
        checkpoint.mark_complete(checkpoint.step_dir(log, step), step, 2)
    for step in cut_off:
        checkpoint.save_rank_state(checkpoint.step_dir(log, step), 0, {"step": step})


def test_the_newest_complete_checkpoints_are_kept(tmp_path):
    _checkpoints(tmp_path, [10, 20, 30, 40], cut_off=[5])
    checkpoint.prune(tmp_path, keep=2)
    assert sorted(d.name for d in tmp_path.iterdir()) == ["ckpt-step30", "ckpt-step40"]


def test_the_checkpoint_a_restart_needs_outlives_a_successor_being_written(tmp_path):
    _checkpoints(tmp_path, [10, 20], cut_off=[30])  # 30 is being written (or was cut off)
    checkpoint.prune(tmp_path, keep=1)
    assert sorted(d.name for d in tmp_path.iterdir()) == ["ckpt-step20", "ckpt-step30"]
    assert checkpoint.resolve(tmp_path).name == "ckpt-step20"


def test_keep_zero_keeps_every_checkpoint(tmp_path):
    _checkpoints(tmp_path, [10, 20, 30])
    assert checkpoint.prune(tmp_path, keep=0) == [] and len(list(tmp_path.iterdir())) == 3


# ---------------------------------------------------------------- under the launcher
TRAIN = [
    "train",
    "--model",
    "mlp",
    "--steps",
    "30",
    "--batch-size",
    "8",
    "--no-progress",
    "--checkpoint-every-steps",
    "5",
]
SAME = ["step", "epoch", "loss", "bytes_up", "bytes_down", "lr", "nonfinite"]  # all but the timings


def _launched(tmp_path: Path, log: Path, train: list[str], *, rank: int = -1, step: int = 0, restarts_: int = 2):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:3\n")
    script = [sys.executable, str(SCRIPTS / "injected.py"), str(rank), str(step), "--"]
    command = ["bash", str(LAUNCH), "--max-restarts", str(restarts_), "--ranks-per-node", "3", str(hosts), "3"]
    return run_bounded([*command, *script, *train, "--log-dir", str(log)], 300, {"MPIEXEC": mpiexec()})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted run per topology, the reference of the killed ones."""
    runs = {}
    for topology in ("ps", "colocated"):
        log = tmp_path_factory.mktemp(topology) / "log"
        out = _launched(log.parent, log, [*TRAIN, "--topology", topology])
        assert out.returncode == 0, out.stderr[-3000:]
        runs[topology] = log
    return runs


KILLS = random.Random(5).sample(range(5, 30), 3)  # a step after the first checkpoint, each case its own


@pytest.mark.parametrize(
    "topology,rank,step",
    [("ps", 2, KILLS[0]), ("ps", 0, KILLS[1]), ("colocated", 1, KILLS[2])],
    ids=["ps-worker", "ps-server", "colocated-rank"],
)
def test_a_killed_rank_restarts_and_ends_with_the_uninterrupted_model(tmp_path, uninterrupted, topology, rank, step):
    log = tmp_path / "log"
    out = _launched(tmp_path, log, [*TRAIN, "--topology", topology], rank=rank, step=step)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (log / "injected").exists(), "the fault never fired"
    resumed = (step // 5) * 5
    assert f"restart 1 of 2: rank {rank} (" in out.stderr and f"died in step {step}:" in out.stderr, out.stderr[-3000:]
    assert f"resuming from {log}/ckpt-step{resumed}" in out.stderr
    reference = uninterrupted[topology]
    mine = torch.load(log / "model.pt", weights_only=True)
    theirs = torch.load(reference / "model.pt", weights_only=True)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), "model differs"
    ours, want = metrics_rows(log), metrics_rows(reference)
    assert [{k: r[k] for k in SAME} for r in ours] == [{k: r[k] for k in SAME} for r in want]
    assert (log / "eval.csv").read_text().splitlines()[1].split(",")[:4] == (
        (reference / "eval.csv").read_text().splitlines()[1].split(",")[:4]
    )
    assert len(list(log.glob("ckpt-step*"))) == 2, "--keep-checkpoints 2 by default"


def test_a_nan_abort_is_not_restarted(tmp_path):
    log = tmp_path / "log"
    out = _launched(tmp_path, log, [*TRAIN, "--lr", "1e30", "--checkpoint-every-steps", "1"])
    assert out.returncode == exits.NONFINITE, out.stderr[-3000:]
    assert "not restarting after a gradient that was not finite (status 3)" in out.stderr
    assert out.stderr.count("[psgrad] rank=role:pid") == 1, "started once only"
    assert json.loads((log / "failures.jsonl").read_text().splitlines()[0])["how"] == "aborted"


def test_the_supervisor_gives_the_process_its_signal_handlers_back(tmp_path):
    import signal

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    _supervise(tmp_path, [0])
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
