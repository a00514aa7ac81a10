"""psgrad simulate: every rank in one process, on the in-process transport (sim/local.py).

The simulation is a stand-in for an MPI job only if it follows the same trajectory, so the central
test runs both and compares them step for step; the others pin down the transport's MPI semantics
(ordering, matching, collectives in rank order) and that a failing or hung rank ends the job.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from conftest import interrupt_when, metrics_rows, run_bounded, run_local_ranks, train_runs

from psgrad import data as datasets
from psgrad.cli import main
from psgrad.comm.waiting import PeerFailure
from psgrad.config import RunConfig
from psgrad.data import load_cifar, make_synthetic
from psgrad.models import build_model
from psgrad.sim.local import LocalTransport
from psgrad.sim.simulate import simulate, world_size
from psgrad.sim.world import LocalWorld, OtherRankFailed, Stalled

SMALL = ["--model", "wrn", "--depth", "10", "--widen-factor", "1", "--batch-size", "16", "--dataset", "synthetic"]


FOLLOWS = {  # name: topology, workers, codec; every case takes 3 ranks under MPI
    "ps-none": ("ps", 2, "none"),
    "alltoall-none": ("alltoall", 3, "none"),
    "ps-qsgd": ("ps", 2, "qsgd:levels=16"),
    "ring-sign": ("ring", 3, "sign"),
    "colocated-powersgd": ("colocated", 3, "powersgd:rank=2"),
}


def _follow_options(name: str) -> list[str]:
    topology, _, codec = FOLLOWS[name]
    return [*SMALL, "--steps", "5", "--topology", topology, "--codec", codec, "--no-progress"]


@pytest.fixture(scope="module")
def mpi_runs(tmp_path_factory):
    """Every FOLLOWS case as ``psgrad train`` on 3 ranks, in one mpiexec job (start-up paid once):
    the job's result and the folder of the cases' log dirs."""
    root = tmp_path_factory.mktemp("mpi")
    return train_runs(root, {name: _follow_options(name) for name in FOLLOWS}), root


@pytest.mark.parametrize("name", FOLLOWS)
def test_simulate_follows_the_mpi_run_step_for_step(tmp_path, mpi_runs, name):
    """With --no-stack to the bit (up to the order of sums); stacked (the default) to rounding, for
    the dense runs (a sign or a quantization level may flip on a rounding difference)."""
    job, root = mpi_runs
    assert job.returncode == 0, job.stderr[-3000:]
    mpi = root / name
    _, workers, codec = FOLLOWS[name]
    ways = {"--no-stack": (1e-6, 1e-5, 1e-6)}
    if codec == "none":
        # grouped convolutions sum in another order; over 5 steps at lr 0.1 that rounding grew to
        # 0.7e-3 (contiguous) and 1.2e-3 (channels-last) in conv1's weights, whose scale is ~0.1
        ways["--stack"] = (1e-4, 0, 3e-3)
    for way, (loss_rel, model_rel, model_abs) in ways.items():
        sim = tmp_path / way
        options = ["simulate", "--workers", str(workers), way, *_follow_options(name), "--log-dir", str(sim)]
        done = CliRunner().invoke(main, options)  # in this process, which has torch imported already
        assert done.exit_code == 0, done.output[-3000:]
        assert "computes on its own" not in done.stderr  # the WRN stacks
        rows_mpi, rows_sim = metrics_rows(mpi), metrics_rows(sim)
        assert [r["step"] for r in rows_sim] == [str(s) for s in range(5)]
        for a, b in zip(rows_mpi, rows_sim, strict=True):
            assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=loss_rel, abs=1e-7), way
            assert (a["bytes_up"], a["bytes_down"]) == (b["bytes_up"], b["bytes_down"])
        model_mpi = torch.load(mpi / "model.pt", weights_only=True)
        model_sim = torch.load(sim / "model.pt", weights_only=True)
        assert model_mpi.keys() == model_sim.keys()
        for param, value in model_mpi.items():
            torch.testing.assert_close(model_sim[param], value, rtol=model_rel, atol=model_abs, msg=f"{way} {param}")


def test_a_model_that_does_not_stack_trains_one_pass_per_worker_as_without_stacking(capfd):
    """ResNet-20's shortcut pads channels, which would mix the stacked workers: the check of the
    first pass sees it, says so, and the run is the unstacked run to the bit."""
    cfg = RunConfig(model="resnet20", batch_size=4, steps=2, progress=False, timeout=60, eval_every_epochs=0)
    stacked, plain = simulate(cfg, 2, cores=1), simulate(cfg, 2, cores=1, stack=False)
    assert "each worker computes on its own" in capfd.readouterr().err
    assert [r["loss"] for r in stacked[0].rows] == [r["loss"] for r in plain[0].rows]
    for name, value in plain[1].params.items():
        assert torch.equal(stacked[1].params[name], value), name


def test_by_default_the_ranks_stack_on_any_number_of_cores(capfd):
    """Stacked in groups, one per core, measured faster on one core and on two (ResNet-20's
    refusal note shows whether stacking was tried); --no-stack does not try."""
    cfg = RunConfig(model="resnet20", batch_size=4, steps=1, progress=False, timeout=60, eval_every_epochs=0)
    for cores in (1, 2):  # on two cores, two groups of two
        simulate(cfg, 4, cores=cores)
        assert "each worker computes on its own" in capfd.readouterr().err
    simulate(cfg, 4, cores=2, stack=False)
    assert "each worker computes on its own" not in capfd.readouterr().err


@pytest.mark.parametrize("topology", ["ps", "colocated", "alltoall", "ring"])
def test_every_topology_trains_stacked_as_it_does_unstacked(topology):
    """The stacked pass gives each rank its own gradient, whatever the role around it does with it
    (a colocated rank keeps serving while it waits for the others to hand in their batches)."""
    cfg = RunConfig(
        model="convnet", batch_size=8, steps=3, codec="none", topology=topology, progress=False, timeout=60,
        eval_every_epochs=0,
    )  # fmt: skip
    stacked, plain = simulate(cfg, 3, cores=1), simulate(cfg, 3, cores=1, stack=False)
    rank = len(stacked) - 1
    assert [r["loss"] for r in stacked[0].rows] == pytest.approx([r["loss"] for r in plain[0].rows], rel=1e-5)
    for name, value in plain[rank].params.items():
        torch.testing.assert_close(stacked[rank].params[name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("topology", ["ps", "ring"])
def test_stacked_groups_side_by_side_train_as_unstacked(topology, monkeypatch):
    """With two cores the stacked workers are two groups (here 2 + 1 of 3 workers), each its own
    stacked pass, run at once: one on the serving thread, one on a helper thread. The ring's
    workers hold different weights after the first step (the grouped convolutions, not the shared
    ones)."""
    import threading

    import psgrad.sim.stacked

    ran_on: list[tuple[str, int]] = []
    run = psgrad.sim.stacked.StackedPass.run

    def recorded(self, inputs, labels, loss_fn):
        ran_on.append((threading.current_thread().name, len(inputs)))
        return run(self, inputs, labels, loss_fn)

    monkeypatch.setattr(psgrad.sim.stacked.StackedPass, "run", recorded)
    cfg = RunConfig(
        model="convnet", batch_size=8, steps=3, codec="none", topology=topology, progress=False, timeout=60,
        eval_every_epochs=0,
    )  # fmt: skip
    grouped = simulate(cfg, 3, cores=2, stack=True)
    # every step two groups, 2 + 1; they run side by side when the closing worker finds the other
    # core free (``borrow_cores`` does not wait: a server still holding it makes that step's passes
    # run one after another on the serving thread, as CI saw once)
    assert sorted(size for _, size in ran_on) == [1, 1, 1, 2, 2, 2], ran_on
    assert ("MainThread", 2) in ran_on and ("psgrad-stacked_0", 1) in ran_on, ran_on
    assert ("psgrad-stacked_0", 2) not in ran_on, ran_on  # the helper only ever runs the second group
    plain = simulate(cfg, 3, cores=2, stack=False)
    rank = len(grouped) - 1
    assert [r["loss"] for r in grouped[0].rows] == pytest.approx([r["loss"] for r in plain[0].rows], rel=1e-5)
    for name, value in plain[rank].params.items():
        torch.testing.assert_close(grouped[rank].params[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_a_simulation_gives_the_caller_back_its_torch_thread_count():
    """Torch's thread count is the process's: each rank sets its --threads and a pass in groups one
    per group. A Python caller that set three threads has three again afterwards, however the
    simulation ended."""
    threads = torch.get_num_threads()
    cfg = RunConfig(
        model="convnet", batch_size=8, steps=2, codec="none", progress=False, timeout=60, eval_every_epochs=0
    )
    try:
        torch.set_num_threads(3)
        simulate(cfg, 2, cores=2)
        assert torch.get_num_threads() == 3

        def failing_loss(out, labels):
            raise RuntimeError("a loss that fails")

        with pytest.raises(RuntimeError, match="a loss that fails"):
            simulate(cfg, 2, cores=2, loss_fn=failing_loss)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


def test_a_stacked_workers_saved_model_holds_only_its_own_tensors(tmp_path):
    """Its parameters are views into the stacked model's: model.pt must not carry all of them."""
    cfg = RunConfig(
        model="convnet", batch_size=4, steps=2, topology="ring", progress=False, timeout=60, eval_every_epochs=0,
        log_dir=str(tmp_path),
    )  # fmt: skip
    results = simulate(cfg, 8, cores=1)
    own = sum(value.numel() * value.element_size() for value in results[0].params.values())
    assert (tmp_path / "model.pt").stat().st_size < 1.5 * own + 20_000


