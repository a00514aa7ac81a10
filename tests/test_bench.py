import json
import sys

import pytest
from conftest import interrupt_when, metrics_rows, mpiexec, run_bounded, run_mpi

from psgrad.bench import hidden_share, summarize
from psgrad.models import build_model

SMALL = ["--model", "mlp", "--batch-size", "8", "--synthetic-size", "256"]


OUTSIDE_MPI = {key: None for key in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")}
"""No inherited rank variables: psgrad bench as a user starts it, outside any MPI job."""


def _launcher(args: list[str], timeout: float = 300):
    return run_bounded([sys.executable, "-m", "psgrad", "bench", "--mpiexec", mpiexec(), *args], timeout, OUTSIDE_MPI)


def test_bench_inside_one_mpi_job(tmp_path):
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    args = [*SMALL, "--steps", "4", "--warmup-steps", "1", "--repeat", "2"]
    proc = run_mpi(
        [sys.executable, "-m", "psgrad", "bench", *args, "--codecs", "none;topk:ratio=0.01"]
        + ["--json", str(out), "--plot", str(png), "--log-dir", str(tmp_path / "logs")],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert kept == ["01-r1-none", "02-r1-topk:ratio=0.01", "03-r2-none", "04-r2-topk:ratio=0.01"]
    assert all(len(metrics_rows(tmp_path / "logs" / name)) == 6 for name in kept)
    assert "speedup" in proc.stdout and "topk:ratio=0.01" in proc.stdout
    rows = json.loads(out.read_text())
    assert [r["codec"] for r in rows] == ["none", "topk:ratio=0.01"]
    assert rows[0]["speedup"] == 1.0 and rows[1]["runs"] == 2
    assert rows[0]["of_dense"] == 1.0 and rows[1]["of_dense"] is None  # dense; top-k without feedback never measured
    assert rows[1]["bytes_up"] < rows[0]["bytes_up"] / 10  # top-1% sends far fewer bytes up (down stays dense)
    assert all(r["it_per_s"] > 0 for r in rows)
    assert 0 < rows[0]["server_cpu"] < 1.5  # CPU seconds per second of one process
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_launcher_with_baselines(tmp_path):
    out = tmp_path / "bench.json"
    a2a = "sign --feedback ef --topology alltoall"  # a row without a server: 2 ranks
    args = [*SMALL, "--steps", "4", "--warmup-steps", "2", "--codecs", f"none;qsgd:levels=4;{a2a}"]
    logs = tmp_path / "logs"
    proc = _launcher([*args, "--baselines", "compute,ddp,ddp-powersgd", "--json", str(out), "--log-dir", str(logs)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # every job's output, and each psgrad row's per-step metrics: 2 warm-up, 4 timed and the last step
    kept = sorted(p.name for p in logs.iterdir())
    assert kept == ["01-r1-none", "02-r1-qsgd:levels=4", "03-r1-sign_--feedback_ef_--topology_alltoall"] + [
        f"0{i}-r1-{name}" for i, name in ((4, "compute"), (5, "ddp"), (6, "ddp-powersgd"))
    ]
    for name in kept[:3]:
        assert "[psgrad] done: 7 steps" in (logs / name / "job.log").read_text(), name
        assert len(metrics_rows(logs / name)) == 7, name
        assert not list((logs / name).glob("ckpt-step*")) and not (logs / name / "model.pt").exists(), name
    assert (logs / kept[2] / "row.txt").read_text() == a2a + "\n"
    assert (logs / kept[3] / "job.log").exists() and not (logs / kept[3] / "metrics.csv").exists()
    rows = {r["codec"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["none", "qsgd:levels=4", a2a, "compute", "ddp", "ddp-powersgd"]
    assert rows[a2a]["it_per_s"] > 0 and rows[a2a]["compression"] > 10 and "on 2 rank(s)" in proc.stderr
    for name in rows:
        assert name in proc.stdout
    numel = sum(p.numel() for p in build_model("mlp", 10).parameters())
    # a ring allreduce of fp32 over 2 workers: each sends the whole model once
    assert rows["ddp"]["bytes_per_step"] == 2 * 4 * numel
    assert rows["ddp-powersgd"]["bytes_per_step"] < rows["ddp"]["bytes_per_step"] / 10
    assert rows["compute"]["bytes_per_step"] == 0 and rows["compute"]["of_ideal"] == pytest.approx(1.0)
    assert rows["none"]["bytes_up"] >= 2 * 4 * numel  # two workers push the dense gradient
    assert rows["qsgd:levels=4"]["compression"] > 1.5
    assert all(0 < rows[name]["loss"] < 10 for name in ("none", "qsgd:levels=4", "compute", "ddp"))
    # unshaped: the ideal of every row is the compute-only rate
    for r in rows.values():
        assert r["ideal_it_per_s"] == pytest.approx(rows["compute"]["it_per_s"])
    assert rows["ddp"]["hidden_comm_share"] is None and rows["ddp"]["server_cpu"] is None


def test_bench_failing_job_reports_its_error(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        (folder / name).write_bytes(b"not a pickle at all")
    data = ["--dataset", "cifar10", "--data-dir", str(tmp_path)]
    for rows in (["--codecs", "none"], ["--codecs", "", "--baselines", "ddp"]):  # psgrad's job, DDP's job
        proc = _launcher([*SMALL, "--steps", "2", *rows, *data])
        assert proc.returncode == 1
        job, _, summary = proc.stderr.partition("every row failed, no table:")
        assert "exit status 2" in job and job.count("data error: ") == 1, proc.stderr  # one rank says it
        assert "is not a readable CIFAR batch" in summary and "Traceback" not in proc.stderr, proc.stderr


def test_a_failing_row_leaves_the_others_measured(tmp_path):
    """A row whose job fails (here: a batch larger than a worker's shard) is said when it fails and
    skipped in later rounds; the other rows are measured, tabled and kept as JSON, and bench then
    exits 1 naming the failed row and its rank's error line."""
    out, logs = tmp_path / "bench.json", tmp_path / "logs"
    bad = "none --batch-size 200"  # 256 samples over 2 workers: 128 each, fewer than one batch
    args = [*SMALL, "--steps", "2", "--repeat", "2", "--codecs", f"none;{bad}", "--json", str(out)]
    proc = _launcher([*args, "--log-dir", str(logs)])
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "[bench 2/4]   failed: exit status 2" in proc.stderr, proc.stderr[-3000:]
    assert f"[bench 4/4] round 2: {bad} skipped: its job failed before" in proc.stderr, proc.stderr[-3000:]
    assert "[bench 3/4]   " in proc.stderr and "it/s" in proc.stderr.split("[bench 3/4]   ")[1].splitlines()[0]
    summary = proc.stderr.split("1 of 2 rows failed, not in the table:")[1]
    assert f"{bad}: [psgrad rank 1] data error: " in summary and "fewer than one batch" in summary, summary
    rows = json.loads(out.read_text())
    assert [(r["codec"], r["runs"]) for r in rows] == [("none", 2)]
    assert "none" in proc.stdout and bad not in proc.stdout
    kept = sorted(p.name for p in logs.iterdir())
    assert kept == ["01-r1-none", "02-r1-none_--batch-size_200", "03-r2-none"]
    assert "fewer than one batch" in (logs / kept[1] / "job.log").read_text()


def test_bench_without_its_data_is_a_usage_error_before_any_job():
    proc = _launcher([*SMALL, "--steps", "2", "--codecs", "none", "--dataset", "cifar10", "--data-dir", "/nonexistent"])
    assert proc.returncode == 2, proc.stderr
    assert "cifar-10-python.tar.gz exists" in proc.stderr and "[bench 1/" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "signal_name,group,said,status",
    [("SIGINT", True, "interrupted", 130), ("SIGTERM", False, "terminated (SIGTERM)", 143)],
)
def test_a_signal_stops_the_running_job_and_says_so(tmp_path, signal_name, group, said, status):
    """Ctrl-C (SIGINT to the terminal's process group) or ``kill`` (SIGTERM to the launcher alone)
    while a row's job trains: the launcher ends the job, which runs in a process group of its own
    that neither signal reaches (SIGTERM used to end the launcher at once and leave a job that
    had got past its start-up output running to its end), says which run it stopped, and exits 130
    or 143 without a traceback or click's "Aborted!"."""
    import signal
    import subprocess
    import time

    def training(err: str) -> bool:
        """The job has been running for a few seconds: past the output it writes as it starts,
        whose writes into a closed pipe would end it without the launcher's help."""
        if "[bench 1/2]" in err:
            seen.setdefault("job", time.monotonic())
        return time.monotonic() - seen.get("job", time.monotonic()) > 5

    seen: dict[str, float] = {}
    cmd = [sys.executable, "-m", "psgrad", "bench", "--mpiexec", mpiexec(), *SMALL, "--steps", "100000"]
    proc = interrupt_when(
        [*cmd, "--lr", "0.01", "--codecs", "none;sign"], training, tmp_path / "err",
        env={**OUTSIDE_MPI, "TMPDIR": str(tmp_path)}, sig=getattr(signal, signal_name), group=group,
    )  # fmt: skip
    assert proc.returncode == status, proc.stderr[-3000:]
    assert f"[bench] {said} in run 1/2: its job was stopped, no table" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Aborted!" not in proc.stderr, proc.stderr[-3000:]
    deadline = time.monotonic() + 10  # the job's processes may take a moment to go
    ours = f"psgrad[.]bench {tmp_path}/"  # its job file is in TMPDIR: other tests' jobs may run meanwhile
    while (left := subprocess.run(["pgrep", "-af", ours], capture_output=True, text=True)).returncode == 0:
        if time.monotonic() > deadline:
            pytest.fail(f"the stopped job's processes are still running:\n{left.stdout}")
        time.sleep(0.2)
    assert left.returncode == 1, left.stderr  # 1: no such process; anything else: pgrep failed


def test_a_stop_after_measured_runs_still_tables_and_writes_them(tmp_path):
    """Ctrl-C in the second row: the first row's run, measured, is tabled and written to --json
    (an hour of rounds is not lost to the last one), and the status is still Ctrl-C's 130."""
    import json

    def second_row_started(err: str) -> bool:  # its job's start-up alone takes seconds
        return "[bench 2/2]" in err

    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "psgrad", "bench", "--mpiexec", mpiexec(), *SMALL, "--steps", "1500"]
    proc = interrupt_when(
        [*cmd, "--lr", "0.01", "--codecs", "none;sign", "--json", str(out)],
        second_row_started, tmp_path / "err", env=OUTSIDE_MPI,
    )  # fmt: skip
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "in run 2/2: its job was stopped; the table holds the runs measured before it" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(row["codec"], row["runs"]) for row in rows] == [("none", 1)]
    assert "\nnone " in proc.stdout


def test_baselines_need_the_launcher():
    proc = run_mpi(
        [sys.executable, "-m", "psgrad", "bench", *SMALL, "--codecs", "none", "--baselines", "ddp"], timeout=120
    )
    assert proc.returncode != 0
    assert "without mpiexec" in proc.stderr


@pytest.mark.parametrize(
    "banner,uid,given,expected",
    [
        ("mpiexec (Open MPI) 5.0.11", 0, [], ["--allow-run-as-root", "--oversubscribe"]),
        (
            "mpiexec (OpenRTE) 4.1.6",
            0,
            ["--oversubscribe", "-x", "A"],
            ["--oversubscribe", "-x", "A", "--allow-run-as-root"],
        ),
        ("mpiexec (Open MPI) 5.0.11", 1000, ["-x", "A"], ["-x", "A"]),
        ("HYDRA build details:\n    Version: 5.0.2", 0, [], []),
    ],
    ids=["openmpi5-root", "openmpi4-root-some-given", "openmpi-user", "mpich-root"],
)
def test_open_mpi_as_root_gets_its_root_flags(tmp_path, monkeypatch, banner, uid, given, expected):
    from psgrad.bench import jobs

    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' '{banner}'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(jobs.os, "geteuid", lambda: uid)
    assert jobs.launcher_args(str(fake), given) == expected
    assert not jobs.is_open_mpi(str(tmp_path / "missing"))


def test_bad_bench_options(tmp_path):
    (tmp_path / "a-file").write_text("")
    for option in ("--json", "--plot"):  # refused before minutes of measuring, not after
        proc = _launcher([option, str(tmp_path / "a-file" / "out")])
        assert proc.returncode == 2 and "a-file is a file, not a folder" in proc.stderr, proc.stderr[-2000:]
    proc = _launcher(["--log-dir", str(tmp_path)])  # rows would write into another run's logs
    assert proc.returncode == 2 and "is not empty" in proc.stderr, proc.stderr[-2000:]
    proc = _launcher(["--baselines", "horovod"])
    assert proc.returncode == 2 and "unknown baseline" in proc.stderr
    proc = _launcher(["--bandwidth", "fast"])
    assert proc.returncode == 2 and "100mbit" in proc.stderr
    proc = _launcher(["--powersgd-rank", "4"])  # it was ignored without a word
    assert proc.returncode == 2 and "--powersgd-rank is the ddp-powersgd baseline's" in proc.stderr
    proc = _launcher(["--codecs", "sign --dgc-momentum 0.5"])  # a row's own option that means nothing to it
    assert proc.returncode == 2 and "--dgc-momentum is DGC's" in proc.stderr
    proc = _launcher(["--codecs", "none --steps 5"])  # every row ran the bench's --steps without a word
    assert proc.returncode == 2 and "--steps is not a row's to set" in proc.stderr, proc.stderr[-2000:]
    for empty in ("", " ; "):  # it was a ValueError traceback from max() over no rows
        proc = _launcher(["--codecs", empty])
        assert proc.returncode == 2 and "no rows to measure" in proc.stderr and "Traceback" not in proc.stderr


def test_hidden_share():
    base = {"forward": 1.0, "backward": 3.0, "push_wait": 0.0, "pull_wait": 0.0}
    assert hidden_share(base) == 1.0
    assert hidden_share({**base, "pull_wait": 4.0}) == 0.5


def _m(it_per_s, up, down=0.0):
    keys = ("forward", "backward", "encode", "push_wait", "pull_wait", "decode", "apply")
    return {"it_per_s": it_per_s, "bytes_up": up, "bytes_down": down, "server_cpu": 0.1, **dict.fromkeys(keys, 0.01)}


def test_summarize_ideal_and_ratios():
    results = {
        "none": [_m(1.0, 8e6, 8e6), _m(3.0, 8e6, 8e6)],
        "topk": [_m(2.0, 1e5, 8e6), _m(6.0, 1e5, 8e6)],
        "compute": [_m(10.0, 0), _m(10.0, 0)],
        "ddp": [_m(2.0, 8e6)],
    }
    rows = {r.codec: r for r in summarize(results, servers=1, workers=2, bandwidth_bits=100_000_000)}
    assert rows["none"].it_per_s == 2.0 and rows["none"].it_per_s_spread == 1.0 and rows["none"].runs == 2
    assert rows["topk"].speedup == 2.0
    assert rows["topk"].compression == pytest.approx(16e6 / 8.1e6)
    # 8 MB through the server's 100 Mbit/s link takes 0.64 s; compute alone 0.1 s
    assert rows["none"].ideal_it_per_s == pytest.approx(1 / 0.64)
    assert rows["topk"].of_ideal == pytest.approx(4.0 / (1 / 0.64))
    # DDP: each worker's link carries its half of the 8 MB
    assert rows["ddp"].ideal_it_per_s == pytest.approx(1 / 0.32)
    assert rows["compute"].ideal_it_per_s == 10.0
    assert rows["topk"].it_per_s_runs == [2.0, 6.0]


def test_summarize_pairs_rounds_so_drift_cancels():
    # round 2 ran on a slower machine for both: per round topk is 3x, 1x, 3x none
    results = {"none": [_m(1.0, 8e6), _m(3.0, 8e6), _m(2.0, 8e6)], "topk": [_m(3.0, 1e5), _m(3.0, 1e5), _m(6.0, 1e5)]}
    results["compute"] = [_m(4.0, 0), _m(12.0, 0), _m(8.0, 0)]
    rows = {r.codec: r for r in summarize(results)}
    assert rows["topk"].speedup == 3.0  # the ratio of the medians would say 3 / 2 = 1.5
    assert rows["topk"].of_ideal == 0.75  # per round 0.75, 0.25, 0.75; the medians: 3 / 8


def test_baseline_speedup_is_exactly_one():
    # x * (1 / x) is not 1.0 in floating point for these x; the none row must still say 1.0
    for x in (0.013, 0.021, 2.3, 7.1, 9.87654321):
        rows = summarize({"none": [_m(x, 8e6)], "compute": [_m(x, 0)]}, bandwidth_bits=10**12)
        assert rows[0].speedup == 1.0 and rows[1].of_ideal == 1.0


def test_busiest_link_per_topology():
    from psgrad.bench.results import busiest_link

    m = {"bytes_up": 8e6, "bytes_down": 6e6}  # a step's bytes over all ranks
    assert busiest_link(m, topology="ps", baseline=False, servers=2, workers=4) == 4e6  # a server's ingress
    assert (
        busiest_link(m, topology="colocated", baseline=False, servers=1, workers=4) == 3.5e6
    )  # each rank sends its share
    assert busiest_link(m, topology="alltoall", baseline=False, servers=1, workers=4) == 2e6
    assert busiest_link(m, topology="ps", baseline=True, servers=1, workers=4) == 2e6  # a DDP worker's own share


def test_time_to_target_excludes_evaluation_pauses():
    from psgrad.runlogs import to_target

    rows = [{"step": s, "wall": 1.0 * (s + 1), "bytes_up": 100_000, "bytes_down": 50_000} for s in range(10)]
    evals = [
        {"step": 1, "test_acc": 0.3, "eval_seconds": 0.5},
        {"step": 3, "test_acc": 0.6, "eval_seconds": 0.5},
        {"step": 5, "test_acc": 0.8, "eval_seconds": 0.5},
        {"step": 9, "test_acc": 0.7, "eval_seconds": 0.5},
    ]
    got = to_target(rows, evals, 0.75)
    # step 5 (the 6th, 0-based as every step column) ends 6.0 s into the run, of which two
    # evaluations (1.0 s) were pauses
    assert got == {"target_steps": 6, "target_seconds": 5.0, "target_mb": 0.9, "final_acc": 0.7}
    never = to_target(rows, evals, 0.9)
    assert never["final_acc"] == 0.7 and all(never[k] != never[k] for k in ("target_steps", "target_seconds"))
    # rows are found by their step, not their position; missing ones are an error, not a wrong answer
    assert to_target(rows[::-1], evals, 0.75) == got
    with pytest.raises(ValueError, match="rows of steps 0..5"):
        to_target(rows[3:], evals, 0.75)


def test_the_rate_of_a_row_that_evaluates_leaves_the_pauses_out():
    """A row timed to an accuracy evaluates in the foreground; compute-only does not. Its it/s
    counted the pauses (WRN-16-4 at 10 Mbit/s: 1.84 it/s against 2.12 between evaluations), so
    "of ideal" ranked it below what it trains at."""
    from psgrad.bench.launcher import measure

    # a step a second, and 0.5 s of evaluation after steps 1, 3, 5 and 9 (the last: outside the span)
    evals = [{"step": s, "test_acc": 0.5, "eval_seconds": 0.5} for s in (1, 3, 5, 9)]
    wall, rows = 0.0, []
    for s in range(10):
        wall += 1.0
        rows.append({"step": s, "wall": wall, "bytes_up": 0.0, "bytes_down": 0.0})
        wall += 0.5 if s in (1, 3, 5) else 0.0
    assert measure(rows, 2, evals)["it_per_s"] == pytest.approx(1.0)  # steps 2..9: 7 s of training
    assert measure(rows, 2)["it_per_s"] == pytest.approx(7 / 8.0)  # without the evaluations: what was
    assert measure(rows, 0, [{"step": 1, "paused_seconds": 0.5, "eval_seconds": 9.0}])["it_per_s"] == pytest.approx(
        9 / 10.0
    )


def test_the_runs_last_step_which_settles_every_exchange_is_not_timed(monkeypatch):
    """The run's last step completes every exchange in flight: with overlapped local steps it
    waits for a whole exchange (16 s of a 1 Mbit/s run's 80) that the steady state hides, and
    counting it put such rows 20 % below their pace. A row runs one step more than it times."""
    from psgrad.bench import launcher
    from psgrad.config import RunConfig
    from psgrad.train import RunResult

    def run(cfg, **kw):
        # a step a second, and the last one 50 s long
        rows = [{"step": s, "wall": s + 1.0 + (50.0 if s == cfg.steps - 1 else 0.0)} for s in range(cfg.steps)]
        return RunResult("worker", 0, cfg.steps, rows=rows)

    monkeypatch.setattr("psgrad.train.run", run)
    timed = launcher.run_item("none", RunConfig(), steps=8, warmup=2)
    assert timed["it_per_s"] == pytest.approx(1.0)


def test_bench_runs_keep_every_metrics_row(monkeypatch):
    """psgrad bench's time to accuracy reads a run's rows in memory: a run of more steps than a
    run keeps (2,000) gave the seconds of a later step (rows[s] was not step s). Bench runs keep
    them all; other runs stay bounded (tests/test_training.py::test_memory_stays_flat_over_a_long_run)."""
    from psgrad import metrics
    from psgrad.bench import launcher
    from psgrad.config import RunConfig

    monkeypatch.setattr(metrics, "ROWS_KEPT", 5)
    kept = {}
    for keep_all in (True, False):
        log = metrics.MetricsLog(
            None, total_steps=12, start_step=0, steps_per_epoch=4, label="test", progress=False, keep_all_rows=keep_all
        )
        for step in range(12):
            log.step({"step": step, "loss": 1.0, "it_per_s": 1.0, "bytes_up": 0, "bytes_down": 0, "wall": float(step)})
        kept[keep_all] = [r["step"] for r in log.rows]
        log.close()
    assert kept == {True: list(range(12)), False: list(range(7, 12))}
    seen = {}
    monkeypatch.setattr("psgrad.train.run", lambda cfg, **kw: seen.update(cfg=cfg, **kw))
    with pytest.raises(AttributeError):  # the stub returns no result; the config is what matters
        launcher.run_item("none", RunConfig(), steps=3, warmup=0)
    assert seen["keep_all_rows"] is True


def test_target_table_ranks_by_seconds_and_says_never():
    from psgrad.bench.results import BenchRow, target_table

    def row(name, seconds, acc, rounds):
        return BenchRow(name, it_per_s=1.0, it_per_s_spread=0.0, speedup=1.0, bytes_per_step=1.0, bytes_up=1.0,
                        bytes_down=0.0, compression=1.0, runs=2, hidden_comm_share=0.5, target_seconds=seconds,
                        target_steps=10, target_mb=1.0, final_acc=acc, target_rounds=rounds)  # fmt: skip

    text = target_table([row("slow", 9.0, 0.9, 2), row("never", float("nan"), 0.4, 0), row("fast", 3.0, 0.8, 2)], 0.7)
    order = [line.split()[0] for line in text.splitlines()[3:6]]
    assert order == ["fast", "slow", "never"]
    assert "0/2" in text.splitlines()[5] and "-" in text.splitlines()[5].split()[1]


def test_bench_time_to_accuracy_rows(tmp_path):
    out = tmp_path / "t.json"
    proc = _launcher(
        [
            *SMALL,
            "--steps",
            "12",
            "--warmup-steps",
            "1",
            "--eval-every-steps",
            "4",
            "--codecs",
            "none;sign --feedback ef",
        ]
        + ["--baselines", "compute,ddp", "--target-accuracy", "0.3", "--json", str(out)]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["codec"]: r for r in json.loads(out.read_text())}
    for name in ("none", "sign --feedback ef", "ddp"):
        assert 0 <= rows[name]["final_acc"] <= 1 and rows[name]["target_rounds"] in (0, 1), name
        if rows[name]["target_rounds"]:
            assert rows[name]["target_steps"] in (4, 8, 12, 13) and rows[name]["target_seconds"] > 0
    assert rows["compute"]["final_acc"] is None  # no single model to evaluate
    assert "time to test accuracy 0.300" in proc.stdout
    # each evaluation is said as it happens, a run to an accuracy being hours long: psgrad's rows
    # and DDP's (which printed none), not compute-only's, which evaluates nothing
    said = [line for line in proc.stderr.splitlines() if "test accuracy" in line and "   step " in line]
    for run, name in ((1, "none"), (2, "sign"), (4, "ddp")):
        steps = [int(line.split("step ")[1].split(":")[0]) for line in said if line.startswith(f"[bench {run}/4]")]
        assert steps == [4, 8, 12, 14], (name, said)  # every 4th step, and the run's last (its 14th)
    assert not [line for line in said if line.startswith("[bench 3/4]")], said


def test_baselines_follow_the_runs_learning_rate_schedule():
    """DDP rows must train at the schedule psgrad's servers use, or time to accuracy compares apples with pears."""
    import torch

    from psgrad.bench.baselines import train_rows
    from psgrad.config import RunConfig

    class Loader:
        def batch(self, step):
            return torch.randn(4, 3), torch.tensor([0, 1, 0, 1])

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=99.0)
    seen = []
    rows, evals = train_rows(
        RunConfig(),
        model,
        loader=Loader(),
        optimizer=optimizer,
        steps=3,
        bytes_of_step=lambda: 0,
        lr_at=lambda s: seen.append(s) or 0.01 * (s + 1),
    )
    assert len(rows) == 3 and evals == [] and seen == [0, 1, 2]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.03)


def test_an_output_file_that_cannot_be_written_is_refused_before_measuring(tmp_path):
    """An output file is tried when the command starts: a folder that takes no new file (as root
    every mode check passes, and /proc takes none) used to end a measurement in a traceback.
    The try leaves nothing behind: no new file, an existing one as it was."""
    from click.testing import CliRunner

    from psgrad.cli import main
    from psgrad.cli.checks import output_file

    done = CliRunner().invoke(main, ["codecs", "--sizes", "1K", "--json", "/proc/psgrad-test.json"])
    assert done.exit_code == 2 and "/proc/psgrad-test.json" in done.output, done.output
    assert "Traceback" not in done.output and "available codecs" not in done.output, done.output
    done = CliRunner().invoke(main, ["codecs", "--sizes", "1K", "--codecs", ";"])
    assert done.exit_code == 2 and "no codec specs" in done.output, done.output
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("kept")
    assert output_file(None, None, str(new)) == str(new) and not new.exists()
    assert output_file(None, None, str(old)) == str(old) and old.read_text() == "kept"


def test_codec_report_per_size_and_per_model(tmp_path):
    """psgrad codecs: one row per codec and size (its own memcpy yardstick), or per codec over a
    model's layers; sizes take K/M suffixes and bad ones are refused by name."""
    from click.testing import CliRunner

    from psgrad.bench import codecbench
    from psgrad.cli import main

    assert codecbench.parse_size("256K") == 1 << 18 and codecbench.parse_size("3") == 3
    assert codecbench.parse_size("2048M") == 1 << 31
    with pytest.raises(ValueError, match="most one message may carry"):  # it was a 400 GB allocation
        codecbench.parse_size("2049M")
    runner = CliRunner()
    out = runner.invoke(main, ["codecs", "--sizes", "1K,8K", "--repeat", "1", "--codecs", "none;sign", "--json", "-"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)["rows"]
    sign = "sign:bucket=0"  # rows name every parameter of the codec, defaults included
    assert [(r["codec"], r["size"]) for r in rows] == [("none", 1024), (sign, 1024), ("none", 8192), (sign, 8192)]
    assert rows[3]["wire_bytes"] < rows[2]["wire_bytes"] / 25 and rows[0]["memcpy_gbps"] > 0
    saved = tmp_path / "codecs.json"
    model = runner.invoke(
        main, ["codecs", "--model", "resnet20", "--repeat", "1", "--codecs", "topk:ratio=0.1", "--json", str(saved)]
    )
    assert model.exit_code == 0 and "topk" in model.stdout, model.output  # the table, and the file
    (row,) = json.loads(saved.read_text())["rows"]
    assert row["size"] == 275_572 and row["tensors"] == 59
    bad = runner.invoke(main, ["codecs", "--sizes", "4X"])
    assert bad.exit_code == 2 and "expected a size like" in bad.output
    # what the chosen way of coding would ignore is refused (each was ignored without a word)
    for options, said in [
        (["--model", "mlp", "--sizes", "1K"], "--sizes and --model are two ways to say what to code: give one"),
        (["--depth", "28"], "--depth shapes a WideResNet: it means nothing without --model wrn"),
        (["--model", "resnet20", "--widen-factor", "2"], "--widen-factor shapes a WideResNet: it means nothing to"),
        (["--classes", "10"], "--classes sizes the output layer of --model: it means nothing without one"),
    ]:
        refused = runner.invoke(main, ["codecs", "--repeat", "1", "--codecs", "none", *options])
        assert refused.exit_code == 2 and said in refused.output, refused.output
    # at its default an option is not refused, as the training commands' are not: a script may pass them all
    kept = runner.invoke(
        main, ["codecs", "--repeat", "1", "--codecs", "none", "--sizes", "1K", "--depth", "16", "--classes", "100"]
    )
    assert kept.exit_code == 0 and "none" in kept.stdout, kept.output
    # --sizes at its default, spelt as the default is, is what its callback turns into sizes: not refused
    kept = runner.invoke(
        main,
        ["codecs", "--repeat", "1", "--codecs", "none", "--model", "mlp", "--sizes", "256K,4M,16M", "--depth", "16"],
    )
    assert kept.exit_code == 0 and "none" in kept.stdout, kept.output


def test_a_codec_table_keeps_its_columns_under_a_long_spec():
    """A spec longer than the codec column (PowerSGD's, with its defaults) widens the column: its
    row's numbers stay under their headings."""
    from psgrad.bench import codecbench

    rows = codecbench.run(("powersgd:rank=2", "none"), sizes=(1024,), repeat=1)
    assert len(rows[0].codec) > 40
    head, _, *lines = codecbench.table(rows).splitlines()[1:]
    assert {len(line) for line in lines} == {len(head)}


def test_a_codec_table_shows_the_best_accuracy_psgrad_measured_with_each_codec():
    """psgrad codecs times codecs alone: beside each, the best combination psgrad measured with it,
    the lowest over its datasets, marked when even that trails dense."""
    from psgrad.bench import codecbench

    specs = ("none", "qsgd:levels=16", "topk:ratio=0.01", "sign", "fp16")
    rows = codecbench.run(specs, sizes=(1024,), repeat=1)
    head, _, *lines = codecbench.table(rows).splitlines()[1:]
    assert head.split()[-1] == "acc" and {len(line) for line in lines} == {len(head)}
    # dense; QSGD-16 both ways (0.998, 0.991 digits, 1.01 held-out); top-k with ef and a dense
    # down-link (0.934, 0.969, 0.93); sign with ef and QSGD-16 down (0.983, 0.989); fp16 unmeasured
    assert [line.split()[-1] for line in lines] == ["1.00", "0.99", "0.93!", "0.98!", "?"]
    assert codecbench.ACCURACY_LEGEND.startswith("acc: the best test accuracy")


_LOCAL_CODED = "qsgd:levels=16 --feedback ef --down-codec qsgd:levels=64 --topology colocated --local-steps 32"


@pytest.mark.parametrize(
    "item, acc",
    [
        ("none", "1.00"),
        ("ddp", "1.00"),
        ("compute", "-"),  # learns nothing
        ("topk:ratio=0.01 --feedback ef", "0.93!"),  # the lowest of 0.934 (proxy), 0.969 (digits), 0.93 (held-out)
        ("powersgd:rank=8 --topology colocated --push after", "0.99"),  # 0.998 rounded down, at parity
        ("sign --feedback ef --down-codec sign", "0.85!"),  # 0.97 on the proxy, 0.85 held-out
        ("qsgd:levels=4", "?"),  # never measured
        ("none --topology colocated --local-steps 5", "?"),  # local steps nothing measured are not dense
        ("ddp-powersgd", "0.98!"),  # judged by psgrad's powersgd:rank=2
        (f"{_LOCAL_CODED} --api optimizer", "?"),  # your loop codes the mean change: never measured
        (_LOCAL_CODED, "0.99"),  # psgrad train codes the outer update: 0.992 proxy, 1.006 digits
    ],
)
def test_each_bench_row_shows_the_accuracy_psgrad_measured(item, acc):
    """A speed ranks nothing alone: each row of the it/s table carries what psgrad measured of
    its combination's accuracy, the lowest over the datasets, marked when it trails dense."""
    from dataclasses import replace

    from psgrad.bench.results import BenchRow, table
    from psgrad.bench.rows import measured_accuracy
    from psgrad.config import RunConfig

    row = BenchRow(item, it_per_s=1, it_per_s_spread=0, speedup=1, bytes_per_step=1, bytes_up=1, bytes_down=0,
                   compression=1, runs=1, hidden_comm_share=0)  # fmt: skip
    row = replace(row, **measured_accuracy(item, RunConfig(), powersgd_rank=2))
    head, _, line, *legend = table([row]).splitlines()
    assert head.split()[-1] == "acc" and line.split()[-1] == acc, line
    assert any(text.startswith("  acc: test accuracy at equal epochs over dense's") for text in legend)


def test_bench_table_is_narrow_by_default_with_a_legend():
    from psgrad.bench.results import BREAKDOWN, BenchRow, table

    rows = [
        BenchRow(
            "none",
            it_per_s=2.0,
            it_per_s_spread=0.1,
            speedup=1.0,
            bytes_per_step=4e6,
            bytes_up=2e6,
            bytes_down=0.5,
            compression=0.9,
            runs=2,
            hidden_comm_share=0.5,
            times={k: 0.01 for k in BREAKDOWN},
        ),
        BenchRow(
            "sign --feedback ef",
            it_per_s=3.0,
            it_per_s_spread=0.1,
            speedup=1.5,
            bytes_per_step=1e5,
            bytes_up=5e4,
            bytes_down=0.9,
            compression=0.95,
            runs=2,
            hidden_comm_share=0.6,
            times={k: 0.01 for k in BREAKDOWN},
        ),
    ]
    narrow, wide = table(rows), table(rows, wide=True)
    head = narrow.splitlines()[0].split()
    assert head[:4] == ["codec", "it/s", "±", "speedup"] and "forward" not in head and "hidden" not in head
    assert "  speedup: it/s over the `none` row's" in narrow and "--wide adds" in narrow
    assert "forward" in wide.splitlines()[0] and "hidden" in wide.splitlines()[0] and "--wide adds" not in wide
    assert "\n  ideal: " in wide and "\n  ideal: " not in narrow  # the legend of the columns shown, no other
    assert max(len(line) for line in narrow.splitlines()[:4]) < 110


def test_the_progress_bar_shows_the_rate_of_the_last_steps_not_of_one():
    """Records reach the metrics rank in bursts (16 simulated workers, async): one step's own rate
    read 2 then 32 it/s; the bar divides the last ten steps by their wall-clock time."""
    from psgrad import metrics

    log = metrics.MetricsLog(None, total_steps=30, start_step=0, steps_per_epoch=4, label="test", progress=True)
    walls = [0.5 * (step // 2) + 0.01 * (step % 2) for step in range(30)]  # pairs of steps 10 ms apart
    for step, wall in enumerate(walls):
        gap = wall - walls[step - 1] if step else 0.5
        row = {"step": step, "loss": 1.0, "it_per_s": 1 / gap, "bytes_up": 0, "bytes_down": 0, "wall": wall}
        log.step(row)
    shown = log.bar.postfix
    log.close()
    assert "100.00 it/s" not in shown and "2.00 it/s" not in shown
    expected = 10 / (walls[-1] - walls[-11])
    assert f"{expected:.2f} it/s" in shown, shown


def test_a_row_through_your_own_loop_is_a_row_option_of_its_own():
    """``--api optimizer`` is taken out of the row before its train options are parsed, is
    checked, and belongs to codec rows only."""
    from psgrad.bench.launcher import BenchError, run_in_mpi
    from psgrad.bench.rows import item_api, item_config
    from psgrad.config import RunConfig

    row = "powersgd:rank=8 --topology colocated --api optimizer"
    assert item_api(row) == ("powersgd:rank=8 --topology colocated", "optimizer")
    assert item_api("sign --feedback ef") == ("sign --feedback ef", "train")
    head, cfg = item_config(row, RunConfig())
    assert head == "powersgd:rank=8" and cfg.topology == "colocated"
    with pytest.raises(BenchError, match="--api must be one of train, optimizer"):
        item_api("none --api horovod")
    with pytest.raises(BenchError, match="baseline"):
        item_api("ddp --api optimizer")
    with pytest.raises(BenchError, match="jobs of their own"):  # psgrad.init joins a job once per process
        run_in_mpi(RunConfig(), [row], steps=1, warmup=0, repeat=1)


@pytest.mark.parametrize(
    "row, steps",
    [
        ("powersgd:rank=8 --topology colocated", "3"),
        ("qsgd:levels=16 --feedback ef --topology colocated --local-steps 2", "4"),  # 2 exchanges measured
    ],
)
def test_a_row_through_your_own_loop_measures_what_psgrad_train_sends(tmp_path, row, steps):
    """The documented own-loop rows (docs/benchmarks.md, "Your own loop") run: the row's exchange
    reaches psgrad.init and nothing else of the run (its model and steps are the loop's; init
    refused them, and every such row failed), each row sends as many bytes as psgrad train's
    (the same layers, the same codec; with local steps, read after the step that exchanged: they
    read 0), and no sentinel blames a rank at the job's clean end (the own loop's ranks left MPI
    without their goodbye)."""
    out, logs = tmp_path / "bench.json", tmp_path / "logs"
    rows = f"{row};{row} --api optimizer"
    proc = _launcher([*SMALL, "--steps", steps, "--warmup-steps", "1", "--baselines", "", "--codecs", rows,
                      "--json", str(out), "--log-dir", str(logs)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    train, own = json.loads(out.read_text())
    assert own["codec"].endswith("--api optimizer") and own["it_per_s"] > 0
    assert own["bytes_up"] == pytest.approx(train["bytes_up"], rel=0.01), (train["bytes_up"], own["bytes_up"])
    said = "".join(path.read_text() for path in logs.glob("*/job.log"))
    assert "psgrad sentinel" not in said and "UserWarning" not in said, said[-3000:]


@pytest.mark.parametrize(
    "args, timeout",
    [
        ([], 900.0),
        (["--target-accuracy", "0.5"], 4 * 3600.0),
        (["--target-accuracy", "0.5", "--job-timeout", "60"], 60.0),
    ],
)
def test_a_run_to_an_accuracy_gets_hours_not_the_throughput_rows_minutes(monkeypatch, args, timeout):
    """A WRN-16-4 run to 0.84 takes about 25 min: under the 15 min meant for throughput rows it
    was ended two thirds of the way, with nothing to show."""
    from click.testing import CliRunner

    from psgrad.cli import benching, main

    seen = {}
    monkeypatch.setattr(benching, "_bench_by_launcher", lambda *a, launch, **kw: seen.update(launch))
    done = CliRunner().invoke(main, ["bench", "--model", "mlp", "--steps", "4", "--codecs", "none", *args])
    assert done.exit_code == 0, done.output
    assert seen["timeout"] == timeout


class _TwoRanks:
    """Rank 0 of a two-rank allreduce whose other rank reports ``theirs``."""

    rank, size = 0, 2

    def __init__(self, theirs: list[float]) -> None:
        self.theirs = theirs

    def allreduce_sum(self, values):
        import numpy as np

        table = np.asarray(values, dtype=float).reshape(2, -1)
        table[1] += self.theirs
        return table.ravel()


def test_compute_only_runs_at_the_slowest_ranks_pace():
    """The ceiling of a job that waits for every worker: each step ends when its last rank's does."""
    from psgrad.bench.baselines import slowest_clock

    rows = [{"wall": w} for w in (1.0, 2.0, 3.0)]
    slowest_clock(rows, transport=_TwoRanks([1.5, 2.0, 3.3]))
    assert [row["wall"] for row in rows] == [1.5, 2.0, 3.3]
