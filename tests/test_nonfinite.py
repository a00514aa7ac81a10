"""--on-nonfinite: a NaN/Inf gradient aborts naming step, rank and layer, or is skipped everywhere."""

import math
import re
import sys

import pytest
import torch
from conftest import metrics_rows, run_mpi, train_runs

from psgrad.codecs import make_codec
from psgrad.comm.protocol import Layer, NonFiniteError, encode_gradient, skip_update
from psgrad.feedback import make_feedback

LAYER = Layer(3, "fc.weight", (4, 5), ("fc.weight",), owner=0)


def test_nonfinite_gradient_aborts_naming_step_rank_and_layer():
    grad = torch.randn(4, 5)
    grad[1, 2] = float("nan")
    grad[3, 0] = float("inf")
    feedback = make_feedback("ef", make_codec("sign"))
    with pytest.raises(NonFiniteError, match=r"step 7: rank 2's gradient of 'fc.weight' has 2 NaN/Inf values of 20"):
        encode_gradient(feedback, LAYER, grad, step=7, sender=2, stream=1, run_seed=0)


def test_skip_sends_marked_zeros_and_leaves_the_feedback_memory_alone():
    feedback = make_feedback("ef", make_codec("sign"))
    encode_gradient(
        feedback, LAYER, torch.randn(4, 5), step=0, sender=2, stream=1, run_seed=0, on_nonfinite="skip"
    )  # a residual to keep
    before = {k: v.clone() for k, v in feedback.state_dict().items()}
    msg = encode_gradient(
        feedback, LAYER, torch.full((4, 5), float("nan")), step=1, sender=2, stream=1, run_seed=0, on_nonfinite="skip"
    )
    assert msg.meta["skip"] == 1 and msg.codec == "none" and msg.kind == "grad" and msg.step == 1
    assert torch.equal(make_codec("none").decode(msg), torch.zeros(4, 5))
    after = feedback.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_sum_that_overflows_is_caught_too():
    total = torch.tensor([3e38, 3e38])  # finite values whose sum is inf
    assert not skip_update(torch.ones(2), "x", "abort")
    assert skip_update(torch.ones(2), "x", "abort", marked=True)
    assert skip_update(total, "x", "skip")
    with pytest.raises(NonFiniteError):
        skip_update(total, "x", "abort")


HUGE_LR = ["--model", "mlp", "--dataset", "synthetic", "--steps", "30", "--lr", "1e6", "--no-progress"]


@pytest.mark.parametrize("topology", ["ps", "alltoall"])
def test_huge_lr_aborts_within_the_step(tmp_path, topology):
    args = [*HUGE_LR, "--log-dir", str(tmp_path), "--topology", topology]
    proc = run_mpi([sys.executable, "-m", "psgrad", "train", *args], timeout=180)
    rows = metrics_rows(tmp_path)
    assert proc.returncode != 0
    found = re.search(r"NonFiniteError while .*?step (\d+): rank (\d)'s gradient of '([\w.]+)'", proc.stderr)
    assert found, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]  # an expected stop says its line alone
    step = int(found.group(1))
    # no step after the bad one was trained, and no non-finite loss was ever logged
    assert rows and all(int(r["step"]) < step for r in rows)
    assert all(math.isfinite(float(r["loss"])) for r in rows)


SKIP = [("ps", "sync"), ("ps", "async"), ("alltoall", "sync"), ("colocated", "sync")]  # topology, mode


@pytest.fixture(scope="module")
def skip_runs(tmp_path_factory):
    """Every SKIP case with --on-nonfinite skip, in one mpiexec job (start-up paid once): the job's
    result and the folder of the cases' log dirs."""
    root = tmp_path_factory.mktemp("skip")
    runs = {f"{t}-{m}": [*HUGE_LR, "--on-nonfinite", "skip", "--topology", t, "--mode", m] for t, m in SKIP}
    return train_runs(root, runs, timeout=300), root


@pytest.mark.parametrize("topology,mode", SKIP)
def test_skip_drops_the_updates_and_counts_them(skip_runs, topology, mode):
    proc, root = skip_runs
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics_rows(root / f"{topology}-{mode}")
    assert len(rows) == 30 and sum(int(r["nonfinite"]) for r in rows) > 0
    model = torch.load(root / f"{topology}-{mode}" / "model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in model.values()), "a skipped update reached the parameters"


@pytest.mark.parametrize("lr,diverges", [("100", True), ("0.1", False)])
def test_a_loss_that_grows_a_thousandfold_is_said_once(lr, diverges):
    """A run that diverges without overflowing would otherwise end, status 0, as if it had trained."""
    from click.testing import CliRunner

    from psgrad.cli import main

    options = ["simulate", "--workers", "2", "--model", "mlp", "--steps", "4", "--lr", lr, "--no-progress"]
    done = CliRunner().invoke(main, options)
    assert done.exit_code == 0, done.output[-3000:]
    assert done.stderr.count("the run diverges") == (1 if diverges else 0), done.stderr
    assert ("(diverged from step 1)" in done.stderr) == diverges