def test_thirty_two_workers_train_a_small_model(capfd):
    import os

    cfg = RunConfig(
        model="convnet", batch_size=4, steps=4, dataset="synthetic", codec="topk:ratio=0.05",
        feedback="ef", progress=False, timeout=60, eval_every_epochs=0,
    )  # fmt: skip
    results = simulate(cfg, 32)
    assert len(results) == 33 and results[0].role == "server"
    assert f"[psgrad] ranks 0=server, 1-32=worker, all in pid {os.getpid()}\n" in capfd.readouterr().err
    rows = results[0].rows
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert all(np.isfinite(row["loss"]) for row in rows)
    # every one of the 32 workers sent its coded gradient: 32x what one worker sends
    one = simulate(RunConfig(**{**cfg.__dict__, "steps": 1}), 1)[0].rows[0]["bytes_up"]
    assert rows[0]["bytes_up"] == pytest.approx(32 * one, rel=0.02)
    # the workers end on the same model (synchronous ps): any two agree
    first, last = results[1].params, results[32].params
    for name in first:
        torch.testing.assert_close(first[name], last[name])


def test_the_start_line_names_each_ranks_pid_or_the_one_they_share():
    from psgrad.context import ranks_line

    roles = ["server", "server", "worker", "worker", "worker"]
    assert ranks_line(roles, [11, 12, 13, 14, 15]) == (
        "rank=role:pid 0=server:11, 1=server:12, 2=worker:13, 3=worker:14, 4=worker:15"
    )
    assert ranks_line(roles, [7] * 5) == "ranks 0-1=server, 2-4=worker, all in pid 7"
    assert ranks_line(["server", "worker", "server"], [7] * 3) == "ranks 0=server, 1=worker, 2=server, all in pid 7"
    assert ranks_line(["worker"], [7]) == "rank=role:pid 0=worker:7"


def test_the_ranks_of_a_simulation_load_each_dataset_once_and_share_it(monkeypatch):
    """Sixteen simulated workers used to read and hold sixteen copies of the training set (CIFAR-100:
    16 x 150 MB and a minute of start-up); now the first rank's load serves all of them, and the
    shared sets go when the simulation ends."""
    made: list[tuple[str, weakref.ref]] = []

    def counted(classes, size, seed, split):
        images = make_synthetic(classes, size, seed, split)
        made.append((split, weakref.ref(images)))
        return images

    monkeypatch.setitem(datasets.GENERATED, "synthetic", counted)
    cfg = RunConfig(model="mlp", batch_size=8, steps=2, dataset="synthetic", progress=False, timeout=60)
    results = simulate(cfg, 4)
    assert sorted(split for split, _ in made) == ["test", "train"]
    assert results[0].evals, "the server evaluated on the test set it loaded"
    # nothing stays loaded: the sets are freed with the simulation, and made anew after it
    gc.collect()
    assert [split for split, alive in made if alive() is not None] == []
    datasets.load_dataset("synthetic", "train")
    assert [split for split, _ in made].count("train") == 2


