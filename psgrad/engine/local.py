"""Local steps (``--local-steps H``, DiLoCo): the worker's side, mixed into ``Worker``.

A step is one batch, as always. Per step on a worker:
1. The first step after an exchange takes the servers' values (its forward's pulls) and keeps a
   copy of them: theta_sync.
2. Forward and backward of this worker's batch; its own inner optimizer (``--inner-optimizer``,
   ``--lr`` and its schedule, ``--weight-decay``) steps on its own gradient. Nothing is sent.
3. Every H-th step, and the run's last, ends with an exchange: per layer, in forward order, the
   pseudo-gradient delta = theta_sync - theta goes through feedback and codec to the layer's
   server, and the layer goes back to theta_sync. The servers average delta over the workers and
   apply the outer optimizer (``--outer-optimizer``, ``--outer-lr``, ``--outer-momentum``); their
   reply, taken in the next step's forward, is the new theta_sync (a multi-round codec's reply is
   the update, applied here to theta_sync as the servers apply it).
On the wire an exchange is numbered k = step // H, so the servers count exchanges, not batches.
With ``--overlap-exchange`` step 3 does not wait (eager, as overlapped DiLoCo does):
4. The worker applies the outer optimizer itself, to theta_sync with its own delta in place of the
   average it does not have yet (a replica of the servers' optimizer, fed this worker's deltas),
   and trains on from that provisional point P.
5. The reply is taken tau steps later (``--overlap-steps``; at the next exchange, tau = H, by
   default), at the end of that step, waiting for it if it has not arrived: theta = reply +
   (theta - P). The steps taken since move on from the servers' result, and a reply that is an
   update (a delta, PowerSGD's code) applies to theta_sync, the base the servers applied it to.
   A smaller tau starts the steps after it from a less stale point (Streaming DiLoCo overlaps a
   few steps, not H); the exchange then has tau steps of compute to hide behind.
With one worker, the replica's P is the servers' result, and overlapping changes nothing; taking
the worker's own end point as P instead (no replica) left the next steps an outer momentum step
behind the servers.
"""

from __future__ import annotations

import torch

from ..comm.protocol import Layer, StepStats, copy_flat_into
from ..config import RunConfig
from ..optim import LayerOptimizer, learning_rate
from .clock import StepClock


def exchange_of(cfg: RunConfig, step: int) -> int:
    """The exchange that ``step``'s batch belongs to (every step is one without local steps)."""
    return step // cfg.local_steps if cfg.local_steps else step


def exchanges_after(cfg: RunConfig, step: int, total: int) -> bool:
    """Whether ``step`` ends with an exchange: every step, or every H-th and the run's last."""
    return not cfg.local_steps or (step + 1) % cfg.local_steps == 0 or step == total - 1


def exchanges_done(cfg: RunConfig, step: int, total: int) -> int:
    """The last exchange complete once ``step`` is done (-1 and below: none yet)."""
    exchange = exchange_of(cfg, step)
    return exchange if exchanges_after(cfg, step, total) else exchange - 1


def inner_optimizer(cfg: RunConfig, params: list[torch.Tensor], optimizer_fn=None) -> torch.optim.Optimizer:
    """The workers' own optimizer between exchanges: the API's ``optimizer_fn(params)``, or
    ``--inner-optimizer`` (its LR is set from the schedule before every step)."""
    if optimizer_fn is not None:
        return optimizer_fn(params)
    if cfg.inner_optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
    )


