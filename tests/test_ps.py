"""The parameter server under `mpiexec -n 3` (each run has a timeout: a hang fails)."""

import json
import re
import tarfile
import time

import numpy as np
import pytest
import torch
from conftest import assert_removed, metrics_rows, run_mpi, run_script

from psgrad.comm.layout import RankLayout
from psgrad.comm.protocol import plan_layers, shard_layers


def _ok(proc, marker):
    assert proc.returncode == 0 and marker in proc.stdout, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"


REFERENCE = {  # scenario name: reference.py's flags
    "sgd": "",
    "nesterov": "--nesterov",
    "model-granularity": "--model-granularity",
    "push-after": "--push-after",
    "push-after-delta": "--push-after --delta-down",
    "delta-down": "--delta-down",
    "alltoall": "--alltoall",
    "colocated": "--colocated",
    "colocated-push-after-delta": "--colocated --push-after --delta-down",
    "colocated-model-granularity": "--colocated --model-granularity",
    "colocated-serve-thread": "--colocated --serve-thread --delta-down",
    "vectors-exact": "--sign-one-step",
    "vectors-coded": "--sign-one-step --no-bucket-vectors",
    "shared-randomk": "--shared-randomk",
    "shared-randomk-alltoall": "--shared-randomk --alltoall",
    "powersgd": "--powersgd",
    "powersgd-colocated": "--powersgd --colocated",
    "powersgd-alltoall": "--powersgd --alltoall",
    "powersgd-full-rank": "--powersgd-full",
    "powersgd-full-rank-alltoall": "--powersgd-full --alltoall",
}


@pytest.fixture(scope="module")
def reference_job():
    """Every reference scenario in one mpiexec job, one after another: three ranks importing torch
    cost about 5 s of this 2-core machine, paid once instead of twenty times."""
    return run_script("reference.py", *[f"{name}={flags}" for name, flags in REFERENCE.items()], timeout=600)


@pytest.mark.parametrize("name", REFERENCE)
def test_none_codec_through_server_equals_averaged_sgd(reference_job, name):
    out = reference_job.stdout
    assert f"REFERENCE OK {name}\n" in out, f"rc={reference_job.returncode}\n{out}\n{reference_job.stderr[-4000:]}"


def test_the_reference_job_ends_cleanly(reference_job):
    """Each scenario above checks its own line; this is the job's exit (reference.py exits 1 if any
    scenario failed, and a failure after the last scenario shows only here)."""
    assert reference_job.returncode == 0, reference_job.stdout + reference_job.stderr[-4000:]


def test_every_codec_trains_with_and_without_error_feedback():
    specs = [
        "none",
        "fp16",
        "topk:ratio=0.05",
        "randomk:ratio=0.25",
        "threshold:v=0.001",
        "terngrad",
        "qsgd:levels=8",
        "sign",
        "svd:rank=2",
    ]
    configs = [{"codec": s, "lr": 0.005 if s.startswith("sign") or s.startswith("terngrad") else 0.02} for s in specs]
    configs += [
        {"codec": s, "feedback": "ef", "lr": 0.005 if s == "sign" else 0.02}
        for s in ("topk:ratio=0.02", "sign", "svd:rank=1", "threshold:v=0.01")
    ]
    configs += [{"codec": "topk:ratio=0.01", "feedback": "dgc", "momentum": 0.0, "lr": 0.02}]
    configs += [{"codec": "none", "down_codec": "fp16"}, {"codec": "qsgd", "down_codec": "qsgd:levels=64"}]
    configs += [{"codec": "topk:ratio=0.01", "feedback": "ef", "down_codec": "topk:ratio=0.01"}]
    shared = "randomk:ratio=0.25,shared=1"  # the down-link keeps the coordinates the workers sent
    configs += [{"codec": shared, "feedback": "ef", "down_codec": shared}]
    configs += [{"codec": "powersgd:rank=2"}, {"codec": "powersgd:rank=1", "servers": 2, "down_codec": "sign"}]
    proc = run_script("converge.py", *[json.dumps(c) for c in configs], timeout=400)
    _ok(proc, "CONVERGE OK")