def test_an_unreadable_dataset_is_one_data_error_read_once(tmp_path, monkeypatch):
    """Every worker needs the training set: the first one's failed read is every rank's error,
    said once, without a traceback or fifteen more reads of the same file."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        (folder / name).write_bytes(b"not a pickle at all")
    reads: list[str] = []

    def counted(dataset, data_dir, split):
        reads.append(split)
        return load_cifar(dataset, data_dir, split)

    monkeypatch.setattr(datasets, "load_cifar", counted)
    options = ["simulate", "--workers", "4", "--model", "mlp", "--steps", "1", "--no-progress"]
    done = CliRunner().invoke(main, [*options, "--dataset", "cifar10", "--data-dir", str(tmp_path)])
    assert done.exit_code == 2, done.output
    assert done.stderr.count("data error:") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "data_batch_1 is not a readable CIFAR batch" in done.stderr or "test_batch is not a readable" in done.stderr
    assert sorted(reads) == ["test", "train"]


def test_too_few_samples_for_the_workers_or_a_wrong_depth_is_one_error_before_training():
    """Each was a ValueError and a traceback from every rank (the shards from every worker, the
    depth from every rank building its model)."""
    options = ["simulate", "--workers", "2", "--steps", "1", "--no-progress"]
    done = CliRunner().invoke(main, [*options, "--model", "mlp", "--synthetic-size", "10", "--batch-size", "8"])
    assert done.exit_code == 2, done.output
    assert done.stderr.count("data error: synthetic10/train: 10 samples over 2 workers is fewer than one batch") == 1
    assert "Traceback" not in done.stderr, done.stderr
    done = CliRunner().invoke(main, [*options, "--model", "wrn", "--depth", "11"])
    assert done.exit_code == 2 and done.output.count("--depth: WideResNet depth must be 6n+4") == 1, done.output
    assert "Traceback" not in done.output
    with pytest.raises(ValueError, match="--depth: WideResNet depth must be 6n\\+4"):
        RunConfig(model="wrn", depth=12).validate()
    RunConfig(model="mlp", depth=12).validate()  # the depth of a WideResNet only
    done = CliRunner().invoke(main, ["codecs", "--model", "wrn", "--depth", "11"])
    assert done.exit_code == 2 and "WideResNet depth must be 6n+4" in done.output and "Traceback" not in done.output


def test_threads_that_load_at_once_get_one_set():
    with datasets.shared_loads():
        with ThreadPoolExecutor(8) as pool:
            sets = list(pool.map(lambda _: datasets.load_dataset("synthetic", "train", synthetic_size=64), range(8)))
        assert all(s is sets[0] for s in sets)
        assert datasets.load_dataset("synthetic", "test", synthetic_size=64) is not sets[0]
    assert datasets.load_dataset("synthetic", "train", synthetic_size=64) is not sets[0]


def test_the_trajectory_does_not_depend_on_how_many_ranks_compute_at_once():
    """One core token or several: the ranks interleave differently, the server still sums in
    worker order, so the models agree bit for bit (unstacked: a stacked pass takes the free
    cores as torch threads, and more threads may split a convolution's sums differently)."""
    cfg = RunConfig(model="convnet", batch_size=8, steps=3, codec="qsgd:levels=4", progress=False, timeout=60)
    one, many = simulate(cfg, 4, cores=1, stack=False), simulate(cfg, 4, cores=4, stack=False)
    assert [r["loss"] for r in one[0].rows] == [r["loss"] for r in many[0].rows]
    for name, value in one[1].params.items():
        assert torch.equal(value, many[1].params[name]), name


@pytest.mark.parametrize("topology", ["ps", "alltoall"])
def test_a_resumed_simulation_ends_where_an_uninterrupted_one_does(tmp_path, topology):
    """Checkpoints are written by every simulated rank; resuming from the middle gives the same model."""
    cfg = RunConfig(
        model="convnet", batch_size=8, steps=6, checkpoint_every_steps=3, codec="topk:ratio=0.1", feedback="ef",
        topology=topology, progress=False, timeout=60, log_dir=str(tmp_path / "run"),
    )  # fmt: skip
    whole = simulate(cfg, 3)
    resumed = simulate(RunConfig(**{**cfg.__dict__, "resume": str(tmp_path / "run" / "ckpt-step3")}), 3)
    assert [row["step"] for row in resumed[0].rows] == [3, 4, 5]  # it trained the second half only
    for rank in (1, 2):
        for name, value in whole[rank].params.items():
            torch.testing.assert_close(resumed[rank].params[name], value, rtol=0, atol=0, msg=name)


def test_resume_alone_continues_the_run_and_a_misfit_setting_is_named(tmp_path):
    """`psgrad simulate --resume D/ckpt-step3 --steps 6` continues D's run with its own settings and
    workers and logs into D (each step once, the model of the uninterrupted run); ``--config D``
    reruns it with its workers too; resuming with another --lr says so at start-up and trains;
    resuming with --feedback none is one error that names the changed setting, not a traceback
    from deep in the worker; resuming a finished run says how to train on; another number of
    workers, or no checkpoint, is a usage error before any rank starts."""
    run = tmp_path / "run"
    first = ["simulate", "--workers", "2", "--model", "mlp", "--batch-size", "8", "--steps", "6"]
    first += ["--checkpoint-every-steps", "3", "--codec", "topk:ratio=0.1", "--feedback", "ef", "--no-progress"]
    done = CliRunner().invoke(main, [*first, "--log-dir", str(run)])
    assert done.exit_code == 0, done.output[-3000:]
    whole = torch.load(run / "model.pt", weights_only=True)
    again = ["simulate", "--resume", str(run / "ckpt-step3"), "--steps", "6", "--no-progress"]
    done = CliRunner().invoke(main, again)  # no --workers: the checkpoint's 2, not the default 4
    assert done.exit_code == 0, done.output[-3000:]
    assert "(1 serving, 2 working)" in done.stderr
    assert "changed since the run" not in done.stderr  # its own settings: nothing to say
    assert [row["step"] for row in metrics_rows(run)] == [str(step) for step in range(6)]
    resumed = torch.load(run / "model.pt", weights_only=True)
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)
    new_lr = CliRunner().invoke(main, [*again, "--lr", "0.0125"])  # fits the state, shapes the training: said
    assert new_lr.exit_code == 0, new_lr.output[-3000:]
    assert "resumed at step 3 with settings changed since the run that wrote the checkpoint: --lr" in new_lr.stderr
    assert "-> 0.0125" in new_lr.stderr
    misfit = CliRunner().invoke(main, [*again[:-3], "--steps", "9", "--feedback", "none", "--no-progress"])
    assert misfit.exit_code == 4  # a checkpoint problem (runtime/exits.py): a restart would not help
    assert "does not fit this run's settings" in misfit.stderr and "--feedback ef -> none" in misfit.stderr
    assert "Traceback" not in misfit.stderr  # the one line says it all
    assert json.loads((run / "config.json").read_text())["feedback"] == "ef"  # the failed resume changed nothing
    assert [row["step"] for row in metrics_rows(run)] == [str(step) for step in range(6)]
    rerun = ["simulate", "--config", str(run), "--log-dir", str(tmp_path / "rerun"), "--steps", "1"]
    rerun = CliRunner().invoke(main, [*rerun, "--no-progress"])  # --config: that run's workers too
    assert rerun.exit_code == 0 and "(1 serving, 2 working)" in rerun.stderr, rerun.output[-3000:]
    more = CliRunner().invoke(main, ["simulate", "--workers", "3", "--resume", str(run)])  # one usage error, early
    assert more.exit_code == 2 and "written by 3 ranks, this job has 4: simulate --workers 2" in more.output
    (tmp_path / "empty").mkdir()
    nothing = CliRunner().invoke(main, ["simulate", "--workers", "2", "--resume", str(tmp_path / "empty")])
    assert nothing.exit_code == 2 and "no complete checkpoint" in nothing.output
    done_already = CliRunner().invoke(main, ["simulate", "--workers", "2", "--resume", str(run), "--no-progress"])
    assert done_already.exit_code == 4 and done_already.stderr.count("nothing left of 6 steps") == 1  # not per rank
    assert "--steps 12" in done_already.stderr and "Traceback" not in done_already.stderr


