"""How fast ``psgrad simulate`` runs N workers, against one worker training alone on the same
total batch: ``python -m psgrad.bench.simulation --workers 16 --batch-size 8 --codecs "none;sign"``.

1. Alone: one model trains on batches of N x B with plain ``torch.optim.SGD`` (momentum 0.9), its
   images in the layout psgrad's workers use (``--memory-format``, channels-last on CPU by
   default; two runs each way against contiguous come first, for the record), once with one
   torch thread (a psgrad worker's default) and once with one thread per core.
   Its rate is the median step time's inverse. It runs just before and just after every
   simulation, with as many threads as the simulation has cores: "x near" divides the
   simulation by the mean of those two, "x fastest" by the fastest alone run of all. (One VM's
   speed drifted by a third within minutes, 2.6-4.0 it/s for the same loop; with glibc's default
   malloc the loop also varied from 6 to 9 it/s, its batch of 128 faulting in fresh pages each
   step, which freed memory kept, psgrad/runtime/allocator.py, ended.)
2. Simulated: ``simulate`` with N workers of batch B (stacked, one group per core, by default;
   ``--stack on|off`` to choose), for each row (a codec spec, optionally
   followed by train options for that row, as in ``psgrad bench --codecs``), once with one core
   (``--cores 1``: the ranks run one at a time) and once with every core (when there is more
   than one). The rate is rank 0's median step rate after the first five steps.
3. Where the one-core simulation's step goes. Ranks run one at a time there, so each phase's time
   is CPU time: compute = N x (forward + backward) (stacked: the pass, each worker counted with
   its share and its wait for the others counted as a wait); coding = N x (encode + decode) + the server's
   decode (and summing); optimizer = the server's apply + N x the workers' apply; loading = N x
   loading a batch (the lone worker loads its own too: the report gives its time); the rest of
   the step is bookkeeping (messaging, hooks, handing the core from rank to rank).
The dataset is the synthetic default, so the accuracies it prints are the synthetic set's.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import replace

import torch

from ..config import RunConfig
from ..data import ShardLoader
from ..models import build_model
from ..runtime.allocator import keep_freed_memory
from ..sim.simulate import simulate
from .baselines import train_rows
from .codecbench import cpu_name
from .rows import item_config

WARMUP = 5
_STACKING = {
    True: "workers stacked, one group per core (--stack, simulate's default)",
    False: "one pass per worker (--no-stack)",
}


def alone(cfg: RunConfig, total_batch: int, steps: int, threads: int) -> tuple[float, float]:
    """Steps per second of one model trained alone on batches of ``total_batch``, and the median
    seconds of a step spent loading its batch."""
    torch.set_num_threads(threads)
    keep_freed_memory()
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.num_classes, **cfg.model_options)
    from ..shards import load_split  # here, not above: ..simulate first keeps MPI from starting at import

    data = load_split(cfg, "train")
    loader = ShardLoader(
        data,
        dataset=cfg.dataset,
        worker=0,
        workers=1,
        batch_size=total_batch,
        seed=cfg.seed,
        partition=cfg.partition,
        augment=cfg.augment,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    rows, _ = train_rows(
        cfg, model, loader=loader, optimizer=optimizer, steps=steps, bytes_of_step=lambda: 0, lr_at=lambda step: cfg.lr
    )
    timed = rows[WARMUP:]
    rate = 1.0 / statistics.median(row["load"] + row["step_time"] for row in timed)
    return rate, statistics.median(row["load"] for row in timed)


def simulated(cfg: RunConfig, workers: int, cores: int, stack: bool = True) -> dict:
    """Rate, phase breakdown (ms per step) and final loss of one simulation."""
    result = simulate(cfg, workers, cores=cores, stack=stack)[0]
    rows = result.rows[WARMUP:]
    rate = 1.0 / statistics.median(1.0 / row["it_per_s"] for row in rows)

    def ms(key: str, times: int = 1) -> float:
        """A worker phase's median over steps (the row holds the workers' mean), x ``times``."""
        return 1000.0 * times * statistics.median(row.get(key, 0.0) for row in rows)

    def server_ms(key: str) -> float:
        """A server phase's mean per step (the row holds its running total)."""
        return 1000.0 * (rows[-1][key] - rows[0][key]) / (len(rows) - 1)

    compute = ms("forward", workers) + ms("backward", workers)
    coding = ms("encode", workers) + ms("decode", workers) + server_ms("server_decode")
    optimizer = server_ms("server_apply") + ms("apply", workers)
    load = ms("load", workers)
    step = 1000.0 / rate
    return {
        "rate": rate,
        "compute": compute,
        "coding": coding,
        "optimizer": optimizer,
        "load": load,
        "rest": step - compute - coding - optimizer - load,
        "loss": result.rows[-1]["loss"],
    }


