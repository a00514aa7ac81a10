"""What the serverless roles share (alltoall, ring): a step's metrics row from sums over ranks."""

from __future__ import annotations

import time
from dataclasses import astuple, fields

from ..comm.protocol import TIME_KEYS, StepStats
from ..comm.transport import Transport
from ..context import RunContext
from ..optim import learning_rate


class PeerRows:
    """Rank 0's metrics row of a step whose every rank trained: the ranks' statistics summed in one
    small allreduce (collective: every rank calls ``row``), loss and times averaged, bytes summed."""

    def __init__(self, ctx: RunContext, transport: Transport) -> None:
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