def test_world_size_adds_the_servers_of_the_ps_topology():
    assert world_size(RunConfig(topology="ps", servers=2), 16) == 18
    assert world_size(RunConfig(topology="alltoall"), 16) == 16
    with pytest.raises(ValueError, match="--workers"):
        world_size(RunConfig(), 0)
    assert world_size(RunConfig(topology="torus", grid="2x3"), 6) == 6
    with pytest.raises(ValueError, match="simulate --workers 6"):
        world_size(RunConfig(topology="torus", grid="2x3"), 4)


def test_a_grid_without_a_torus_is_refused():
    """A ring given --grid 2x2 ran as a ring and said nothing of the grid it ignored."""
    for topology in ("ring", "ps", "alltoall"):
        with pytest.raises(ValueError, match=f"--grid 2x2 shapes a torus: it means nothing to --topology {topology}"):
            RunConfig(topology=topology, grid="2x2").validate()
    RunConfig(topology="torus", grid="2x2").validate()
    options = ["simulate", "--workers", "4", "--model", "mlp", "--steps", "1", "--no-progress"]
    done = CliRunner().invoke(main, [*options, "--topology", "ring", "--grid", "2x2"])
    assert done.exit_code == 2 and "shapes a torus" in done.output, done.output


UNUSED = [  # (options, what is said): each option was silently ignored by such a run
    (["--model", "mlp", "--depth", "28"], "--depth shapes a WideResNet: it means nothing to --model mlp"),
    (["--model", "mlp", "--dropout", "0.3"], "--dropout shapes a WideResNet"),
    (["--dgc-momentum", "0.5"], "--dgc-momentum is DGC's: it means nothing without --feedback dgc"),
    (
        ["--codec", "threshold:v=0.01", "--feedback", "dgc", "--momentum", "0", "--dgc-warmup-epochs", "2"],
        "--dgc-warmup-epochs raises the codec's ratio epoch by epoch: --codec threshold:v=0.01 has none",
    ),
    (["--topology", "alltoall", "--down-codec", "qsgd:levels=4"], "--topology alltoall has no servers"),
    (["--granularity", "model", "--no-bucket-vectors"], "--no-bucket-vectors is for --granularity layer"),
    (["--consensus-step", "0.3"], "--consensus-step is CHOCO-SGD's: it means nothing to --topology ps"),
    (["--topology", "alltoall", "--consensus-every-steps", "5"], "--consensus-every-steps is CHOCO-SGD's"),
    (["--staleness", "2"], "--staleness bounds how far --mode async lets a worker run ahead"),
    (["--topology", "colocated", "--servers", "2"], "every rank serves a shard under colocated"),
    (["--topology", "ring", "--servers", "2"], "--servers counts the server ranks of --topology ps: ring has none"),
    (
        ["--optimizer", "adam", "--nesterov"],
        "--nesterov is SGD's (and DGC's): --optimizer adam keeps moments of its own",
    ),
    (["--optimizer", "adam", "--momentum", "0.5"], "--momentum is SGD's"),
    (["--schedule", "cosine", "--lr-decay", "0.5"], "--lr-decay shapes --schedule multistep"),
    (
        ["--lr-milestones", "10,20"],
        "--lr-milestones shapes --schedule multistep: it means nothing to --schedule constant",
    ),
    (["--data-dir", "elsewhere"], "--data-dir holds the CIFAR archives: --dataset synthetic does not read it"),
    (["--local-steps", "4", "--overlap-steps", "2"], "--overlap-steps shapes --overlap-exchange"),
]


@pytest.mark.parametrize("options,said", UNUSED)
def test_an_option_that_means_nothing_to_the_run_is_refused(options, said):
    base = ["simulate", "--workers", "2", "--model", "mlp", "--steps", "1", "--no-progress"]
    done = CliRunner().invoke(main, [*base, *options])
    assert done.exit_code == 2 and said in done.output, done.output
    assert "done:" not in done.output


def test_nesterov_without_momentum_is_a_usage_error():
    """It was a ValueError with a traceback from the server's optimizer, after the ranks started."""
    base = ["simulate", "--workers", "2", "--model", "mlp", "--steps", "1", "--no-progress"]
    done = CliRunner().invoke(main, [*base, "--nesterov", "--momentum", "0"])
    assert done.exit_code == 2 and "--nesterov is a kind of momentum: it needs --momentum > 0" in done.output
    assert done.exception is None or isinstance(done.exception, SystemExit), done.exception


