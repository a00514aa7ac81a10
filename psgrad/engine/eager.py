"""The provisional outer step of an overlapped exchange (``--overlap-exchange``), per layer.

A worker that does not wait for the servers' reply trains on from a provisional point P: the
servers' outer step (SGD, heavy-ball or Nesterov momentum, as ``--outer-optimizer``) applied to
theta_sync with an estimate of the averaged change it does not have yet. The estimate is the eager
one of overlapped DiLoCo (Kale et al. 2025): this worker's share of the average is fresh, the other
workers' shares are the last ones known.

1. At an exchange, with delta this worker's change and M workers: the estimate is
   g_last + (delta - delta_last) / M, g_last the average of the last exchange whose reply came back
   and delta_last this worker's own change then. At the first exchange it is delta.
2. P = theta_sync - lr d, with the servers' formula on the momentum buffer b they hold: d = g
   (no momentum), b' = m b + g and d = b' (heavy ball) or d = g + m b' (Nesterov).
3. When the reply comes back, the servers' update d = (theta_sync - reply) / lr gives back the
   average they stepped with, g = d - m b (heavy ball) or g = (d - m^2 b) / (1 + m) (Nesterov), and
   b moves on as the servers' did: the buffer follows the servers', not this worker's guesses.
   A lossy reply gives back an approximate g; it only feeds later estimates.
4. An exchange whose reply is taken without step 3 (one that waits: before a checkpoint, the run's
   last) moves b with the estimate, the best guess there is.
With one worker the estimate is the worker's own change, so P is the servers' result. The average
itself, in place of this worker's change (what P was before), moved each worker by all of its own
difference from the others, which the steps after P then carried into the next exchange.
"""

from __future__ import annotations

import torch

from ..config import RunConfig


class EagerOuterStep:
    """The servers' outer SGD, replayed on a worker from the servers' own replies (see module)."""

    def __init__(self, cfg: RunConfig, *, workers: int) -> None:
        self.lr, self.momentum = cfg.outer_lr, cfg.outer_momentum
        self.nesterov = cfg.outer_optimizer == "nesterov"
        self.workers = workers
        self.buffer: dict[str, torch.Tensor] = {}  # the servers' momentum buffer b, per layer
        self.average: dict[str, torch.Tensor] = {}  # g_last
        self.own: dict[str, torch.Tensor] = {}  # delta_last

    def point(self, key: str, synced: torch.Tensor, change: torch.Tensor, *, waits: bool = False) -> torch.Tensor:
        """Steps 1-2: P for the layer ``key`` from its flat theta_sync and this worker's change;
        ``waits``: the exchange waits for its reply, and b moves on with the estimate (step 4)."""
        estimate = change.clone()
        if key in self.average:
            estimate = self.average[key] + (change - self.own[key]) / self.workers
        self.own[key] = change.clone()
        point = synced - self.lr * self._direction(key, estimate)
        if waits:
            self._advance(key, estimate)
        return point

    def settle(self, key: str, synced: torch.Tensor, reply: torch.Tensor) -> None:
        """Step 3: the layer's reply (its new theta_sync) came back; ``synced`` is the old one."""
        d = (synced - reply) / self.lr
        b = self.buffer.get(key)
        if self.momentum and b is not None:
            d = (d - self.momentum**2 * b) / (1 + self.momentum) if self.nesterov else d - self.momentum * b
        elif self.nesterov:
            d = d / (1 + self.momentum)
        self.average[key] = d
        self._advance(key, d)

    def _direction(self, key: str, g: torch.Tensor) -> torch.Tensor:
        if not self.momentum:
            return g
        b = self.buffer.get(key)
        b = g if b is None else self.momentum * b + g
        return g + self.momentum * b if self.nesterov else b

    def _advance(self, key: str, g: torch.Tensor) -> None:
        if self.momentum:
            b = self.buffer.get(key)
            self.buffer[key] = g.clone() if b is None else self.momentum * b + g

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"buffer": dict(self.buffer), "average": dict(self.average), "own": dict(self.own)}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        parts = [{k: v.clone() for k, v in state.get(part, {}).items()} for part in ("buffer", "average", "own")]
        self.buffer, self.average, self.own = parts
