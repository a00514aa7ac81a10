"""What the metrics rank (server 0, or rank 0 of colocated servers) gathers beside serving.

1. Metrics rows: each worker's step statistics, joined into one row per step once every worker's
   is in (``StepAggregator``), with the server's own times and its process's CPU seconds.
2. For an evaluation after step t: the workers' BatchNorm buffers, averaged as they arrive, and
   every other server's layer values for t; ``model_values`` puts the model together from them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..codecs import Message, make_codec
from ..comm.protocol import Layer
from ..metrics import StepAggregator


class Collector:
    """Rows and evaluation inputs of one metrics rank (see the module docstring)."""

    def __init__(self, *, workers: int, buffers_size: int, layers: list[Layer]) -> None:
        self.workers, self.buffers_size, self.layers = workers, buffers_size, layers
        self.aggregator = StepAggregator(workers)
        self.rows: list[dict] = []
        self.eval_buffers: dict[int, torch.Tensor] = {}
        self.peer_values: dict[int, dict[int, torch.Tensor]] = {}
        self._buffer_acc: dict[int, list] = {}
        self._exact = make_codec("none")

    def on_stats(self, record: dict, *, lr_of: Callable[[int], float], times: dict[str, float]) -> None:
        """A worker's statistics of one step; a row once every worker's of that step is in."""
        row = self.aggregator.add(record)
        if row is None:
            return
        row["lr"] = lr_of(row["step"])
        row["server_decode"], row["server_apply"], row["server_idle"] = times["decode"], times["apply"], times["idle"]
        row["server_cpu"] = time.process_time()  # this process's CPU seconds so far
        self.rows.append(row)

    def on_buffers(self, worker: int, msg: Message) -> None:
        """A worker's BatchNorm buffers of ``msg.step``, averaged in."""
        if msg.kind != "buffers" or msg.numel != self.buffers_size:
            raise RuntimeError(
                f"rank {worker} sent {msg.kind} of {msg.numel} values, expected buffers of {self.buffers_size}"
            )
        entry = self._buffer_acc.setdefault(msg.step, [torch.zeros(self.buffers_size), 0])
        self._exact.decode_add(msg, entry[0], alpha=1.0 / self.workers)
        entry[1] += 1
        if entry[1] == self.workers:
            del self._buffer_acc[msg.step]
            self.eval_buffers[msg.step] = entry[0]

    def on_values(self, server: int, msg: Message) -> None:
        """Another server's layer values after ``msg.step``."""
        self.peer_values.setdefault(msg.step, {})[server] = self._exact.decode(msg).view(-1)

    def ready(self, step: int, *, servers: int) -> bool:
        """Whether every buffer and every other server's values of ``step`` are in."""
        return step in self.eval_buffers and len(self.peer_values.get(step, {})) == servers

    def model_values(self, own: dict[int, torch.Tensor], step: int | None) -> dict[int, torch.Tensor]:
        """Flat values by layer index: ``own`` (this rank's layers), and the other servers' of ``step``."""
        flat_of = dict(own)
        for owner, flat in self.peer_values.pop(step, {}).items():
            offset = 0
            for layer in (layer for layer in self.layers if layer.owner == owner):
                flat_of[layer.index] = flat[offset : offset + layer.numel]
                offset += layer.numel
        return flat_of

    def take_rows(self) -> list[dict]:
        rows, self.rows = self.rows, []
        return rows
