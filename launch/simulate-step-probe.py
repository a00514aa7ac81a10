"""Probe (docs/benchmarks.md, "Session 31"): where a one-core ``psgrad simulate`` step spends the
time outside the stacked pass, function by function.

1. Wraps the functions a simulated step calls (the workers' pulls, pushes and batch loads, the
   server's handling of a message, the local transport, the core handoffs, ``wire.loads`` and
   ``wire.dumps``) so that each adds the CPU time of the thread that ran it (``time.thread_time``,
   inclusive of what it calls) to its own total.
2. Simulates 16 workers of WRN-10-1 on batches of 8 on one core (ps, one server, synthetic
   data, ``--granularity model``), then prints each total per step with its calls per step, and
   the stacked pass's median against the CPU time between two passes.
Wrapped functions nest (``Worker.push`` holds ``Worker._send``, which holds ``wire.dumps``): the
totals are not to be added up.

    .venv/bin/python launch/simulate-step-probe.py [--steps 40] [--codec none] [--feedback none]
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time

import torch

from psgrad import backprop, data, stacked
from psgrad.comm import local, wire
from psgrad.config import RunConfig
from psgrad.engine import server, worker
from psgrad.simulate import simulate

WRAPPED = [
    (
        worker.Worker,
        ["finish_pull", "_receive", "_apply_pull", "post_pulls", "push_missing", "push", "_send", "report"],
    ),
    (backprop.Backprop, ["gradient"]),
    (data.ShardLoader, ["batch"]),
    (server.ServerBase, ["_arrived", "_reply", "_apply"]),
    (local.LocalTransport, ["isend", "irecv", "test_some"]),
    (local.LocalWorld, ["enter", "leave"]),
    (stacked.StackedMember, ["run"]),
    (wire, ["loads", "dumps"]),
]


def timed(function, label: str, totals: dict, calls: collections.Counter):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            totals[label] += time.thread_time() - start
            calls[label] += 1

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="simulated steps (the first five are not timed)")
    parser.add_argument("--codec", default="none", help="the workers' codec spec")
    parser.add_argument("--feedback", default="none", help="none, ef or dgc")
    args = parser.parse_args()
    totals: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    for owner, names in WRAPPED:
        prefix = owner.__name__.rpartition(".")[2]
        for name in names:
            setattr(owner, name, timed(getattr(owner, name), f"{prefix}.{name}", totals, calls))
    passes: list[tuple[float, float, float, float]] = []  # wall and process CPU time at each pass's start and end
    run_pass = stacked.StackedPass.run

    def marked(self, *pass_args):
        wall, cpu = time.perf_counter(), time.process_time()
        result = run_pass(self, *pass_args)
        passes.append((wall, time.perf_counter(), cpu, time.process_time()))
        return result

    stacked.StackedPass.run = marked
    cfg = RunConfig(
        model="wrn", depth=10, widen_factor=1, batch_size=8, steps=args.steps, dataset="synthetic",
        progress=False, eval_every=0, granularity="model", codec=args.codec, feedback=args.feedback,
    )  # fmt: skip
    torch.set_num_threads(1)
    simulate(cfg, 16, cores=1)
    timed_passes = passes[5:]
    between = [later[2] - earlier[3] for earlier, later in zip(timed_passes, timed_passes[1:], strict=False)]
    print(
        f"stacked pass {1000 * statistics.median(p[1] - p[0] for p in timed_passes):.1f} ms, CPU time between two "
        f"passes {1000 * statistics.median(between):.1f} ms (medians over steps 5-{args.steps - 1})"
    )
    print("per step, over every step (set-up included):")
    for label, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"  {label:32s} {1000 * seconds / args.steps:7.2f} ms  {calls[label] / args.steps:6.1f} calls")


if __name__ == "__main__":
    main()
