"""What ``psgrad.should_stop()`` costs your own loop, and how long a saved stop takes.

Usage: python benchmarks/saved-stop.py [--rounds 3] [--steps 60] [--out runs/saved-stop] [--ddp]

WRN-16-4 on CIFAR-shaped synthetic batches of 16, two colocated ranks (``mpiexec -n 2``), codec
``powersgd:rank=8``, trained by a plain torch loop with ``psgrad.DistributedOptimizer``; with
``--ddp``, two ranks of torch DDP with ``psgrad.ddp_hook("powersgd:rank=8")`` under torchrun, which
passes the SIGTERM on to its ranks (and itself exits 1 for it):
1. The cost: ``--steps`` steps with ``should_stop()`` after each and as many without, alternated
   over ``--rounds`` rounds; the ratio of their steps per second (the first 10 steps of each left
   out: the start-up).
2. The stop: the loop with ``should_stop()`` until a SIGTERM to mpiexec (which passes it to every
   rank) 10 steps in; the seconds from the signal to the job's end, the checkpoint of every
   worker written, and the steps taken after the signal.
Prints the CPU, the command and a table; ``loop`` is the script each rank runs.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

WARM = 10  # steps left out of the rate: the start-up


def loop(out: Path, *, ask: bool, steps: int, ddp: bool) -> None:
    """One rank's loop (``mpiexec -n 2 python saved-stop.py loop ...``, or under torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import psgrad
    from psgrad.models import build_model, seeded_model

    torch.set_num_threads(1)
    model = seeded_model(lambda: build_model("wrn", 100, depth=16, widen_factor=4), seed=0)
    if ddp:
        dist.init_process_group("gloo")
        rank = worker = dist.get_rank()
        ddp_model = torch.nn.parallel.DistributedDataParallel(model)
        ddp_model.register_comm_hook(ddp_model, psgrad.ddp_hook("powersgd:rank=8"))
        opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
    else:
        psgrad.init(codec="powersgd:rank=8", topology="colocated")
        rank, worker = psgrad.rank(), psgrad.worker_index()
        opt = psgrad.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    forward = ddp_model if ddp else model
    gen = torch.Generator().manual_seed(worker)
    images, labels = torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 100, (16,), generator=gen)
    started = None
    for step in range(steps or 10**9):
        if step == WARM:
            started = time.perf_counter()
            os.write(2, f"worker {worker} at step {step}\n".encode())  # one write: torchrun's ranks share stderr
        opt.zero_grad()
        F.cross_entropy(forward(images), labels).backward()
        opt.step()
        if ask and psgrad.should_stop():
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, out / f"ckpt-{rank}.pt")
            os.write(2, f"worker {worker} saved after step {step}\n".encode())
            break
    else:
        if worker == 0:
            print(f"rate {(steps - WARM) / (time.perf_counter() - started):.4f}", flush=True)
    if ddp:
        del ddp_model, opt  # DDP goes before its process group
        dist.destroy_process_group()


def _mpiexec() -> str:
    beside = Path(sys.executable).with_name("mpiexec")
    return str(beside) if beside.exists() else "mpiexec"


def _command(out: Path, *, ask: bool, steps: int, ddp: bool) -> list[str]:
    script = os.path.abspath(__file__)
    args = [script, "loop", str(out), str(int(ask)), str(steps), str(int(ddp))]
    if ddp:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *args]
    return [_mpiexec(), "-n", "2", sys.executable, *args]


def _rate(out: Path, *, ask: bool, steps: int, ddp: bool) -> float:
    command = _command(out, ask=ask, steps=steps, ddp=ddp)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the loop failed:\n{proc.stderr[-3000:]}")
    return float(re.search(r"rate ([\d.]+)", proc.stdout).group(1))


def _stop(out: Path, *, ddp: bool) -> tuple[float, int, str]:
    """SIGTERM to the launcher 10 steps in: seconds to the job's end, steps after the signal, its stderr."""
    err_path = out / "stop.err"
    with open(err_path, "w") as err:
        command = _command(out, ask=True, steps=0, ddp=ddp)
        proc = subprocess.Popen(command, stderr=err, stdin=subprocess.DEVNULL)
    while "worker 1 at step" not in err_path.read_text():
        if proc.poll() is not None:
            raise SystemExit(f"the loop ended before its signal:\n{err_path.read_text()[-3000:]}")
        time.sleep(0.05)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    seconds, text = time.monotonic() - signalled, err_path.read_text()
    saved = [int(s) for s in re.findall(r"saved after step (\d+)", text)]
    if (proc.returncode != 0 and not ddp) or len(saved) != 2 or len(set(saved)) != 1:
        raise SystemExit(f"the saved stop failed (status {proc.returncode}):\n{text[-3000:]}")
    return seconds, saved[0] - WARM, text


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "loop":
        return loop(Path(sys.argv[2]), ask=sys.argv[3] == "1", steps=int(sys.argv[4]), ddp=sys.argv[5] == "1")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="pairs of runs, with and without should_stop()")
    parser.add_argument("--steps", type=int, default=60, help="steps a run (the first 10 are left out)")
    parser.add_argument("--out", type=Path, default=Path("runs/saved-stop"), help="where the checkpoints go")
    parser.add_argument("--ddp", action="store_true", help="torch DDP with psgrad's hook under torchrun")
    args = parser.parse_args()
    from psgrad.bench.codecbench import cpu_name

    args.out.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_name()}; {' '.join(_command(args.out, ask=True, steps=args.steps, ddp=args.ddp))}", flush=True)
    ratios = []
    for round_ in range(args.rounds):
        without = _rate(args.out, ask=False, steps=args.steps, ddp=args.ddp)
        asked = _rate(args.out, ask=True, steps=args.steps, ddp=args.ddp)
        ratios.append(asked / without)
        print(f"round {round_ + 1}: {without:.3f} it/s without, {asked:.3f} it/s with should_stop()", flush=True)
    seconds, after, _ = _stop(args.out, ddp=args.ddp)
    print("| measured | value |\n|---|---|")
    print(f"| it/s with should_stop() / without (median of {args.rounds}) | {sorted(ratios)[len(ratios) // 2]:.3f} |")
    print(f"| seconds from SIGTERM to the job's end, checkpoints written | {seconds:.1f} |")
    print(f"| steps taken after the signal | {after} |")


if __name__ == "__main__":
    main()
