"""A SIGTERM during psgrad train's steps is saved at a step every rank agrees on
(psgrad/stopsaving.py): nothing trained is lost, and a rank that cannot agree still stops."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest
import torch
from conftest import interrupt_when, metrics_rows, mpiexec, run_script

from psgrad import checkpoint

STEPS = "600"


def _train(n: int, *options: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "psgrad", "train", *options]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(
    "n,options,boundary",
    [
        (3, ["--codec", "topk:ratio=0.2", "--feedback", "ef"], 1),  # state on every rank: memories, momentum
        # an exchange overlaps the next steps: the ranks settle it before the checkpoint (engine/local.py)
        (2, ["--topology", "colocated", "--local-steps", "4", "--overlap-exchange", "--codec", "qsgd:levels=16"], 4),
    ],
    ids=["ps", "local-steps-overlapped"],
)
def test_a_sigterm_is_saved_after_an_agreed_step_and_resumes_bit_exact(tmp_path, n, options, boundary):
    """SIGTERM to every rank mid-run: the ranks stop after one step, every rank's state in a
    checkpoint of that step (after an exchange, with local steps), and resuming it ends with the
    model of an uninterrupted run with the same checkpoints, bit for bit; metrics.csv holds every
    step trained. Before, the steps since the last periodic checkpoint were lost."""
    common = ["--model", "mlp", "--lr", "0.01", "--steps", STEPS, "--eval-every-epochs", "0", "--no-progress", *options]
    common += ["--checkpoint-every-steps", "40"]
    log = tmp_path / "stopped"

    def first_checkpoint(_err: str) -> bool:
        return (log / "ckpt-step40" / checkpoint.MARKER).exists()

    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "psgrad", "train", *common, "--log-dir", str(log)]
    proc = interrupt_when(cmd, first_checkpoint, tmp_path / "err", sig=signal.SIGTERM)
    assert proc.returncode == 143, proc.stderr[-3000:]
    saved = {
        int(s) for s in re.findall(rf"after step \d+, every rank's state saved in {log}/ckpt-step(\d+)", proc.stderr)
    }
    assert len(saved) == 1, proc.stderr[-3000:]
    (step,) = saved
    assert step % boundary == 0 and step < int(STEPS), proc.stderr[-3000:]
    assert checkpoint.resolve(log) == log / f"ckpt-step{step}", proc.stderr[-3000:]
    # every step trained is logged, the last ones too: a resumed run's time to accuracy needs them all
    assert [int(row["step"]) for row in metrics_rows(log)] == list(range(step)), proc.stderr[-3000:]
    resumed = _train(n, "--resume", str(log))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # uninterrupted, with the same checkpoints: the exchange before each waits (engine/local.py)
    reference = run_script("extra_checkpoint.py", str(step), *common, "--log-dir", str(tmp_path / "ref"), n=n)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    got = torch.load(log / "model.pt", weights_only=True)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=f"{name} resumed from step {step}")


def test_a_rank_that_cannot_agree_on_a_stop_stops_at_once_after_its_patience(tmp_path):
    """Rank 1 is stopped (SIGSTOP: it votes no more), then rank 2 gets SIGTERM: rank 2 waits for
    the agreed stop ``PATIENCE`` seconds, then stops as without saving, naming the checkpoint that
    resumes the run, and the job ends (it does not wait for the watchdog's 60 s, nor for ever)."""
    import os
    import time

    from psgrad.stopsaving import PATIENCE

    log = tmp_path / "run"

    def pids(err: str) -> dict[int, int]:
        return {int(rank): int(pid) for rank, pid in re.findall(r"\b(\d)=[a-z+]+:(\d+)", err)}

    def stop_rank_1(err: str) -> bool:
        if not (log / "ckpt-step20" / checkpoint.MARKER).exists():
            return False
        os.kill(pids(err)[1], signal.SIGSTOP)
        seen["stopped"] = time.monotonic()
        return True

    seen: dict[str, float] = {}
    cmd = [mpiexec(), "-n", "3", sys.executable, "-m", "psgrad", "train", "--model", "mlp", "--lr", "0.01"]
    options = ["--steps", "100000", "--checkpoint-every-steps", "20", "--no-progress", "--log-dir", str(log)]
    try:
        proc = interrupt_when(
            [*cmd, *options], stop_rank_1, tmp_path / "err", sig=signal.SIGTERM, target=lambda err: pids(err)[2],
            timeout=120,
        )  # fmt: skip
    finally:
        subprocess.run(["pkill", "-CONT", "-f", f"--log-dir {log}"], check=False)
    took = time.monotonic() - seen["stopped"]
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "[psgrad rank 2] SIGTERM: stopping after a step every rank agrees on" in proc.stderr, proc.stderr[-3000:]
    assert "[psgrad rank 2] terminated (SIGTERM) while" in proc.stderr, proc.stderr[-3000:]
    assert "state saved in" not in proc.stderr, proc.stderr[-3000:]
    assert f"the newest complete checkpoint is {log}/ckpt-step" in proc.stderr, proc.stderr[-3000:]
    assert PATIENCE <= took < PATIENCE + 30, (took, proc.stderr[-3000:])


@pytest.mark.parametrize(
    "rank,noted,said", [(1, True, "terminated (SIGTERM)"), (2, False, "stopped with the job (SIGTERM on rank 0)")]
)
def test_a_rank_signalled_after_the_agreeing_vote_says_it_was_terminated(rank, noted, said):
    """The vote that agreed the stop held rank 0's SIGTERM only; a rank whose own came a moment
    later (a scheduler signals every rank, not all at once) says it was terminated, one that got
    none that it stopped with the job."""
    from types import SimpleNamespace

    from psgrad.stopsaving import SavedStop, StopSaving

    transport = SimpleNamespace(rank=rank, size=3, shared_stop=lambda: None, barrier=lambda: None)
    checkpoints = SimpleNamespace(enabled=True, stop_step=30, last_saved="run/ckpt-step30", total=1000)
    cfg = SimpleNamespace(mode="sync", staleness=0, local_steps=1, overlap_exchange=False, overlap_steps=0)
    saving = StopSaving(transport, checkpoints=checkpoints, cfg=cfg, wanted=True)
    saving.noted.signum = signal.SIGTERM if noted else 0
    saving.signum, saving.signalled = signal.SIGTERM, [0]
    with pytest.raises(SavedStop) as stop:
        saving.stop()
    assert stop.value.said(rank) == f"{said} after step 30, every rank's state saved in run/ckpt-step30"


def test_a_sigterm_delivered_twice_at_once_is_one_saved_stop(tmp_path):
    """A scheduler signals every process of a job, and the launcher (srun, mpiexec, the restarts
    supervisor) passes its own SIGTERM on: a rank may get two within a moment. That is one stop,
    saved; only a SIGTERM seconds later stops at once."""
    import os

    log = tmp_path / "run"

    def signalled_once(err: str) -> bool:
        if not (log / "ckpt-step20" / checkpoint.MARKER).exists():
            return False
        rank0 = int(re.search(r"\b0=[a-z+]+:(\d+)", err).group(1))
        os.killpg(os.getpgid(rank0), signal.SIGTERM)  # the launcher's; interrupt_when sends the second
        return True

    cmd = [mpiexec(), "-n", "3", sys.executable, "-m", "psgrad", "train", "--model", "mlp", "--lr", "0.01"]
    options = ["--steps", "100000", "--checkpoint-every-steps", "20", "--no-progress", "--log-dir", str(log)]
    proc = interrupt_when([*cmd, *options], signalled_once, tmp_path / "err", sig=signal.SIGTERM)
    assert proc.returncode == 143, proc.stderr[-3000:]
    saved = re.findall(
        r"\[psgrad rank (\d)\] terminated \(SIGTERM\) after step \d+, every rank's state saved", proc.stderr
    )
    assert sorted(saved) == ["0", "1", "2"] and " while " not in proc.stderr, proc.stderr[-3000:]


def test_a_sigterm_to_psgrad_simulate_is_saved_once_and_resumes_bit_exact(tmp_path):
    """``psgrad simulate``'s ranks are threads of one process, whose main thread takes the
    signal: it notes it for every rank, the ranks save after a step they agree on, the stop is
    said once, and resuming ends with the model of a run never stopped, bit for bit."""
    common = ["--workers", "2", "--model", "mlp", "--lr", "0.01", "--steps", STEPS, "--eval-every-epochs", "0"]
    common += ["--no-progress", "--checkpoint-every-steps", "40", "--codec", "topk:ratio=0.2", "--feedback", "ef"]
    log = tmp_path / "stopped"

    def first_checkpoint(_err: str) -> bool:
        return (log / "ckpt-step40" / checkpoint.MARKER).exists()

    cmd = [sys.executable, "-m", "psgrad", "simulate", *common, "--log-dir", str(log)]
    proc = interrupt_when(cmd, first_checkpoint, tmp_path / "err", sig=signal.SIGTERM)
    assert proc.returncode == 143, proc.stderr[-3000:]
    saved = re.findall(rf"\[psgrad\] terminated \(SIGTERM\) after step \d+, every rank's state saved in {log}/ckpt-step(\d+)",
                       proc.stderr)  # fmt: skip
    assert len(saved) == 1 and proc.stderr.count("SIGTERM: stopping after a step") == 1, proc.stderr[-3000:]
    step = int(saved[0])
    assert step < int(STEPS) and checkpoint.resolve(log) == log / f"ckpt-step{step}", proc.stderr[-3000:]
    assert [int(row["step"]) for row in metrics_rows(log)] == list(range(step)), proc.stderr[-3000:]
    simulate = [sys.executable, "-m", "psgrad", "simulate"]
    resumed = subprocess.run([*simulate, "--resume", str(log)], capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = subprocess.run([*simulate, *common, "--log-dir", str(tmp_path / "ref")], capture_output=True,
                              text=True, timeout=240)  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    expected = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    got = torch.load(log / "model.pt", weights_only=True)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=f"{name} resumed from step {step}")
