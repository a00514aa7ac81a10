"""A saved stop in a torch DDP script with psgrad's hook (psgrad/ddpstop.py), as docs/api.md shows it.

Usage: torchrun --nproc-per-node 2 ddp_stop.py OUT MODE [END]

Mode ``stop`` trains until ``psgrad.should_stop()`` says to stop (after a SIGTERM the test sends),
saying on stderr, with its pid, when it has taken steps; each rank then saves its model, optimizer,
hook state and step in OUT/ckpt-<rank>.pt and returns. Mode ``resume`` loads that checkpoint and
trains on to step END; mode ``straight`` trains steps 0..END-1 without a stop. Both save each
rank's model in OUT/<mode>-<rank>.pt, and the two must be equal bit for bit. Mode ``rank0_asks``
trains steps 0..END-1 and asks ``psgrad.should_stop()`` on rank 0 alone, as a script that keeps
its checkpoint code under ``if rank == 0`` would.
"""

import os
import sys
from itertools import count
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import psgrad


def batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 10, (8,), generator=gen)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    end = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    hook = psgrad.ddp_hook("topk:ratio=0.2", feedback="ef")
    ddp.register_comm_hook(ddp, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    saved = out / f"ckpt-{rank}.pt"
    start = 0
    if mode == "resume":
        state = torch.load(saved, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        hook.load_state_dict(state["hook"])
        start = state["step"] + 1
    steps = count() if mode == "stop" else range(start, end)
    for step in steps:
        images, labels = batch(rank, step)
        opt.zero_grad()
        F.cross_entropy(ddp(images), labels).backward()
        opt.step()
        if step == 3:
            os.write(2, f"rank {rank} pid {os.getpid()} trains\n".encode())  # one write: the ranks share the file
        if mode == "rank0_asks" and rank == 0 and psgrad.should_stop():
            break
        if mode == "stop" and psgrad.should_stop():
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "hook": hook.state_dict()}
            torch.save({**state, "step": step}, saved)
            break
    if mode in ("resume", "straight"):
        torch.save(model.state_dict(), out / f"{mode}-{rank}.pt")
    del ddp
    dist.barrier()  # no rank tears gloo down while another has a collective in flight (docs/api.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
