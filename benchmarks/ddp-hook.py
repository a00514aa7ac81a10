"""it/s of torch DDP with ``psgrad.ddp_hook``, against DDP's own rows, on loopback or shaped links.

Usage: python benchmarks/ddp-hook.py [--rounds 3] [--steps 40] [--codec powersgd:rank=8]
       [--bandwidth 100mbit] [--against DIR] [--rows ddp,ddp-powersgd,hook]

WRN-16-4 on CIFAR-shaped synthetic batches of 16, two ranks of torch DDP on gloo (one process
each, one torch thread each), the same model and batches in every row:
1. ``hook``: ``psgrad.ddp_hook(CODEC)`` from this checkout; ``against``: the same from the psgrad
   source tree ``--against`` (another commit's, e.g. a ``git worktree``), when given.
2. ``ddp``: DDP without a hook; ``ddp-powersgd``: torch's PowerSGD hook at rank 8, all gradients
   in one bucket (with several, its chained collectives can pair up differently on each rank);
   ``compute``: each rank trains alone, with no communication (the ceiling).
3. Every row runs once a round, over ``--rounds`` rounds (a VM's speed drifts within a run); a
   row's it/s is rank 0's over ``--steps`` steps after 10 left out; the table gives the medians
   and each row's ratio to the first row (``--rows``) in the same round.
4. ``--bandwidth``: each rank in a network namespace of its own, its link shaped by
   ``tc ... tbf`` (``psgrad.bench.netshape``; needs root).
Prints the CPU, the setting, each round's it/s and a table.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

WARM = 10  # steps left out of the rate: the start-up
HERE = Path(__file__).resolve().parents[1]


def rank_loop(row: str, *, rank: int, addr: str, port: int, steps: int, codec: str, bucket_mb: float) -> None:
    """One rank's training (``python ddp-hook.py rank ROW RANK ADDR PORT STEPS CODEC BUCKET_MB``)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=2)
    dist.barrier()  # both ranks start together
    import psgrad
    from psgrad.models import build_model, seeded_model

    model = seeded_model(lambda: build_model("wrn", 100, depth=16, widen_factor=4), seed=0)
    if row == "compute":
        ddp = model  # no communication at all: the ceiling
    elif row == "ddp-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        numel = sum(p.numel() for p in model.parameters())
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=8 * numel / 2**20)
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=8, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        if row != "ddp":
            ddp.register_comm_hook(ddp, psgrad.ddp_hook(codec))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    images, labels = torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 100, (16,), generator=gen)
    for step in range(WARM + steps):
        if step == WARM:
            started = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(ddp(images), labels).backward()
        opt.step()
    if rank == 0:
        print(f"rate {steps / (time.perf_counter() - started):.4f}", flush=True)
    dist.barrier()
    del ddp, opt  # DDP goes before its process group
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_row(row: str, *, args: argparse.Namespace, network) -> float:
    """Both ranks of one row; rank 0's it/s."""
    source = args.against if row == "against" else HERE
    env = {**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": "1"}
    addr, port = ("127.0.0.1", _free_port()) if network is None else ("10.213.0.1", 29611)
    if network is not None:
        env.update(network.environment())
    procs = []
    for rank in range(2):
        command = [
            sys.executable,
            __file__,
            "rank",
            row,
            str(rank),
            addr,
            str(port),
            str(args.steps),
            args.codec,
            str(args.bucket_mb),
        ]
        if network is not None:
            command = ["ip", "netns", "exec", network.namespace(rank), *command]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [proc.communicate(timeout=1800) for proc in procs]
    for proc, (_, err) in zip(procs, outs, strict=True):
        if proc.returncode != 0:
            raise SystemExit(f"row {row} failed (status {proc.returncode}):\n{err[-3000:]}")
    return float(re.search(r"rate ([\d.]+)", outs[0][0]).group(1))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        row, rank, addr, port, steps, codec, bucket_mb = sys.argv[2:9]
        return rank_loop(
            row, rank=int(rank), addr=addr, port=int(port), steps=int(steps), codec=codec, bucket_mb=float(bucket_mb)
        )
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="times every row runs")
    parser.add_argument("--steps", type=int, default=40, help="steps a run measures (after 10 left out)")
    parser.add_argument("--codec", default="powersgd:rank=8", help="the hook's codec")
    parser.add_argument("--bandwidth", help="shape each rank's link to this rate (tc units: 100mbit); needs root")
    parser.add_argument("--against", type=Path, help="another psgrad source tree whose hook is a row too")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (not ddp-powersgd's)")
    parser.add_argument("--rows", default="ddp,ddp-powersgd,hook", help="rows to run; the first is the baseline")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))  # this checkout's psgrad, for the shaped network and the CPU's name
    from psgrad.bench.codecbench import cpu_name
    from psgrad.bench.netshape import ShapedNetwork

    rows = args.rows.split(",") + (["against"] if args.against else [])
    print(f"CPU: {cpu_name()}; 2 ranks, WRN-16-4, batch 16, codec {args.codec}, link {args.bandwidth or 'loopback'}")
    rates: dict[str, list[float]] = {row: [] for row in rows}
    network = None
    if args.bandwidth:
        network = ShapedNetwork(2, args.bandwidth).__enter__()
    try:
        for round_ in range(args.rounds):
            for row in rows:
                rates[row].append(run_row(row, args=args, network=network))
            print(f"round {round_ + 1}: " + ", ".join(f"{row} {rates[row][-1]:.3f}" for row in rows), flush=True)
    finally:
        if network is not None:
            network.__exit__(None, None, None)
    print(f"| row | it/s (median) | × {rows[0]} (median of the rounds' ratios) |\n|---|---|---|")
    for row in rows:
        ratio = statistics.median(r / d for r, d in zip(rates[row], rates[rows[0]], strict=True))
        print(f"| {row} | {statistics.median(rates[row]):.3f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