def report(
    workers: int,
    *,
    batch: int,
    rows: dict[str, RunConfig],
    steps: int,
    base: RunConfig,
    stack: bool = True,
    repeat: int = 1,
) -> str:
    """The markdown tables of one measurement of ``rows`` (label -> config; see the module docstring)."""
    measured = _measure(workers, batch=batch, rows=rows, steps=steps, base=base, stack=stack, repeat=repeat)
    return _tables(measured, workers=workers, batch=batch, steps=steps, base=base, stack=stack, repeat=repeat)


def _measure(
    workers: int, *, batch: int, rows: dict[str, RunConfig], steps: int, base: RunConfig, stack: bool, repeat: int
) -> dict:
    """Every row simulated ``repeat`` times on one core and on all, each run between two runs of
    one worker alone (this VM's speed drifts by a third in minutes), and the alone worker with
    and without ``base``'s memory format; the figures ``_tables`` prints."""
    cores = len(os.sched_getaffinity(0))
    alone_rates: dict[int, list[float]] = {1: [], cores: []}
    alone_loads: list[float] = []  # seconds, one thread

    def bracketed(cfg: RunConfig, simulation_cores: int) -> tuple[dict, float]:
        """A simulation between two alone runs with as many threads as it has cores: its result
        and the mean of those two rates."""
        before, load_before = alone(base, workers * batch, steps, simulation_cores)
        result = simulated(cfg, workers, simulation_cores, stack)
        after, load_after = alone(base, workers * batch, steps, simulation_cores)
        alone_rates[simulation_cores] += [before, after]
        if simulation_cores == 1:
            alone_loads.extend([load_before, load_after])
        return result, (before + after) / 2

    by_layout: dict[str, list[float]] = {"contiguous": [], base.memory_format: []}
    for _ in range(2):
        for name in by_layout:
            by_layout[name].append(alone(replace(base, memory_format=name), workers * batch, steps, 1)[0])
    runs: dict[str, list[dict]] = {item: [] for item in rows}
    for _ in range(repeat):
        for item, cfg in rows.items():
            single, near_one = bracketed(cfg, 1)
            full, near_every = bracketed(cfg, cores) if cores > 1 else (single, near_one)
            runs[item].append({"single": single, "full": full, "near_one": near_one, "near_every": near_every})
    torch.set_num_threads(1)
    return {
        "cores": cores,
        "alone_rates": alone_rates,
        "alone_loads": alone_loads,
        "by_layout": by_layout,
        "runs": runs,
    }