def test_an_option_left_at_its_default_or_taken_from_a_config_is_not_refused(tmp_path):
    """Only what the command line sets, to a value of its own, is refused: a script may pass every
    option every time, and a logged WideResNet run rerun as an MLP carries its depth along."""
    from psgrad.config.refusals import refuse_unused

    refuse_unused(["depth", "staleness", "servers"], RunConfig(model="mlp", depth=16, topology="ring"))
    refuse_unused(["staleness", "consensus_step"], RunConfig(mode="async", staleness=2).validate())
    # DGC's momentum correction takes --nesterov whatever the server's optimizer
    refuse_unused(["nesterov"], RunConfig(optimizer="adam", feedback="dgc", codec="topk:ratio=0.01", nesterov=True))
    (tmp_path / "config.json").write_text(RunConfig(depth=10, widen_factor=1, staleness=3).to_json())
    # past the settings, the torus's grid must fit the workers: the error that says refuse_unused let it by
    too_few = ["--topology", "torus", "--grid", "2x3", "--workers", "4", "--no-progress"]
    for options in (["--config", str(tmp_path), "--model", "mlp"], ["--model", "mlp", "--depth", "16"]):
        done = CliRunner().invoke(main, ["simulate", *too_few, *options])
        assert done.exit_code == 2 and "simulate --workers 6" in done.output, done.output


def test_a_bench_row_with_an_option_that_means_nothing_to_it_is_refused():
    from psgrad.bench.rows import item_config

    with pytest.raises(ValueError, match="--dgc-momentum is DGC's"):
        item_config("sign --dgc-momentum 0.5", RunConfig())
    _, row = item_config("topk:ratio=0.01 --feedback dgc --momentum 0 --dgc-momentum 0.5", RunConfig())
    assert row.dgc_momentum == 0.5 and row.feedback == "dgc"


def test_a_failing_rank_ends_every_rank_with_its_own_error():
    class Boom(RuntimeError):
        pass

    def loader_fn(index: int, workers: int):
        if index == 1:
            raise Boom("no data for worker 1")
        from psgrad.data import ShardLoader, load_dataset

        return ShardLoader(
            load_dataset("synthetic", "train"), dataset="synthetic", worker=index, workers=workers, batch_size=8, seed=0
        )

    cfg = RunConfig(model="mlp", steps=3, batch_size=8, progress=False, timeout=30)
    with pytest.raises(Boom, match="worker 1"):
        simulate(cfg, 3, loader_fn=loader_fn)


def test_an_evaluation_with_nothing_to_score_is_an_error_not_accuracy_0():
    """eval_data that runs dry after the first evaluation (a loader over a stream, say): the
    second evaluation is an error, where it used to log test accuracy 0."""

    class Once:
        def __init__(self):
            self.batches = [(torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))]

        def __iter__(self):
            batches, self.batches = self.batches, []
            return iter(batches)

    cfg = RunConfig(model="mlp", steps=4, batch_size=8, progress=False, timeout=30, eval_every_steps=2)
    with pytest.raises(ValueError, match="the evaluation data yielded no samples"):
        simulate(cfg, 2, model_fn=lambda: build_model("mlp", 10), eval_data=Once())


def test_a_loader_of_no_steps_is_a_data_error_on_every_rank(capfd):
    """A worker's loader_fn giving an epoch of no batches (a DataLoader with drop_last over fewer
    samples than a batch): one rank says which, every rank stops; it used to be a ZeroDivisionError
    in rank 0's first evaluation."""
    from psgrad.agreement import AgreementError
    from psgrad.data import ShardLoader, load_dataset

    def loader_fn(index: int, workers: int):
        loader = ShardLoader(
            load_dataset("synthetic", "train"), dataset="synthetic", worker=index, workers=workers, batch_size=8, seed=0
        )
        return [] if index == 1 else loader  # a re-iterable loader of len 0

    cfg = RunConfig(model="mlp", steps=3, batch_size=8, progress=False, timeout=30)
    with pytest.raises(AgreementError, match="has a data error"):
        simulate(cfg, 2, loader_fn=loader_fn)
    said = capfd.readouterr().err
    assert (
        "data error: loader_fn(1, 2) gave a loader of 0 steps per epoch: every worker needs at least one batch" in said
    )


@pytest.mark.parametrize("topology", ["ps", "alltoall", "ring"])
def test_the_time_spent_loading_a_batch_is_its_own_column(topology):
    """metrics' ``load`` holds the time the loader took (before, no column had it: only it/s), and
    no other phase counts it again."""
    from psgrad.data import ShardLoader, load_dataset

    pause = 0.3  # far above a forward of the MLP on 8 samples

    class SlowLoader(ShardLoader):
        def batch(self, step: int):
            time.sleep(pause)
            return super().batch(step)

    def loader_fn(index: int, workers: int):
        return SlowLoader(
            load_dataset("synthetic", "train"), dataset="synthetic", worker=index, workers=workers, batch_size=8, seed=0
        )

    cfg = RunConfig(
        model="mlp", steps=3, batch_size=8, progress=False, timeout=30, topology=topology, eval_every_epochs=0
    )
    rows = simulate(cfg, 3, loader_fn=loader_fn)[0].rows
    assert len(rows) == 3
    for row in rows:
        assert row["load"] >= pause
        assert row["forward"] < pause


@pytest.mark.parametrize("topology", ["ps", "alltoall", "ring"])
def test_parsing_a_gradient_or_a_reply_is_decoding_in_every_topology(topology, monkeypatch):
    """``decode`` holds wire.loads of gradients and replies as ``encode`` holds wire.dumps (the ps
    worker counted it as waiting for its pull, the server as nothing)."""
    from psgrad.comm import wire

    pause, parse = 0.05, wire.loads

    def slow_loads(*args, **kwargs):
        msg = parse(*args, **kwargs)
        if msg.kind in ("grad", "params"):
            time.sleep(pause)
        return msg

    monkeypatch.setattr(wire, "loads", slow_loads)
    cfg = RunConfig(
        model="mlp", steps=3, batch_size=8, progress=False, timeout=60, topology=topology, eval_every_epochs=0,
        granularity="model",
    )  # fmt: skip
    rows = simulate(cfg, 2)[0].rows
    assert all(row["decode"] >= pause for row in rows)  # one message a step in, per worker
    if topology == "ps":
        assert rows[-1]["server_decode"] >= 2 * 3 * pause  # both workers' gradients, every step