def test_async_alltoall_and_colocated_converge():
    configs = [
        {"mode": "async", "staleness": 0},
        {"mode": "async", "staleness": 2, "codec": "qsgd"},
        {"mode": "async", "staleness": 1, "codec": "topk:ratio=0.05", "down_codec": "topk:ratio=0.05"},
        {"topology": "alltoall"},
        {"topology": "alltoall", "codec": "topk:ratio=0.05", "feedback": "ef"},
        {"servers": 2, "codec": "qsgd"},
        {"granularity": "model", "codec": "topk:ratio=0.05", "feedback": "ef"},
        {"topology": "colocated", "codec": "sign", "feedback": "ef", "down_codec": "sign", "lr": 0.005},
        {"topology": "colocated", "mode": "async", "staleness": 1, "codec": "qsgd"},
        {"topology": "colocated", "codec": "topk:ratio=0.05", "feedback": "dgc", "momentum": 0.0, "push": "after"},
        {"topology": "colocated", "granularity": "model", "codec": "fp16", "down_codec": "fp16"},
        {
            "topology": "colocated",
            "mode": "async",
            "codec": "sign",
            "feedback": "ef",
            "serve_thread": True,
            "lr": 0.005,
        },
    ]
    _ok(run_script("converge.py", *[json.dumps(c) for c in configs], timeout=300), "CONVERGE OK")


def _results(evals: list[dict]) -> list[dict]:
    """Evaluation rows without how long they took."""
    return [{k: v for k, v in e.items() if k not in ("eval_seconds", "paused_seconds")} for e in evals]


def _save_params_jobs(out, cases: dict, jobs: dict) -> dict:
    """Every case ``name: (codec, options)`` trained by save_params.py in every job ``kind: (ranks,
    servers, options)``, each job one mpiexec for all the cases (one start-up of its ranks, not one
    per case); case ``name`` of job ``kind`` is saved as ``out/NAME.KIND.pt``. Returns each job's run."""
    done = {}
    for kind, (ranks, servers, options) in jobs.items():
        args: list[str] = []
        for name, (codec, extra) in cases.items():
            args += ["--", str(out / f"{name}.{kind}.pt"), codec, servers, *options, *extra]
        done[kind] = run_script("save_params.py", *args, n=ranks, timeout=400)
    return done


def _saved(out, jobs: dict, name: str) -> tuple[dict, dict]:
    """Case ``name``'s saved parameters and rank 0's saved record, each by job kind, once its every
    job said it saved them."""
    for kind, proc in jobs.items():
        _ok(proc, f"SAVED {out / f'{name}.{kind}.pt'}\n")
    params = {kind: torch.load(out / f"{name}.{kind}.pt", weights_only=True) for kind in jobs}
    records = {kind: torch.load(out / f"{name}.{kind}.pt.server", weights_only=True) for kind in jobs}
    return params, records


def _assert_bit_equal(actual: dict, expected: dict) -> None:
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0, msg=key)


TWO_SERVERS = {"topk": ("topk:ratio=0.1", []), "none": ("none", [])}


@pytest.fixture(scope="module")
def one_and_two_servers(tmp_path_factory):
    out = tmp_path_factory.mktemp("servers")
    return out, _save_params_jobs(out, TWO_SERVERS, {"one": (2, "1", []), "two": (3, "2", [])})


@pytest.mark.parametrize("name", TWO_SERVERS)
def test_two_servers_equal_one_server(one_and_two_servers, name):
    params, records = _saved(*one_and_two_servers, name)
    _assert_bit_equal(params["two"], params["one"])
    # server 0 of the two-server run gathered the other server's layers: it evaluated the full
    # model, the same one the workers hold, with the same result as the single server
    one_srv, two_srv = records["one"], records["two"]
    _assert_bit_equal(two_srv["params"], params["two"])
    assert len(two_srv["evals"]) == 1
    assert _results(two_srv["evals"]) == _results(one_srv["evals"])


