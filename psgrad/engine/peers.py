"""What the serverless roles share (alltoall, ring/torus): a step's metrics row from sums over
ranks, and the checkpoint of a rank's own model."""

from __future__ import annotations

import time
from dataclasses import astuple, fields

import torch

from ..backprop import Backprop
from ..comm.channel import Channel
from ..comm.protocol import TIME_KEYS, StepStats, buffers_vector, load_buffers_vector
from ..context import RunContext
from ..optim import learning_rate


class PeerRows:
    """Rank 0's metrics row of a step whose every rank trained: the ranks' statistics summed in one
    small allreduce (collective: every rank calls ``row``), loss and times averaged, bytes summed."""

    def __init__(self, ctx: RunContext, transport: Channel) -> None:
        self.ctx, self.transport = ctx, transport
        self.first = self.last = time.perf_counter()

    def row(self, stats: StepStats, extra: dict | None = None) -> list[dict]:
        size, step = self.transport.size, stats.step
        names = [f.name for f in fields(StepStats)]
        sums = dict(zip(names, self.transport.allreduce_sum(astuple(stats)), strict=True))
        now = time.perf_counter()
        row = {
            "step": step,
            "loss": sums["loss"] / size,
            "bytes_up": int(sums["bytes_up"]),
            "bytes_down": int(sums["bytes_down"]),
            "it_per_s": 1 / max(1e-9, now - self.last),
            "wall": now - self.first,
            "lr": learning_rate(self.ctx.cfg, step, self.ctx.steps_per_epoch, size),
            "step_time": sums["step_time"] / size,
            "nonfinite": int(sums["nonfinite"]),
            **{k: sums[k] / size for k in TIME_KEYS},
            **(extra or {}),
        }
        self.last = now
        return [row] if self.transport.rank == 0 else []


def replica_state(params: dict[str, torch.Tensor], model: torch.nn.Module, backprop: Backprop, optimizer) -> dict:
    """A serverless rank's own training state: optimizer, parameters, BatchNorm statistics, RNG
    state and loss scale (its role adds what else it keeps)."""
    return {
        "optim": optimizer.state_dict(),
        "params": {n: p.detach().clone() for n, p in params.items()},
        "buffers": buffers_vector(model),
        "rng": torch.get_rng_state(),
        "loss_scale": backprop.scale.state_dict(),
    }


def load_replica_state(
    state: dict, *, params: dict[str, torch.Tensor], model: torch.nn.Module, backprop: Backprop, optimizer
) -> None:
    """Restore what ``replica_state`` saved."""
    optimizer.load_state_dict(state["optim"])
    with torch.no_grad():
        for name, value in state["params"].items():
            params[name].copy_(value)
    load_buffers_vector(model, state["buffers"])
    torch.set_rng_state(state["rng"])
    if "loss_scale" in state:  # checkpoints written before --amp have none
        backprop.scale.load_state_dict(state["loss_scale"])