@pytest.mark.parametrize(
    ("topology", "bad", "what"),
    [
        ("ps", 0, "reply"),  # the server's reply, as its worker reads it
        ("ps", 2, "grad message"),  # a worker's gradient, as the server reads it
        ("colocated", 1, ""),
        ("alltoall", 1, "gradient"),
        ("ring", 2, "message"),
    ],
)
def test_a_malformed_message_ends_the_run_naming_the_rank_that_sent_it(topology, bad, what, monkeypatch):
    """Every engine reads arriving bytes through ``envelope.parse``: rank ``bad``'s gradients and
    replies, their first byte one msgpack never uses, end the job with a ``WireError`` that names
    rank ``bad`` (a worker's reply and gossip's neighbour message named no one before), not a
    decoded tensor of garbage or a hang."""
    from psgrad.comm import wire

    def spoilt(rank: int, data) -> bytes:
        if rank == bad and wire.loads(data).kind in ("grad", "params"):
            return b"\xc1" + bytes(data[1:])  # the same length: the alltoall agreed on sizes first
        return data

    send, gather = LocalTransport.isend, LocalTransport.iallgatherv_bytes
    monkeypatch.setattr(LocalTransport, "isend", lambda t, data, *a, **k: send(t, spoilt(t.rank, data), *a, **k))
    monkeypatch.setattr(
        LocalTransport, "iallgatherv_bytes", lambda t, data, *a, **k: gather(t, spoilt(t.rank, data), *a, **k)
    )
    cfg = RunConfig(
        model="mlp", steps=2, batch_size=8, progress=False, timeout=30, topology=topology, eval_every_epochs=0
    )
    with pytest.raises(wire.WireError, match=rf"malformed .*{what}.* from rank {bad}: "):
        simulate(cfg, 3 if topology != "ps" else 2)


# ---------------------------------------------------------------------- the transport itself
def _ranks(size: int, body, stall: float = 30.0) -> list:
    """Run ``body(transport)`` on ``size`` local ranks in threads; their results or exceptions."""
    world = LocalWorld(size, stall)
    return run_local_ranks(world, lambda rank: body(LocalTransport(world, rank)))


def test_messages_between_two_ranks_arrive_in_order_and_match_by_tag():
    def body(t: LocalTransport):
        if t.rank == 0:
            for i in range(5):
                t.isend(bytes([i]) * (i + 1), 1, tag=3)
            t.isend(b"other", 1, tag=4)
            return None
        other = t.irecv(16, 0, 4).wait()  # posted after the tag-3 messages arrived: matches by tag
        got = [bytes(t.irecv(16, 0, 3).wait().payload()) for _ in range(5)]
        return bytes(other.payload()), got, t.bytes_received

    _, (other, got, received) = _ranks(2, body)
    assert other == b"other"
    assert got == [bytes([i]) * (i + 1) for i in range(5)]
    assert received == 5 + sum(range(1, 6))


def test_progress_lets_go_of_sends_that_are_done_and_keeps_the_rest():
    def body(t: LocalTransport):
        if t.rank == 1:
            t.barrier()
            return None
        sends = [t.isend(bytes(1000), 1, tag=i) for i in range(3)]  # a local send is done when made
        receive = t.irecv(8, 1, 9)
        left = t.progress([*sends, receive])
        t.barrier()
        receive.cancel()
        return left == [receive]

    assert _ranks(2, body)[0] is True


def test_a_server_holds_no_more_replies_after_many_steps_than_after_a_few():
    from psgrad.engine import server

    held: list[int] = []
    handle = server.ServerBase._handle

    def counting(self, handles, done):
        handle(self, handles, done)
        held.append(len(self.sends))

    cfg = RunConfig(model="mlp", batch_size=4, steps=30, dataset="synthetic", progress=False, eval_every_epochs=0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server.ServerBase, "_handle", counting)
        simulate(cfg, 4, cores=1, stack=False)
    assert held and max(held) <= 4  # one step's replies at most; it grew by 4 every step


def test_a_message_larger_than_its_receive_is_an_error():
    def body(t: LocalTransport):
        if t.rank == 1:
            t.irecv(4, 0, 1)
            t.barrier()
            return None
        t.barrier()
        return t.isend(b"too long", 1, 1)

    out = _ranks(2, body)
    assert isinstance(out[0], PeerFailure) and "does not fit" in str(out[0])


def test_collectives_combine_in_rank_order_and_dup_separates_them():
    def body(t: LocalTransport):
        dup = t.dup()
        handle, sizes = dup.iallgather_sizes(t.rank + 1)
        total = t.allreduce_sum([t.rank, 1.0])  # on the world: not matched with the dup's gather
        handle.wait()
        gathered, data, _ = t.iallgatherv_bytes(bytes([t.rank]) * (t.rank + 1), sizes)
        gathered.wait()
        root = t.broadcast_bytes(b"from 2" if t.rank == 2 else None, root=2)
        return total.tolist(), sizes.tolist(), bytes(data), root, t.local_rank(group=t.rank % 2)

    for rank, (total, sizes, data, root, local) in enumerate(_ranks(3, body)):
        assert total == [3.0, 3.0]
        assert sizes == [1, 2, 3]
        assert data == b"\x00\x01\x01\x02\x02\x02"
        assert root == b"from 2"
        assert local == {0: 0, 1: 0, 2: 1}[rank]


def test_ranks_that_all_wait_for_each_other_are_stopped():
    out = _ranks(2, lambda t: t.irecv(8, 1 - t.rank, 1).wait(), stall=0.5)
    assert any(isinstance(err, Stalled) for err in out)
    assert all(isinstance(err, (Stalled, OtherRankFailed)) for err in out)


def test_more_cores_than_the_process_may_use_are_run_with_a_note(monkeypatch):
    """--cores above the cores this process may use is honoured (the ranks share them) and said."""
    import psgrad.sim.simulate

    asked: list = []
    monkeypatch.setattr(psgrad.sim.simulate, "simulate", lambda cfg, workers, cores, stack: asked.append(cores))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    options = ["simulate", "--workers", "4", "--model", "convnet", "--steps", "1", "--no-progress"]
    done = CliRunner().invoke(main, [*options, "--cores", "3"])
    assert done.exit_code == 0, done.output
    assert "--cores 3 is more than the 2 this process may use" in done.stderr
    for fits in (["--cores", "2"], []):
        done = CliRunner().invoke(main, [*options, *fits])
        assert done.exit_code == 0 and "note" not in done.stderr, done.stderr
    assert asked == [3, 2, None]