def test_clean_shutdown_and_metrics(tmp_path):
    proc = run_mpi(
        [
            __import__("sys").executable,
            "-m",
            "psgrad",
            "train",
            "--model",
            "mlp",
            "--steps",
            "12",
            "--batch-size",
            "8",
            "--synthetic-size",
            "256",
            "--no-progress",
            "--log-dir",
            str(tmp_path),
        ],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[0].startswith("step,epoch,loss,it_per_s,bytes_up,bytes_down")
    assert len(lines) == 13
    row = dict(zip(lines[0].split(","), lines[-1].split(","), strict=False))
    assert (
        int(row["bytes_up"]) > 2 * 4 * 197322 and int(row["bytes_down"]) > 2 * 4 * 197322
    )  # two workers, fp32 both ways
    assert json.loads((tmp_path / "config.json").read_text())["model"] == "mlp"
    assert "synthetic" in proc.stderr


def test_a_torus_grid_that_does_not_fit_the_ranks_is_one_usage_error():
    py = __import__("sys").executable
    args = ["--model", "mlp", "--steps", "2", "--topology", "torus", "--grid", "2x2", "--no-progress"]
    bad = run_mpi([py, "-m", "psgrad", "train", *args], n=3, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("has 4 places for 3 ranks: start mpiexec -n 4") == 1, bad.stderr


def test_mpmd_server_and_worker_commands():
    py = __import__("sys").executable
    args = ["--model", "mlp", "--steps", "4", "--batch-size", "8", "--synthetic-size", "256", "--no-progress"]
    proc = run_mpi(
        [py, "-m", "psgrad", "server", *args, ":", "-n", "2", py, "-m", "psgrad", "worker", *args], n=1, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    bad = run_mpi(
        [py, "-m", "psgrad", "worker", *args, ":", "-n", "2", py, "-m", "psgrad", "worker", *args], n=1, timeout=120
    )
    assert bad.returncode == 2 and bad.stderr.count("which is a server rank") == 1, bad.stderr
    # server and workers disagree: one error naming each differing option, no training
    worker_args = [*args[:2], "--steps", "5", *args[4:], "--codec", "qsgd"]
    mismatch = run_mpi(
        [py, "-m", "psgrad", "server", *args, ":", "-n", "2", py, "-m", "psgrad", "worker", *worker_args],
        n=1,
        timeout=120,
    )
    assert mismatch.returncode == 2, mismatch.stderr[-3000:]
    assert mismatch.stderr.count("the ranks run different configurations") == 1, mismatch.stderr
    assert "--codec 'qsgd' here, 'none' on rank 0; --steps 5 here, 4 on rank 0" in mismatch.stderr


def test_usage_error_is_printed_once_per_job():
    proc = run_mpi([__import__("sys").executable, "-m", "psgrad", "train", "--model", "mlp", "--lr", "-1"], timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("Invalid value for '--lr'") == 1, proc.stderr


def test_an_unreadable_cifar_archive_is_one_data_error_before_training(tmp_path):
    """A download cut short: one line for the job naming the archive and what to do, exit 2, no
    traceback from each rank (each rank printed gzip's EOFError with a traceback before)."""
    src = tmp_path / "src" / "cifar-10-batches-py"
    src.mkdir(parents=True)
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        (src / name).write_bytes(np.random.default_rng(0).bytes(20000))  # incompressible
    with tarfile.open(tmp_path / "whole.tar.gz", "w:gz") as tar:
        tar.add(src, arcname="cifar-10-batches-py")
    whole = (tmp_path / "whole.tar.gz").read_bytes()
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(whole[: len(whole) // 2])
    py = __import__("sys").executable
    args = ["--dataset", "cifar10", "--data-dir", str(tmp_path), "--model", "mlp", "--steps", "2"]
    proc = run_mpi([py, "-m", "psgrad", "train", *args], timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("data error: cifar10:") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "it is truncated or corrupt: download cifar-10-python.tar.gz again" in proc.stderr


def test_missing_cifar_is_one_usage_error_before_training(tmp_path):
    """No archive and no folder: one line for the job naming both and where to get them, no
    traceback from each rank; and psgrad simulate says the same."""
    py = __import__("sys").executable
    args = ["--dataset", "cifar10", "--data-dir", str(tmp_path), "--model", "mlp", "--steps", "2"]
    proc = run_mpi([py, "-m", "psgrad", "train", *args], timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("cifar-10-python.tar.gz exists") == 1 and "Traceback" not in proc.stderr, proc.stderr
    from click.testing import CliRunner

    from psgrad.cli import main

    alone = CliRunner().invoke(main, ["simulate", "--workers", "2", *args])
    assert alone.exit_code == 2 and "cifar-10-python.tar.gz exists" in alone.output


def test_settings_of_a_rank_own_are_not_a_mismatch():
    from psgrad.agreement import config_difference
    from psgrad.config import RunConfig

    base = json.loads(RunConfig().to_json())
    assert config_difference({**base, "device": "cuda", "threads": 4, "progress": False}, base) == []
    assert config_difference({**base, "lr": 0.2}, base) == ["--lr 0.2 here, 0.1 on rank 0"]


class _Rank1Of2:
    """Rank 1 of two whose peer has no error and runs the same settings: records each collective."""

    rank, size = 1, 2

    def __init__(self, cfg) -> None:
        self.cfg, self.calls = cfg, []

    def allreduce_sum(self, values):
        self.calls.append("allreduce")
        return list(values)  # rank 0 contributes zeros: only this rank's flags

    def broadcast_bytes(self, data):
        self.calls.append("broadcast")
        return self.cfg.to_json().encode()


def test_a_read_agrees_on_settings_only_when_asked():
    """A run's data read agrees on its errors alone (the settings were agreed at start-up: one
    allreduce, no broadcast of the config); a job that agreed on nothing yet also compares its
    settings; and a failed read is an AgreementError, not a traceback."""
    from psgrad.agreement import AgreementError, read_agreed
    from psgrad.config import RunConfig

    cfg = RunConfig()
    channel = _Rank1Of2(cfg)
    assert read_agreed(channel, lambda: "data", problems=(ValueError,)) == "data"
    assert channel.calls == ["allreduce"]
    channel.calls.clear()
    assert read_agreed(channel, lambda: "data", problems=(ValueError,), cfg=cfg) == "data"
    assert channel.calls == ["allreduce", "broadcast", "allreduce"]

    def fails():
        raise ValueError("unreadable")

    with pytest.raises(AgreementError, match="rank 1 has a data error"):
        read_agreed(channel, fails, problems=(ValueError,))


# (topology, failing worker index, its rank): the last is rank 0, the watchdog's monitor itself
FAILING = [("ps", "1", 2), ("colocated", "1", 1), ("colocated", "0", 0)]


@pytest.mark.parametrize("topology,worker,rank", FAILING)
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_failing_worker_ends_the_job_naming_it(how, topology, worker, rank):
    start = time.monotonic()
    proc = run_script("fault.py", how, topology, worker, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    named = re.findall(r"\[psgrad sentinel\] rank (\d+) \(", proc.stderr)
    if how == "raise":
        assert f"[psgrad rank {rank}] ValueError while" in proc.stderr and "injected failure" in proc.stderr
        assert named == [], "a deliberate abort must not make a sentinel blame the ranks it took down"
    else:  # mpiexec kills the rest at once and names some PID; the sentinel names the dead rank
        assert named == [str(rank)], proc.stderr[-3000:]
    assert elapsed < 60, f"job took {elapsed:.0f}s to end"
    assert_removed(_segments_of(proc))


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_the_same_error_on_every_worker_prints_one_traceback(topology):
    """Every worker's loader raises at the same step: each may say its one line, the traceback
    comes once, from the rank that ended the job (it came from every worker, one after another)."""
    proc = run_script("fault.py", "raise_all", topology, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr[-3000:]
    assert "ValueError: injected failure in the data loader" in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"\[psgrad rank \d\] ValueError while .*: injected failure", proc.stderr), proc.stderr[-3000:]


def _segments_of(proc) -> set[str]:
    """The MPI shared-memory files fault.py's ranks said they map (the job must not leave them)."""
    found = set(re.findall(r"^segment (\S+)$", proc.stdout, re.MULTILINE))
    assert found or "MPICH" not in proc.stdout, proc.stdout[-2000:]  # MPICH keeps one a node and job
    return found


@pytest.mark.parametrize("topology,worker,rank", FAILING)
def test_a_rank_killed_on_its_way_out_is_named(topology, worker, rank):
    """As under ``psgrad train``, a rank killed after its training ended, while the others finalize
    MPI, is named by its sentinel (its goodbye waits for MPI_Finalize)."""
    proc = run_script("fault.py", "exit", topology, worker, timeout=120)
    assert proc.returncode != 0
    named = re.findall(r"\[psgrad sentinel\] rank (\d+) \(.*\) died after its training ended", proc.stderr)
    assert named == [str(rank)], proc.stderr[-3000:]
    assert_removed(_segments_of(proc))


def test_a_slow_rank_on_its_way_out_is_not_killed_by_the_first_to_leave(tmp_path):
    """MPICH's hydra SIGKILLs every rank still alive when one leaves without telling it (PMI
    finalize, which MPICH sends from a C atexit handler): ``finalize_and_exit`` must leave through
    ``exit``, not ``os._exit``, or a job that succeeded fails by signal 9 now and then."""
    marker = tmp_path / "left"
    proc = run_script("slow_exit.py", str(marker), timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert marker.read_text() == "left\n"


def test_a_clean_end_waits_for_every_watchdog():
    """The ranks that finish first wait in ``Watchdog.stop`` for the last (rank 0, 1.5 s later):
    had they exited, rank 0's thread could send a heartbeat to a process that has gone, and that
    MPI send never returns (a 1 Mbit/s run hung so after its last step)."""
    proc = run_script("watchdog_end.py", timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    took = dict(re.findall(r"rank (\d+) stop ([0-9.]+)", proc.stdout))
    assert sorted(took) == ["0", "1", "2"], proc.stdout
    assert float(took["0"]) < 1.0
    assert all(float(took[rank]) > 1.0 for rank in ("1", "2")), took


def test_a_rank_left_waiting_after_the_others_ended_is_ended():
    """The ranks that stopped their watchdogs wait in stop() for the last: if that rank waits
    for them too (a server for a layer plan from workers that have gone), no rank can progress,
    and the watchdog must say so rather than let the job wait for ever."""
    proc = run_script("watchdog_end.py", "stuck", timeout=60)
    assert proc.returncode != 0
    assert "every rank has been waiting for over 2 s (ranks 1, 2 ended, waiting for the rest)" in proc.stderr, (
        proc.stderr[-3000:]
    )


def test_ranks_that_abort_together_run_nothing_after_it():
    """MPICH's abort returns in a rank that outlives another rank's abort with the stop signals
    ignored (a rank on its way down after Ctrl-C): your loop's exit handlers then ran on, and
    raised about a worker that stopped early after the job had been ended."""
    for _ in range(5):  # a race: one rank's abort may end the others before theirs
        proc = run_script("abort_together.py", timeout=60)
        assert proc.returncode == 7 and "ran on after its abort" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("topology,worker,rank", FAILING)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_stopped_rank_is_named_within_the_timeout(topology, worker, rank, mode):
    start = time.monotonic()
    proc = run_script("fault.py", "stop", topology, worker, mode, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    verdicts = re.findall(
        r"\[psgrad watchdog\] rank \d+: no heartbeat from rank (\d+) \((\S+)\) for (\d+) s", proc.stderr
    )
    assert verdicts and {r for r, _, _ in verdicts} == {str(rank)}, proc.stderr[-3000:]
    # silent for --timeout 5, or when rank 0 itself is silent 5 more (the grace is at most the
    # timeout): a verdict of 15 s would be the old grace of 10 s
    assert all(int(silent) < 15 for _, _, silent in verdicts), verdicts
    assert elapsed < 5 + 30, f"job took {elapsed:.0f}s to end"
    assert_removed(_segments_of(proc))


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_job_where_every_rank_waits_is_ended(topology):
    proc = run_script("fault.py", "hang", topology, timeout=120)
    assert proc.returncode != 0
    assert "every rank has been waiting for over 5 s" in proc.stderr, proc.stderr[-3000:]
    assert_removed(_segments_of(proc))


@pytest.mark.parametrize("topology,worker,rank", FAILING)
def test_a_slow_rank_is_named_and_the_job_goes_on(topology, worker, rank):
    """One worker's loader takes 9 s over a batch (--timeout 5): the others wait for it. Rank 0 says
    once which rank holds them up and what it is doing; the job is not ended, and trains to its end."""
    proc = run_script("fault.py", "slow", topology, worker, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("[psgrad watchdog]")]
    assert len(said) == 1, proc.stderr[-3000:]
    assert re.search(rf"busy meanwhile: rank {rank} \([^)]+\), last reported 'step 3: loading the batch", said[0]), said


def test_rank_0_evaluating_in_the_training_loop_is_named_as_such():
    """Colocated, rank 0 evaluates (--no-eval-background) for 9 s while ranks 1 and 2 wait for its
    replies (--timeout 5): the watchdog's one line says rank 0 is evaluating, which the others
    wait for by design, not the step it last trained; the job goes on to its end."""
    proc = run_script("fault.py", "slow_eval", "colocated", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("[psgrad watchdog]")]
    assert len(said) == 1, proc.stderr[-3000:]
    assert re.search(
        r"busy meanwhile: rank 0 \([^)]+\), last reported 'evaluating after step 2 in the training loop "
        r"\(--no-eval-background\), which the others wait for",
        said[0],
    ), said


COLOCATED = {  # name: codec, and the options of both runs
    "none": ("none", []),
    "qsgd-topk-down": ("qsgd:levels=8", ["down_codec=topk:ratio=0.5"]),
    "sign-ef-push-after": ("sign", ["feedback=ef", "down_codec=sign", "lr=0.005", "push=after"]),
    "powersgd": ("powersgd:rank=2", ["down_codec=sign"]),
}


@pytest.fixture(scope="module")
def colocated_and_separate(tmp_path_factory):
    """Every COLOCATED case on 2 servers + 3 workers, and on 3 colocated ranks."""
    out = tmp_path_factory.mktemp("colocated")
    return out, _save_params_jobs(out, COLOCATED, {"sep": (5, "2", []), "col": (3, "1", ["topology=colocated"])})


@pytest.mark.parametrize("name", COLOCATED)
def test_colocated_equals_separate_servers(colocated_and_separate, name):
    """3 colocated ranks == 2 server ranks + 3 worker ranks, bit for bit: the same seeds (by worker
    index, and one stream for the servers), and the servers sum in worker order whatever the arrival."""
    params, records = _saved(*colocated_and_separate, name)
    _assert_bit_equal(params["col"], params["sep"])
    sep_eval, col_eval = records["sep"], records["col"]
    assert _results(col_eval["evals"]) == _results(sep_eval["evals"]) and len(col_eval["evals"]) == 1
    # the same losses, and the colocated ranks sent fewer bytes: their own shard never crossed the network
    assert [r["loss"] for r in col_eval["rows"]] == [r["loss"] for r in sep_eval["rows"]]
    assert sum(r["bytes_up"] for r in col_eval["rows"]) < sum(r["bytes_up"] for r in sep_eval["rows"])


def test_every_topology_has_a_role_and_a_layout():
    """Every registered topology's role factory resolves, and its name is its registry key."""
    import importlib

    from psgrad.roles import TOPOLOGIES

    assert set(TOPOLOGIES) == {"ps", "colocated", "alltoall", "ring", "torus"}
    for name, topology in TOPOLOGIES.items():
        assert topology.name == name
        module, _, attribute = topology.role.partition(":")
        assert callable(getattr(importlib.import_module(module), attribute)), topology.role


def test_shard_layers_balances_sizes():
    owners = shard_layers([100, 10, 60, 50, 5], 2)
    loads = [sum(s for s, o in zip([100, 10, 60, 50, 5], owners, strict=False) if o == k) for k in range(2)]
    assert owners[0] != owners[2] and max(loads) - min(loads) <= 15


def test_roles_and_plan():
    roles = RankLayout(world=4, servers=2)
    assert roles.server_ranks == [0, 1] and roles.worker_ranks == [2, 3]
    with pytest.raises(
        ValueError,
        match=r"start at least 3 ranks .* or run every rank in this process with psgrad simulate --workers N",
    ):
        RankLayout(world=2, servers=2)
    colocated = RankLayout(world=3, kind="colocated")
    assert colocated.server_ranks == colocated.worker_ranks == [0, 1, 2]
    assert RankLayout(world=3, kind="peers").server_ranks == []
    layers = plan_layers([("a", (3, 4)), ("b", (4,))], granularity="model", owners=1)
    assert len(layers) == 1 and layers[0].shape == (16,)


def test_plan_buckets_vectors_first_and_uncompressed():
    named = [("conv.w", (4, 3, 3, 3)), ("bn.w", (4,)), ("bn.b", (4,)), ("fc.w", (10, 4)), ("fc.b", (10,))]
    layers = plan_layers(named, granularity="layer", owners=2, bucket_vectors=True)
    assert [(layer.name, layer.params, layer.compress) for layer in layers] == [
        ("__vectors__", ("bn.w", "bn.b", "fc.b"), False),
        ("conv.w", ("conv.w",), True),
        ("fc.w", ("fc.w",), True),
    ]
    assert layers[0].shape == (18,) and [layer.index for layer in layers] == [0, 1, 2]
    plain = plan_layers(named, granularity="layer", owners=2, bucket_vectors=False)
    assert [layer.name for layer in plain] == [n for n, _ in named] and all(layer.compress for layer in plain)
    assert (
        plan_layers([("w", (3, 3))], granularity="layer", owners=1, bucket_vectors=True)[0].name == "w"
    )  # no vectors, no bucket


SMALL_NAMED = [("w", (4, 3)), ("b", (4,)), ("v", (3,))]


def _server(layers, rank: int = 0, servers: int = 1):
    """A sync server of ``layers`` (of SMALL_NAMED's parameters) on ``rank``, without any transport."""
    from types import SimpleNamespace

    from psgrad.codecs import make_codec
    from psgrad.config import RunConfig
    from psgrad.engine.serving import SyncServer
    from psgrad.feedback import NoFeedback
    from psgrad.optim import LayerOptimizer

    model = torch.nn.Module()
    for name, shape in SMALL_NAMED:
        model.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))
    ctx = SimpleNamespace(
        cfg=RunConfig(), transport=SimpleNamespace(rank=rank), rank=rank, layers=layers, model=model,
        layout=RankLayout(2 + servers, servers), start=0, buffers_size=0, steps_per_epoch=10, sums=False,
        make_feedback=lambda: NoFeedback(make_codec("none")), make_optimizer=lambda: LayerOptimizer(),
    )  # fmt: skip
    return SyncServer(ctx)


def test_checkpoint_from_another_layer_plan_is_refused_clearly():
    bucketed = plan_layers(SMALL_NAMED, granularity="layer", owners=1, bucket_vectors=True)  # layer 0 = 7 vector values
    plain = plan_layers(SMALL_NAMED, granularity="layer", owners=1, bucket_vectors=False)  # layer 0 = the 12 weights
    state = _server(bucketed).state_dict()
    _server(bucketed).load_state_dict(state)  # the same plan loads
    with pytest.raises(ValueError, match="does not fit this run's layer plan"):
        _server(plain).load_state_dict(state)


def test_a_servers_report_of_what_it_does_follows_its_steps():
    """The failure and hang reports read ``doing``: a serving server's must name the step it waits
    for now, not the one it waited for when it was last driven through ``serve_until`` (a
    colocated rank's server part is polled from hooks only, and reported step 9 at step 14)."""
    server = _server(plan_layers(SMALL_NAMED, granularity="layer", owners=1, bucket_vectors=False))
    assert server.doing == "starting"
    server.doing = None  # serving
    server.completed_step = 8
    assert server.doing == "waiting for messages (step 9)"
    server.completed_step = 13
    assert server.doing == "waiting for messages (step 14)"
    server.doing = "evaluating after step 13"
    assert server.doing == "evaluating after step 13"
    layers = plan_layers(SMALL_NAMED, granularity="layer", owners=4, bucket_vectors=False)  # 3 layers over 4 servers
    idle = [server for server in (_server(layers, rank, servers=4) for rank in range(4)) if not server.owned]
    assert len(idle) == 1
    idle = idle[0]
    idle.doing = None
    assert idle.doing == "no layers to serve"


@pytest.mark.parametrize("topology,ranks", [("ps", 3), ("alltoall", 2)])
def test_powersgd_bytes_per_step_are_its_factors_plus_the_exact_layers(tmp_path, topology, ranks):
    """Every worker sends, per step, P (n x R) and Q (m x R) of each factored layer and the rest
    exact, and gets as much back: 4 R (n + m) bytes a factored layer, within a header a message."""
    py = __import__("sys").executable
    args = ["--model", "mlp", "--steps", "4", "--batch-size", "8", "--synthetic-size", "256", "--no-progress"]
    args += ["--codec", "powersgd:rank=2", "--topology", topology, "--log-dir", str(tmp_path)]
    proc = run_mpi([py, "-m", "psgrad", "train", *args], n=ranks, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # mlp: 64 x 3072 and 10 x 64 are factored at rank 2; the 74 biases travel exact in one bucket
    payload = 4 * 2 * (64 + 3072) + 4 * 2 * (10 + 64) + 4 * 74
    messages = 2 + 2 + 1
    for row in metrics_rows(tmp_path)[1:]:  # step 0 also pulls the starting parameters
        for key in ("bytes_up", "bytes_down"):
            # alltoall: each rank's messages reach the other rank once, and it gets theirs
            assert 2 * payload <= int(row[key]) <= 2 * (payload + messages * 400), (key, row[key], payload)


GOSSIP = [(2, "ring"), (4, "ring --differ"), (4, "torus --differ")]  # ranks, gossip.py's run


@pytest.fixture(scope="module")
def gossip_jobs():
    """The GOSSIP runs, one mpiexec job for each number of ranks."""
    jobs = {}
    for ranks in sorted({ranks for ranks, _ in GOSSIP}):
        runs = [arg for n, run in GOSSIP if n == ranks for arg in [*run.split(), "--"]]
        jobs[ranks] = run_script("gossip.py", *runs, n=ranks, timeout=240)
    return jobs


@pytest.mark.parametrize("ranks,run", GOSSIP)
def test_ring_with_exact_messages_is_gossip_averaging(gossip_jobs, ranks, run):
    proc = gossip_jobs[ranks]
    assert proc.stdout.count(f"GOSSIP OK {run} rank") == ranks, proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_ring_with_sign_reaches_consensus_and_learns(tmp_path):
    """CHOCO-SGD with sign messages on 4 ranks: the ranks' models drift apart while the learning
    rate is high and come back together as the cosine schedule ends; the loss falls."""
    py = __import__("sys").executable
    args = ["--model", "mlp", "--steps", "60", "--batch-size", "16", "--synthetic-size", "512", "--no-progress"]
    args += ["--topology", "ring", "--codec", "sign", "--consensus-step", "0.3", "--consensus-every-steps", "5"]
    args += ["--schedule", "cosine", "--lr", "0.05", "--log-dir", str(tmp_path)]
    proc = run_mpi([py, "-m", "psgrad", "train", *args], n=4, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics_rows(tmp_path)
    distance = [float(r["consensus"]) for r in rows if r["consensus"]]
    assert len(distance) == 13  # steps 0, 5, ..., 55 and the last
    assert max(distance) > 0 and distance[-1] < max(distance) / 4, distance
    losses = [float(r["loss"]) for r in rows]
    assert sum(losses[-10:]) < 0.7 * sum(losses[:10]), losses
    sent = [int(r["bytes_up"]) for r in rows]
    assert max(sent) < 4 * 2 * 197322 * 4 / 16  # sign: 1/32 of fp32 per link (4 ranks, 2 links each), with room


def test_gossip_neighbourhoods():
    from psgrad.comm.layout import parse_grid, ring_neighbours, torus_neighbours
    from psgrad.config import RunConfig
    from psgrad.roles import topology_of

    assert [ring_neighbours(r, 4) for r in range(4)] == [[1, 3], [0, 2], [1, 3], [0, 2]]
    assert ring_neighbours(0, 2) == [1] and ring_neighbours(0, 1) == []
    # 2 x 4: rank 5 is row 1, column 1: above/below wrap to rank 1, left 4, right 6
    assert torus_neighbours(5, 2, 4) == [1, 4, 6]
    assert torus_neighbours(4, 3, 3) == [1, 3, 5, 7]
    assert parse_grid("2X3") == (2, 3)
    with pytest.raises(ValueError, match="RxC"):
        parse_grid("2by3")
    with pytest.raises(ValueError, match="has 6 places for 4 ranks"):
        topology_of("torus").neighbours(0, 4, RunConfig(topology="torus", grid="2x3"))