def _tables(measured: dict, *, workers: int, batch: int, steps: int, base: RunConfig, stack: bool, repeat: int) -> str:
    """The header, the rows' rates against one worker alone, and the one-core step's breakdown."""
    cores, alone_rates, alone_loads = measured["cores"], measured["alone_rates"], measured["alone_loads"]
    by_layout, runs = measured["by_layout"], measured["runs"]
    one, every = max(alone_rates[1]), max(alone_rates[cores])
    lines = [
        f"{cpu_name()}, {cores} cores, torch {torch.__version__}; {base.model} (depth {base.depth}, "
        f"width {base.widen_factor}), synthetic data, {steps} steps, "
        f"{_STACKING[stack]}, "
        f"median of {repeat} run{'s' if repeat > 1 else ''} per row",
        "",
        f"Alone, batch {workers * batch}, {len(alone_rates[1])} runs (one just before and one just after each "
        f"simulation): the fastest {one:.2f} it/s with 1 thread ({', '.join(f'{r:.2f}' for r in alone_rates[1])}), "
        f"{every:.2f} it/s with {cores} ({', '.join(f'{r:.2f}' for r in alone_rates[cores])}). "
        "'x near' divides by the mean of the alone runs just before and after the simulation, on as many threads as it "
        "has cores.",
        "",
        f"Alone with 1 thread and --memory-format {base.memory_format} (as above) against contiguous batches (plain "
        f"torch's default), alternating: {', '.join(f'{r:.2f}' for r in by_layout[base.memory_format])} against "
        f"{', '.join(f'{r:.2f}' for r in by_layout['contiguous'])} it/s, "
        f"{statistics.median(by_layout[base.memory_format]) / statistics.median(by_layout['contiguous']):.2f}x.",
        "",
        f"| row | {workers}x{batch} simulated, 1 core | x fastest alone, 1 thread | x near alone, 1 thread "
        f"| simulated, {cores} cores | x fastest alone, {cores} threads | x near alone, {cores} threads "
        f"| x fastest alone, 1 thread | final loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    breakdown = [
        "",
        "One-core step, ms: compute = N x (forward + backward), coding = N x (encode + decode) + server decode, "
        f"loading = N x loading a batch of {batch} (alone, one thread: {1000 * statistics.median(alone_loads):.0f} ms "
        f"for its batch of {workers * batch}, of a {1000 / statistics.median(alone_rates[1]):.0f} ms step)",
        "",
        "| row | step | compute | coding | optimizer | loading | bookkeeping |",
        "|---|---|---|---|---|---|---|",
    ]
    for item, measured in runs.items():

        def median(pick, measured: list[dict] = measured) -> float:
            return statistics.median(pick(run) for run in measured)

        single, full = median(lambda r: r["single"]["rate"]), median(lambda r: r["full"]["rate"])
        near_single = median(lambda r: r["single"]["rate"] / r["near_one"])
        near_full = median(lambda r: r["full"]["rate"] / r["near_every"])
        lines.append(
            f"| {item} | {single:.2f} it/s | {single / one:.2f}x | {near_single:.2f}x | {full:.2f} it/s "
            f"| {full / every:.2f}x | {near_full:.2f}x | {full / one:.2f}x | {measured[-1]['full']['loss']:.3f} |"
        )
        parts = [1000.0 / single] + [
            median(lambda r, key=key: r["single"][key]) for key in ("compute", "coding", "optimizer", "load", "rest")
        ]
        breakdown.append(f"| {item} | " + " | ".join(f"{p:.0f}" for p in parts) + " |")
    return "\n".join(lines + breakdown)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m psgrad.bench.simulation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=16, help="Simulated workers N.")
    parser.add_argument("--batch-size", type=int, default=8, help="Batch per simulated worker B.")
    parser.add_argument(
        "--codecs",
        default="none;sign",
        help="Semicolon-separated rows to simulate: a codec spec, optionally followed by train options "
        'for that row, as in psgrad bench ("sign:bucket=32 --feedback ef --granularity model").',
    )
    parser.add_argument(
        "--steps", type=int, default=40, help="Steps per run, at least 7 (the first five are not timed)."
    )
    parser.add_argument("--model", default="wrn", help="Model (WRN-10-1 by default).")
    parser.add_argument(
        "--repeat", type=int, default=1, help="Runs of every row (each simulation between two alone runs)."
    )
    parser.add_argument(
        "--stack",
        choices=["auto", "on", "off"],
        default="auto",
        help="psgrad simulate's --stack: auto (its default, the same as on: the workers stacked, one group "
        "per core), on (--stack) or off (--no-stack).",
    )
    args = parser.parse_args(argv)
    if args.steps < WARMUP + 2:  # the server's phases are differences between the first timed step and the last
        parser.error(f"--steps must be at least {WARMUP + 2}: the first {WARMUP} are not timed, and two more are")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.workers < 1 or args.batch_size < 1:
        parser.error("--workers and --batch-size must be at least 1")
    base = RunConfig(
        model=args.model, depth=10, widen_factor=1, batch_size=args.batch_size, steps=args.steps,
        dataset="synthetic", progress=False, eval_every_epochs=0,
    )  # fmt: skip
    items = [item.strip() for item in args.codecs.split(";") if item.strip()]
    if not items:
        parser.error("--codecs has no rows to simulate")
    try:
        rows = {item: item_config(item, base)[1] for item in items}  # every row checked before measuring
    except ValueError as err:
        parser.error(str(err))
    stack = args.stack != "off"
    print(
        report(
            args.workers, batch=args.batch_size, rows=rows, steps=args.steps, base=base, stack=stack, repeat=args.repeat
        )
    )


if __name__ == "__main__":
    main()