def test_a_log_dir_that_cannot_be_written_is_a_usage_error_said_once(tmp_path, monkeypatch):
    """A --log-dir under a file, one not writable, or one holding a run already: one line, exit 2,
    before any rank builds a model (it was a traceback from rank 0 once the run had started)."""
    from psgrad.checkpoint import log_dir_problem

    (tmp_path / "a-file").write_text("")
    options = ["simulate", "--workers", "2", "--model", "convnet", "--steps", "1", "--no-progress", "--log-dir"]
    done = CliRunner().invoke(main, [*options, str(tmp_path / "a-file" / "run")])
    assert done.exit_code == 2, done.output
    assert "usage error: --log-dir" in done.stderr and "cannot be made: Not a directory" in done.stderr
    assert "Traceback" not in done.stderr and "simulated in one process" not in done.stderr
    assert log_dir_problem(str(tmp_path / "a-file"), resume=None, overwrite=False).endswith(
        "is a file, not a directory"
    )
    assert log_dir_problem(str(tmp_path / "new" / "run"), resume=None, overwrite=False) is None
    assert (tmp_path / "new" / "run").is_dir()  # made before the ranks start, parents too
    monkeypatch.setattr("os.access", lambda path, mode: False)  # root may write anywhere
    assert (
        log_dir_problem(str(tmp_path / "new"), resume=None, overwrite=False)
        == f"--log-dir {tmp_path / 'new'} is not writable"
    )
    monkeypatch.undo()
    (tmp_path / "new" / "run" / "metrics.csv").write_text("step\n")
    done = CliRunner().invoke(main, [*options, str(tmp_path / "new" / "run")])
    assert done.exit_code == 2 and done.stderr.count("holds a run already") == 1, done.output


def test_device_cuda_without_a_gpu_is_a_usage_error_said_once(monkeypatch):
    """It was a RuntimeError and a traceback from every worker rank while setting up."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    options = ["simulate", "--workers", "2", "--model", "convnet", "--steps", "1", "--no-progress"]
    done = CliRunner().invoke(main, [*options, "--device", "cuda"])
    assert done.exit_code == 2, done.output
    assert done.stderr.count("usage error: --device cuda but torch sees no CUDA device") == 1, done.stderr
    assert "Traceback" not in done.stderr and "simulated in one process" not in done.stderr


def test_a_simulation_that_runs_the_machine_out_of_memory_stops_with_a_message(monkeypatch, capfd):
    """Once less memory is left than the floor, the ranks stop at their next wait (even one whose
    collective completed: none goes on to build its model) and simulate raises MemoryError with
    what to change, instead of the kernel's OOM killer ending the process without a word."""
    import psgrad.memory
    import psgrad.sim.simulate

    looks = []  # the first look (before the ranks start) finds the memory free; the rest do not

    def available():
        looks.append(1)
        return (24 << 30, 24 << 30) if len(looks) == 1 else (100 << 20, 24 << 30)

    monkeypatch.setattr(psgrad.memory, "available_memory", available)
    steps_run = []

    def counted_loss(out, labels):
        steps_run.append(1)
        return F.cross_entropy(out, labels)

    cfg = RunConfig(
        model="convnet", batch_size=8, steps=2000, codec="none", progress=False, timeout=60, eval_every_epochs=0
    )
    with pytest.raises(MemoryError, match="fewer --workers, a smaller model or a smaller --batch-size"):
        simulate(cfg, 2, cores=1, loss_fn=counted_loss, stack=False)
    assert len(steps_run) < 2 * 2000  # the two workers did not train on to the end
    assert "[psgrad] stopping: only 0.1 GiB of the machine's 24.0 GiB of memory is left" in capfd.readouterr().err
    watch = psgrad.sim.simulate.MemoryWatch(3)
    assert watch() is not None
    monkeypatch.setattr(psgrad.memory, "available_memory", lambda: (1 << 30, 24 << 30))  # 4 %: above 3 %
    monkeypatch.setattr(psgrad.memory, "resident", lambda: 5 << 30)
    assert psgrad.sim.simulate.MemoryWatch(3)() is None
    watch, resident = psgrad.sim.simulate.MemoryWatch(3), [5 << 30]
    monkeypatch.setattr(psgrad.memory, "resident", lambda: resident[0])
    resident[0] += 200 << 20
    assert watch() is None  # one growth of 200 MiB: a one-off, not expected again
    resident[0] += 200 << 20
    assert watch() is not None  # growing on: twice 200 MiB more would go below the floor


def test_a_simulation_whose_parameters_alone_cannot_fit_stops_before_any_rank_starts(monkeypatch, capfd):
    """8 workers of a 32 MiB model hold at least 512 MiB of parameters and gradients: with 1 GiB
    free of 24 (the floor is 3 %, 0.7 GiB) it is refused at once, not after filling the machine."""
    import psgrad.memory

    monkeypatch.setattr(psgrad.memory, "available_memory", lambda: (1 << 30, 24 << 30))
    built = []

    def big_model():
        built.append(1)
        return torch.nn.Linear(4096, 2048)  # 8 M parameters: 32 MiB

    cfg = RunConfig(model="convnet", batch_size=8, steps=5, codec="none", progress=False, timeout=60)
    with pytest.raises(MemoryError, match="8 workers' parameters and gradients alone take 0.5 GiB"):
        simulate(cfg, 8, cores=1, model_fn=big_model, eval_data=[(torch.zeros(1, 4096), torch.zeros(1))])
    assert len(built) == 1  # the one look at the model's size: no rank built its own
    assert "[psgrad] stopping: 8 workers' parameters" in capfd.readouterr().err


def test_a_wait_in_a_halted_simulation_raises_even_when_what_it_waits_for_has_come():
    """``halt`` (the memory guard) stops a rank whose collective completed, and one about to post
    a receive; ``fail`` lets the first go on, so that a rank with a usage error still prints it."""
    world = LocalWorld(2)
    world.enter(0)
    world.fail("rank 1 failed: AgreementError")
    assert world.wait_until(0, lambda: True) == 0.0
    world.halt("out of memory")
    with pytest.raises(OtherRankFailed, match="rank 1 failed"):
        world.wait_until(0, lambda: True)
    with pytest.raises(OtherRankFailed):  # nor does it post another receive buffer
        LocalTransport(world, 0).irecv(1 << 20, 1, 0)
    world.leave(0)


def test_the_cli_refuses_to_run_under_mpiexec():
    done = run_bounded([sys.executable, "-m", "psgrad", "simulate", "--steps", "1"], 60, env={"PMI_SIZE": "2"})
    assert done.returncode == 2 and "without mpiexec" in done.stderr