class LocalSteps:
    """The local-step methods of ``engine.worker.Worker`` (see the module docstring)."""

    def start_local_steps(self) -> None:
        trainable = [p for p in self.params.values() if p.requires_grad]
        self.inner = inner_optimizer(self.cfg, trainable, self.ctx.optimizer_fn)
        self.synced: dict[str, torch.Tensor] = {}  # theta_sync; empty: take the servers' reply first
        self.started: dict[str, torch.Tensor] = {}  # overlapped: the provisional point P (step 4)
        # overlapped: the servers' outer optimizer, fed this worker's deltas at every exchange
        self.replica = LayerOptimizer.from_config(self.cfg) if self.cfg.overlap_exchange else None
        self.reply_due = -1  # overlapped: the step at whose end the reply is taken (step 5)

    def local_train_step(self, step: int, images: torch.Tensor, labels: torch.Tensor) -> StepStats:
        """Steps 1-3 of the module for one batch."""
        exchange = exchange_of(self.cfg, step)
        first = not self.synced
        self.step, self.sent, self.stats = exchange, set(), StepStats(step=step)
        clock = StepClock()
        self.doing = f"step {step}: forward"

        def after_first_forward() -> None:
            if first:
                self.finish_pulls()
                self._remember()
            clock.mark("forward_done")
            self.doing = f"step {step}: backward"

        loss = self.backprop.run(images, labels, after_first_forward, self._idle())
        self.backprop.finish(self.params)
        for group in self.inner.param_groups:
            group["lr"] = learning_rate(self.cfg, step, self.ctx.steps_per_epoch, self.ctx.layout.num_workers)
        self.inner.step()
        self.backprop.end_step(False)
        clock.mark("backward_done")
        s = self.stats
        if self.deferred and step == self.reply_due:
            self.doing = f"step {step}: taking the reply of exchange {exchange_of(self.cfg, step) - 1}"
            self._take_overlapped_reply()
        if exchanges_after(self.cfg, step, self.ctx.total):
            self.doing = f"step {step}: exchange {exchange}"
            self._exchange(exchange, overlapped=self._overlaps(step))
            if self.deferred:
                self.reply_due = step + (self.cfg.overlap_steps or self.cfg.local_steps)
            s.outer = 1
        clock.mark("exchanged")
        clock.mark("end")
        s.loss = loss
        return clock.fill(
            s, in_forward=s.pull_wait + s.decode + s.apply, in_backward=0.0, in_exchange=s.encode + s.serve, waited=0.0
        )

    def _overlaps(self, step: int) -> bool:
        """Whether the exchange after ``step`` overlaps the next steps: with --overlap-exchange,
        except before a checkpoint and at the run's end, where it completes as without."""
        last = step == self.ctx.total - 1
        return self.cfg.overlap_exchange and not last and not self.ctx.checkpoints.is_due(step)

    def _exchange(self, exchange: int, *, overlapped: bool) -> None:
        """Push every layer's change since theta_sync.

        Without overlap, each layer goes back to theta_sync, and the next step's forward takes the
        reply (the new theta_sync). Overlapped: each layer moves to the replica's provisional
        point P, where the worker trains on; the reply, taken tau steps later or at the next
        exchange, moves it by the servers' result minus P (``_take_overlapped_reply``). The
        replica steps at every exchange, so its momentum follows the servers' through the
        exchanges that wait."""
        if self.deferred:  # the run's last exchange came before tau steps were up
            self._take_overlapped_reply()
        self.post_pulls(exchange + 1)
        for layer in self.layers:
            change = self._change(layer, back=not overlapped)
            if self.replica is not None:  # before the push: feedback may change ``change`` in place
                self._provisional_step(layer, change, move=overlapped)
            self.push(layer, change)
        if overlapped:
            self.started = {name: p.detach().clone() for name, p in self.params.items()}
            self.deferred = True
            self.progress_exchange()
            return
        self.synced = {}
        while self.awaiting:
            self.advance_rounds(only=next(iter(self.awaiting)))
        self.transport.wait_all(self.sends, self._idle())
        self.sends = []

    def _provisional_step(self, layer: Layer, change: torch.Tensor, *, move: bool) -> None:
        """Step 4: the replica's outer step from theta_sync with this worker's ``change``; with
        ``move`` the layer's parameters go to that point P."""
        point = torch.cat([self.synced[name].reshape(-1) for name in layer.params])
        self.replica.step(layer.name, point, change, self.cfg.outer_lr)
        if move:
            copy_flat_into(self.params, layer.params, point)

    def _take_overlapped_reply(self) -> None:
        """The reply of the last, overlapped exchange: theta = reply + (theta - P), so the steps
        taken since go on from the servers' result; it is the new theta_sync."""
        with torch.no_grad():
            progress = {name: p.detach() - self.started[name] for name, p in self.params.items()}
            for name, p in self.params.items():
                p.copy_(self.synced[name])  # a delta or PowerSGD's reply updates theta_sync
            self.deferred = False
            self.finish_pulls()
            self._remember()
            for name, p in self.params.items():
                p.add_(progress[name])

    def progress_exchange(self) -> None:
        """While an overlapped exchange travels: drive MPI (a large message moves only while its
        ranks call into MPI) and answer the servers' rounds that came back."""
        self.sends = self.transport.progress(self.sends)
        for handle in self.pulls.values():
            if handle is not None:
                handle.test()
        if self.multi_round:
            self.advance_rounds()

    def _remember(self) -> None:
        """theta_sync: a copy of the parameters as they are now."""
        self.synced = {name: p.detach().clone() for name, p in self.params.items()}

    def _change(self, layer: Layer, *, back: bool) -> torch.Tensor:
        """The layer's pseudo-gradient theta_sync - theta, flat; ``back``: the layer goes back to
        theta_sync."""
        parts = []
        with torch.no_grad():
            for name in layer.params:
                param = self.params[name]
                parts.append((self.synced[name] - param.detach()).reshape(-1))
                if back:
                    param.copy_(self.synced[name])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def local_state_dict(self) -> dict:
        replica = {"outer_replica": self.replica.state_dict()} if self.replica is not None else {}
        return {"inner": self.inner.state_dict(), **replica}

    def load_local_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        if self.replica is not None:  # a checkpoint written before the replica existed: it starts anew
            self.replica.load_state_dict(state.get("outer_replica", {}))
