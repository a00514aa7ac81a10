"""``psgrad bench``: the same training for each codec (and baseline), one table of it/s and bytes.

Two ways to run it:

* Started without MPI (``psgrad bench ...``), it is a launcher: every (round, item) is its own
  ``mpiexec`` job (servers + workers ranks for a codec, workers ranks for a baseline), optionally inside bandwidth-shaped network namespaces
  (``--bandwidth``, see ``psgrad.bench.netshape``). A job that fails or overruns ``--job-timeout``
  fails its row, with the job's own error output; the other rows go on (``orchestrate``).
* Started under MPI (``mpiexec -n 3 psgrad bench ...``), all codecs run inside that one job
  (no baselines, no shaping: those need their own jobs).

The figures, either way:

1. ``steps`` measured steps per run after ``warmup`` excluded ones and before ``TAIL_STEPS``
   more; it/s is the wall-clock rate between the first and last measured step. The run's last
   step is left out because it completes every exchange still in flight: with overlapped local
   steps it waits for a whole exchange that the steady state hides (16 s of a 1 Mbit/s run's 80).
2. With ``repeat`` R the items run in R interleaved rounds (none, a, b, none, a, b, ...) so drift
   of a shared machine hits all of them alike; the median and half the spread are reported.
3. Speed-up and compression ratio are against the ``none`` codec of the same invocation. Speed-up
   and "of ideal" are paired: the median over rounds of the ratio to the same round's ``none``
   (or compute-only) run, so a machine that is slower in one round slows both sides of the ratio.
4. Server CPU is the CPU seconds the server-0 process used per second of wall time (1.0 = one core).
5. With the compute-only baseline, ideal it/s = 1 / max(compute step time, link bytes / bandwidth),
   where the link is the busiest one (``busiest_link``). Unshaped runs have no bandwidth figure
   and their ideal is the compute-only it/s.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from ..checkpoint import step_dirs
from ..config import RunConfig
from ..metrics import say
from ..runlogs import paused, to_target
from ..runtime.signals import stop_reason
from .baselines import BASELINES
from .jobs import BenchError, launcher_args, row_log_dir, run_job
from .results import BREAKDOWN, NAN, target_note
from .rows import item_api, item_config, ranks_for

_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")


def launched_by_mpi() -> bool:
    """True inside an mpiexec/mpirun/srun-started process (checked without initialising MPI)."""
    return any(key in os.environ for key in _MPI_ENV)


TAIL_STEPS = 1
"""Steps run after the measured ones and left out of the figures (module docstring, 1)."""


def measure(rows: list[dict], warmup: int, evals: list[dict] = ()) -> dict:
    """Rate, mean bytes and times, and server CPU share over the steps after ``warmup``; the
    pauses of ``evals`` (``paused``) inside the measured steps are left out of the rate, as they
    are of the time to accuracy, so a row that evaluates is compared with compute-only fairly."""
    tail = rows[warmup:] or rows
    wall = [r["wall"] for r in tail]
    # an evaluation after a measured step other than the last held the clock up inside the span
    first, last = (int(tail[0]["step"]), int(tail[-1]["step"])) if evals else (0, 0)
    held = sum(paused(e) for e in evals if first <= int(e["step"]) < last)
    span = wall[-1] - wall[0] - held if len(wall) > 1 else 0.0
    # the wall-clock rate between the first and last measured step, not the sum of per-step
    # times, which would miss the time spent between steps
    out = {"it_per_s": (len(wall) - 1) / span if span > 0 else 1.0 / tail[0]["step_time"]}
    for key in ("bytes_up", "bytes_down", *BREAKDOWN):
        out[key] = statistics.fmean(r.get(key, 0.0) for r in tail)
    # the last measured step's loss: a diverging configuration shows itself in the table
    out["loss"] = float(tail[-1].get("loss", NAN))
    cpu = [r.get("server_cpu") for r in tail]
    out["server_cpu"] = (cpu[-1] - cpu[0]) / span if span > 0 and None not in cpu and "" not in cpu else NAN
    return out


# ---------------------------------------------------------------------- one run (under MPI)
def run_item(
    item: str, cfg: RunConfig, *, steps: int, warmup: int, powersgd_rank: int = 2, target: float | None = None
) -> dict | None:
    """Run one item (codec or baseline) on every rank of this MPI job; rank 0 gets the measurement.

    With ``target``, the run evaluates every ``cfg.eval_every_steps`` steps and the measurement adds
    its time to that test accuracy (``to_target``).
    """
    head, cfg = item_config(item, cfg)
    measured = steps + warmup
    total = measured + TAIL_STEPS
    if item_api(item)[1] == "optimizer":
        if target:
            raise BenchError(f"{item!r}: --api optimizer measures steps a second, not time to accuracy")
        from .ownloop import own_loop_rows

        rows = own_loop_rows(replace(cfg, progress=False, log_dir=None), steps=total)
        return measure(rows[:measured], warmup) if rows is not None else None
    if head in BASELINES:
        from .baselines import run_baseline

        rows, evals = run_baseline(
            head,
            replace(cfg, steps=total, eval_every_steps=cfg.eval_every_steps if target else 0),
            total,
            powersgd_rank,
        )
        if not rows:
            return None
        timed = measure(rows[:measured], warmup, evals)
        return timed | (to_target(rows, evals, target) if target and head != "compute" else {})
    from ..train import run

    eval_every_steps = cfg.eval_every_steps if target else 0
    # evaluation in the foreground: to_target then takes exactly its time out of the clock
    bench_cfg = replace(
        cfg,
        steps=total,
        consensus_every_steps=0,  # a gossip run's consensus distance is an allreduce of the model: not timed
        eval_every_epochs=0,
        eval_every_steps=eval_every_steps,
        eval_background=False,
        progress=False,
    )
    # to_target reads every row up to the target; a stopped bench row has nothing worth saving
    result = run(bench_cfg, keep_all_rows=True, save_on_stop=False)
    if result.rank != 0:
        return None
    if cfg.log_dir:
        _keep_row_logs(Path(cfg.log_dir), item)
    timed = measure(result.rows[:measured], warmup, result.evals)
    return timed | (to_target(result.rows, result.evals, target) if target else {})


def _keep_row_logs(log_dir: Path, item: str) -> None:
    """A row's log dir keeps its logs and says which row it was (row.txt); the checkpoint and
    model that a run with a log dir writes at its end (tens of MB a row) go."""
    (log_dir / "row.txt").write_text(item + "\n")
    (log_dir / "model.pt").unlink(missing_ok=True)
    for path in step_dirs(log_dir).values():
        shutil.rmtree(path)


def run_in_mpi(
    cfg: RunConfig, specs: list[str], *, steps: int, warmup: int, repeat: int, target: float | None = None
) -> dict[str, list[dict]]:
    """Every rank of the current MPI job calls this; rank 0 gets {spec: [measurement per round]}."""
    ours = [spec for spec in specs if item_api(spec)[1] == "optimizer"]
    if ours:  # psgrad.init joins a job once per process
        raise BenchError(f"{ours[0]!r}: --api optimizer rows need jobs of their own: run psgrad bench without mpiexec")
    results: dict[str, list[dict]] = {s: [] for s in specs}
    for round_ in range(repeat):
        for index, spec in enumerate(specs):
            row_cfg = replace(cfg, log_dir=row_log_dir(cfg.log_dir, round_ * len(specs) + index + 1, round_, spec))
            m = run_item(spec, row_cfg, steps=steps, warmup=warmup, target=target)
            if m is not None:
                results[spec].append(m)
    return results


# ---------------------------------------------------------------------- the launcher
@dataclass
class Measured:
    """What the launcher measured: each item's result per round it ran, and the one-line reason
    of each item whose job failed (it is not run again in later rounds)."""

    results: dict[str, list[dict]]
    failed: dict[str, str] = field(default_factory=dict)
    interrupted: BaseException | None = None  # Ctrl-C or SIGTERM after some runs: raise it after their table

    def stop(self, err: KeyboardInterrupt, *, run: str) -> Measured:
        """Ctrl-C or SIGTERM in ``run``: raised again when no run was measured yet; else kept in
        ``interrupted``, and the runs measured before it are what the bench returns."""
        stopped = f"[bench] {stop_reason(err)[0]} in {run}: its job was stopped"
        if not any(self.results.values()):
            say(f"{stopped}, no table")
            raise err
        say(f"{stopped}; the table holds the runs measured before it")
        self.interrupted = err
        return self


def orchestrate(
    cfg: RunConfig,
    items: list[str],
    *,
    steps: int,
    warmup: int,
    repeat: int,
    workers: int,
    mpiexec: str,
    mpiexec_args: list[str],
    timeout: float,
    bandwidth: str | None = None,
    powersgd_rank: int = 2,
    target: float | None = None,
) -> Measured:
    """Run every item ``repeat`` times, interleaved, each as its own mpiexec job. A job that fails
    or overruns ``timeout`` fails its item, said at once and skipped in later rounds, and the others
    go on (an hour of rows is not lost to the last); Ctrl-C or SIGTERM stops the job and the bench,
    whose runs measured before it are returned with the stop in ``interrupted``."""
    from contextlib import nullcontext

    from .netshape import ShapedNetwork, check_available

    if bandwidth:
        check_available(mpiexec)
    mpiexec_args = launcher_args(mpiexec, mpiexec_args)
    measured = Measured({item: [] for item in items})
    total, done = repeat * len(items), 0
    spec = {"config": json.loads(cfg.to_json()), "steps": steps, "warmup": warmup}  # what every job shares
    spec |= {"powersgd_rank": powersgd_rank, "target": target}
    most = max(ranks_for(item, cfg, workers) for item in items)
    where = f"{bandwidth} links" if bandwidth else "loopback"
    with ShapedNetwork(most, bandwidth) if bandwidth else nullcontext() as net, tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **(net.environment() if net else {})}
        run_row = partial(_run_row, mpiexec=[mpiexec, *mpiexec_args], net=net, env=env, timeout=timeout)
        for round_ in range(repeat):
            for item in items:
                done += 1
                n, run = ranks_for(item, cfg, workers), f"[bench {done}/{total}]"
                if item in measured.failed:
                    say(f"{run} round {round_ + 1}: {item} skipped: its job failed before")
                    continue
                say(f"{run} round {round_ + 1}: {item} on {n} rank(s), {where}")
                job = spec | {"item": item, "log_dir": row_log_dir(cfg.log_dir, done, round_, item)}
                started = time.perf_counter()
                try:
                    m = run_row(
                        job, Path(tmp) / f"job-{done}", ranks=n, on_line=_evaluations_said(run) if target else None
                    )
                except KeyboardInterrupt as err:
                    return measured.stop(err, run=f"run {done}/{total}")
                except BenchError as err:
                    measured.failed[item] = err.reason
                    say(f"{run}   failed: {err}")
                    continue
                measured.results[item].append(m)
                took = f"{target_note(m, target)} ({time.perf_counter() - started:.0f} s)"
                say(f"{run}   {m['it_per_s']:.2f} it/s, {(m['bytes_up'] + m['bytes_down']) / 1e6:.2f} MB/step{took}")
    return measured


_EVALUATION = re.compile(r"^\[eval\] .*?step (\d+): test loss \S+, accuracy ([\d.]+)")


def _evaluations_said(run: str) -> Callable[[str], None]:
    """What says each evaluation a row's job prints (``[eval] ... step S: ... accuracy A``, rank 0's
    line) as that row's progress, ``[bench k/N]   step S+1: test accuracy A``: a run to an
    accuracy takes up to hours, and said nothing until its end."""

    started = time.perf_counter()

    def said(line: str) -> None:
        if (found := _EVALUATION.match(line)) is not None:
            took = time.perf_counter() - started
            say(f"{run}   step {int(found[1]) + 1}: test accuracy {float(found[2]):.3f} ({took:.0f} s)")

    return said


def _run_row(
    job: dict,
    files: Path,
    *,
    ranks: int,
    mpiexec: list[str],
    net,
    env: dict[str, str],
    timeout: float,
    on_line: Callable[[str], None] | None = None,
) -> dict:
    """One row's job: ``job`` written to FILES.json, ``mpiexec -n RANKS python -m psgrad.bench
    FILES.json`` (each rank in its namespace on a shaped ``net``) run to its end, and the
    measurement its rank 0 wrote to FILES.out.json (BenchError if the job failed or wrote none)."""
    spec, out = files.with_suffix(".json"), files.with_suffix(".out.json")
    spec.write_text(json.dumps(job | {"out": str(out)}))
    command = [sys.executable, "-m", "psgrad.bench", str(spec)]
    cmd = [*mpiexec, "-n", str(ranks), *(net.wrap(command) if net else command)]
    run_job(cmd, env, timeout, log=Path(job["log_dir"]) / "job.log" if job["log_dir"] else None, on_line=on_line)
    if not out.exists():
        raise BenchError(f"the job ended without writing its result: {shlex.join(cmd)}")
    return json.loads(out.read_text())


def _child(job_path: str) -> None:
    """Entry of one launcher job: ``mpiexec -n N python -m psgrad.bench JOB.json``."""
    from ..runtime.allocator import keep_freed_memory
    from ..runtime.sentinel import hold_goodbyes

    keep_freed_memory()  # a bench job's ranks run as psgrad train's do
    hold_goodbyes()  # the process ends with the job (finalize_and_exit): a rank dying on the way out is named too
    from ..agreement import AgreementError
    from ..comm.transport import finalize_and_exit

    job = json.loads(Path(job_path).read_text())
    cfg = replace(RunConfig.from_dict(job["config"]), log_dir=job["log_dir"])
    try:
        m = run_item(
            job["item"],
            cfg,
            steps=job["steps"],
            warmup=job["warmup"],
            powersgd_rank=job["powersgd_rank"],
            target=job["target"],
        )
    except AgreementError as err:  # one rank said why (an unreadable dataset, say): the job's last line
        finalize_and_exit(err.status)
    if m is not None:
        Path(job["out"]).write_text(json.dumps(m))

    # every rank waits for the others before leaving: on a shaped run a rank's network namespace
    # goes with it, and a rank still finishing (rank 0's final evaluation of WRN-16-4 takes
    # seconds) then blocks in connect() to the gone address while MPI says goodbye
    finalize_and_exit(0)


# ---------------------------------------------------------------------- the table