def test_the_simulation_benchmark_reports_every_codec(capsys):
    from psgrad.bench.simulation import main

    rows = ("none", "sign --feedback ef --granularity model")
    main(["--workers", "2", "--batch-size", "4", "--codecs", ";".join(rows), "--steps", "7", "--model", "convnet"])
    out = capsys.readouterr().out
    assert "Alone, batch 8, 4 runs" in out  # one just before and one just after each simulation
    assert "--memory-format auto (as above) against contiguous batches" in out  # the layouts on record
    assert "| row | step | compute | coding | optimizer | loading | bookkeeping |" in out
    assert "loading = N x loading a batch of 4 (alone, one thread:" in out  # the lone worker's own, beside it
    for row in rows:
        lines = [line for line in out.splitlines() if line.startswith(f"| {row} |")]
        assert len(lines) == 2, out  # the speed table and the breakdown
        assert len(lines[1].split("|")) == 9  # row, step and five phases


def test_the_simulation_benchmark_refuses_a_bad_row_before_measuring(capsys):
    from psgrad.bench.simulation import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--codecs", "none;sign --granularity tensor"])
    assert exit_info.value.code == 2
    assert "--granularity" in capsys.readouterr().err
    for bad, said in [  # a ZeroDivisionError, an --accumulate message and an empty report before
        (["--workers", "0"], "--workers and --batch-size must be at least 1"),
        (["--batch-size", "0"], "--workers and --batch-size must be at least 1"),
        (["--codecs", " ; "], "--codecs has no rows to simulate"),
        (["--steps", "6"], "--steps must be at least 7"),  # one timed step: a ZeroDivisionError after the run
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(bad)
        assert exit_info.value.code == 2 and said in capsys.readouterr().err


def test_simulate_starts_no_mpi(tmp_path):
    """`psgrad simulate` needs no MPI, so it must not start it (the MPI transport starts MPI only when one is made): with UCX told
    to use a transport that does not exist, MPICH's start-up aborted the process before the first
    step. Also: no MPI is running after a simulation in a fresh interpreter."""
    probe = (
        "from psgrad.config import RunConfig\n"
        "from psgrad.sim.simulate import simulate\n"
        "simulate(RunConfig(model='mlp', steps=2, progress=False, eval_every_epochs=0), 2)\n"
        "from mpi4py import MPI\n"
        "print('MPI started:', MPI.Is_initialized())\n"
    )
    proc = run_bounded([sys.executable, "-c", probe], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MPI started: False" in proc.stdout, proc.stdout
    cli = [sys.executable, "-m", "psgrad", "simulate", "--workers", "2", "--model", "mlp", "--steps", "2"]
    proc = run_bounded([*cli, "--no-progress"], timeout=120, env={"UCX_TLS": "bogus"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 2 steps" in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    "signal_name,said,status",
    [("SIGINT", "interrupted\n", 130), ("SIGTERM", "terminated (SIGTERM) after step ", 143)],
)
def test_a_signal_stops_a_simulation_with_one_line_and_the_checkpoint_to_resume(tmp_path, signal_name, said, status):
    """Ctrl-C or SIGTERM during ``psgrad simulate``: one line, the newest complete checkpoint (after
    a SIGTERM, the one its saved stop wrote) and the --resume that continues it, status 128 + the
    signal; no rank's traceback (a worker whose stacked pass the interrupt cut short only stops),
    no click "Aborted!"."""
    import signal

    from psgrad import checkpoint

    log = tmp_path / "run"
    small_wrn = ["--model", "wrn", "--depth", "10", "--widen-factor", "1", "--batch-size", "8"]
    args = [*small_wrn, "--steps", "100000", "--checkpoint-every-steps", "5", "--no-progress", "--log-dir", str(log)]

    def checkpointed(_err: str) -> bool:
        try:
            return checkpoint.resolve(log) is not None
        except checkpoint.CheckpointError:
            return False

    cmd = [sys.executable, "-m", "psgrad", "simulate", "--workers", "4", *args]
    proc = interrupt_when(cmd, checkpointed, tmp_path / "err", sig=getattr(signal, signal_name))
    assert proc.returncode == status, proc.stderr[-3000:]
    assert proc.stderr.count(f"[psgrad] {said}") == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Aborted!" not in proc.stderr, proc.stderr[-3000:]
    hint = f"the newest complete checkpoint is {checkpoint.resolve(log)}: continue the run with --resume {log}"
    assert hint in proc.stderr, proc.stderr[-3000:]


def test_dgc_takes_nesterov_with_the_server_at_momentum_zero():
    """DGC keeps the momentum on the workers and needs the server's SGD at --momentum 0, so the
    Nesterov form of its correction was refused ("needs --momentum > 0") before any rank started."""
    from psgrad.optim import LayerOptimizer

    cfg = RunConfig(codec="topk:ratio=0.25", feedback="dgc", momentum=0.0, nesterov=True).validate()
    assert cfg.sgd_nesterov is False and LayerOptimizer.from_config(cfg).nesterov is False
    with pytest.raises(ValueError, match="needs --dgc-momentum > 0"):
        RunConfig(codec="topk:ratio=0.25", feedback="dgc", momentum=0.0, dgc_momentum=0.0, nesterov=True).validate()
    base = [
        "simulate",
        "--workers",
        "2",
        "--model",
        "mlp",
        "--steps",
        "2",
        "--no-progress",
        "--codec",
        "topk:ratio=0.25",
    ]
    runs = {}
    for nesterov in ("--nesterov", "--no-nesterov"):
        done = CliRunner().invoke(main, [*base, "--feedback", "dgc", "--momentum", "0", nesterov])
        assert done.exit_code == 0, done.output
        runs[nesterov] = done.output.split("final loss ")[1].split(",")[0]
    assert runs["--nesterov"] != runs["--no-nesterov"]  # the flag reached DGC's correction


def test_a_rings_evaluated_model_is_the_ranks_average_that_learned(tmp_path):
    """A ring has no server: rank 0 evaluates the ranks' average, copied parameter by parameter
    into the model it evaluates (engine/gossip.py). On the easy synthetic set it is right on
    nearly every test image; a copy that put the values in the wrong place would be at chance."""
    import csv

    log = tmp_path / "run"
    options = ["simulate", "--workers", "2", "--topology", "ring", "--feedback", "none", "--model", "mlp"]
    done = CliRunner().invoke(main, [*options, "--epochs", "2", "--no-progress", "--log-dir", str(log)])
    assert done.exit_code == 0, done.output[-3000:]
    with open(log / "eval.csv", newline="") as f:
        last = list(csv.DictReader(f))[-1]
    assert float(last["test_acc"]) >= 0.9 and float(last["test_loss"]) < 0.5, last
