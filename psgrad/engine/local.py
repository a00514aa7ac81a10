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
With ``--fragments F`` (Streaming DiLoCo) the model is F runs of consecutive layers of about
equal size (``fragment_of``), and steps 3-5 run per fragment:
6. Fragment f exchanges after the steps (kF + f + 1) H/F - 1, k = 0, 1, ...: each fragment every
   H steps, one fragment every H/F steps, so the link carries 1/F of the model at a time. The
   wire counts each fragment's exchanges. An overlapped fragment's reply is taken tau steps after
   its own exchange; a fragment that waits takes its reply at once. The replies are taken in
   the step, never by the forward hooks. The run's last step exchanges every fragment.
7. Before a checkpoint every reply in flight is taken; the checkpoint keeps theta, since the
   fragments that did not just exchange have moved on from theta_sync, and a resumed run starts
   from the servers' values (theta_sync) and then theta.
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


def _period(cfg: RunConfig) -> int:
    """The steps between two exchanges of any fragment: H / F."""
    return cfg.local_steps // cfg.fragments


def exchange_of(cfg: RunConfig, step: int, *, fragment: int = 0) -> int:
    """The exchange of ``fragment`` that ``step``'s batch leads to: how many it completed before
    ``step`` (every step is one without local steps). Fragment f exchanges after the steps
    (kF + f + 1) H/F - 1, k = 0, 1, ..."""
    if not cfg.local_steps:
        return step
    return max(0, (step // _period(cfg) - fragment - 1) // cfg.fragments + 1)


def exchanges_after(cfg: RunConfig, step: int, total: int, *, fragment: int | None = None) -> bool:
    """Whether ``step`` ends with an exchange of ``fragment`` (None: of any): every step, or every
    H/F-th step in turn, and the run's last for all."""
    if not cfg.local_steps or step == total - 1:
        return True
    turn = (step + 1) // _period(cfg) - 1
    return (step + 1) % _period(cfg) == 0 and (fragment is None or turn % cfg.fragments == fragment)


def exchanges_done(cfg: RunConfig, step: int, total: int, *, fragment: int = 0) -> int:
    """The last exchange of ``fragment`` complete once ``step`` is done (-1 and below: none yet)."""
    exchange = exchange_of(cfg, step, fragment=fragment)
    return exchange if exchanges_after(cfg, step, total, fragment=fragment) else exchange - 1


def fragment_of(layers: list[Layer], fragments: int) -> dict[int, int]:
    """Each layer's fragment: ``fragments`` runs of consecutive layers in forward order, cut where
    the running element count crosses each 1/F of the model (a layer goes to the run its middle
    falls in), so every fragment moves about the same bytes."""
    total = sum(layer.numel for layer in layers) or 1
    plan, before = {}, 0
    for layer in layers:
        plan[layer.index] = min(fragments - 1, (2 * before + layer.numel) * fragments // (2 * total))
        before += layer.numel
    return plan


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
        plan = fragment_of(self.layers, self.cfg.fragments)
        self.fragment_layers = [
            [layer for layer in self.layers if plan[layer.index] == f] for f in range(self.cfg.fragments)
        ]
        self.due: dict[int, int] = {}  # overlapped: fragment -> the step at whose end its reply is taken (step 5)
        self.resumed: dict[str, torch.Tensor] | None = None  # fragments: theta where a checkpoint left it

    def post_start_pulls(self) -> None:
        """The receives of the values the run starts from, at ``ctx.start`` (0, or a resumed step):
        with local steps each fragment's at its own exchange count."""
        if not self.cfg.local_steps:
            return self.post_pulls(self.ctx.start)
        for f, layers in enumerate(self.fragment_layers):
            self.post_pulls(exchange_of(self.cfg, self.ctx.start, fragment=f), layers=layers)

    def local_train_step(self, step: int, images: torch.Tensor, labels: torch.Tensor) -> StepStats:
        """Steps 1-3 (and 4-6) of the module for one batch."""
        first, whole = not self.synced, self.cfg.fragments == 1
        # fragments: replies are taken here, never by the forward hooks, which compare self.step
        self.step, self.sent, self.stats = exchange_of(self.cfg, step) if whole else -1, set(), StepStats(step=step)
        clock = StepClock()
        if first and not whole:
            self._take_first_values()
        self.doing = f"step {step}: forward"

        def after_first_forward() -> None:
            if first and whole:  # the forward hooks took the values layer by layer
                self.finish_pulls()
                self._remember(self.params)
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
        # the run's last exchanges and those before a checkpoint complete: nothing is in flight then
        settle = step == self.ctx.total - 1 or self.ctx.checkpoints.is_due(step)
        for fragment, due in sorted(self.due.items()):
            if due == step or settle:
                self.doing = f"step {step}: taking the reply of fragment {fragment}'s last exchange"
                self._take_overlapped_reply(fragment)
        for fragment in range(self.cfg.fragments):
            if exchanges_after(self.cfg, step, self.ctx.total, fragment=fragment):
                exchange = exchange_of(self.cfg, step, fragment=fragment)
                self.doing = f"step {step}: exchange {exchange}" + ("" if whole else f" of fragment {fragment}")
                overlapped = self.cfg.overlap_exchange and not settle
                self._exchange(fragment, exchange, overlapped=overlapped)
                if overlapped:
                    self.due[fragment] = step + (self.cfg.overlap_steps or self.cfg.local_steps)
                    self.deferred = True
                s.outer = 1
        clock.mark("exchanged")
        clock.mark("end")
        s.loss = loss
        return clock.fill(
            s, in_forward=s.pull_wait + s.decode + s.apply, in_backward=0.0, in_exchange=s.encode + s.serve, waited=0.0
        )

    def _take_first_values(self) -> None:
        """Fragments, the run's first step: the servers' values are theta_sync; a resumed run's
        theta is where its checkpoint left it (fragments that had not exchanged yet had moved on)."""
        self.doing = "taking the servers' starting values"
        self.finish_pulls()
        self._remember(self.params)
        if self.resumed is not None:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(self.resumed[name])
            self.resumed = None

    def _exchange(self, fragment: int, exchange: int, *, overlapped: bool) -> None:
        """Push the change since theta_sync of every layer of ``fragment``.

        Without overlap, each layer goes back to theta_sync, and its reply (the new theta_sync)
        is taken by the next step's forward (the whole model) or at once (a fragment).
        Overlapped: each layer moves to the replica's provisional point P, where the worker
        trains on; the reply, taken tau steps later or at the fragment's next exchange, moves it
        by the servers' result minus P (``_take_overlapped_reply``). The replica steps at every
        exchange, so its momentum follows the servers' through the exchanges that wait."""
        if fragment in self.due:  # the run's last exchange came before tau steps were up
            self._take_overlapped_reply(fragment)
        layers = self.fragment_layers[fragment]
        self.step = exchange
        self.post_pulls(exchange + 1, layers=layers)
        for layer in layers:
            change = self._change(layer, back=not overlapped)
            if self.replica is not None:  # before the push: feedback may change ``change`` in place
                self._provisional_step(layer, change, move=overlapped)
            self.push(layer, change)
        if overlapped:
            self.started.update({name: self.params[name].detach().clone() for name in _names(layers)})
            self.progress_exchange()
            return
        while self.awaiting:
            self.advance_rounds(only=next(iter(self.awaiting)))
        self.transport.wait_all(self.sends, self._idle())
        self.sends = []
        if self.cfg.fragments == 1:
            self.synced = {}
            return
        for layer in layers:
            self.finish_pull(layer.index)
        self._remember({name: self.params[name] for name in _names(layers)})

    def _provisional_step(self, layer: Layer, change: torch.Tensor, *, move: bool) -> None:
        """Step 4: the replica's outer step from theta_sync with this worker's ``change``; with
        ``move`` the layer's parameters go to that point P."""
        point = torch.cat([self.synced[name].reshape(-1) for name in layer.params])
        self.replica.step(layer.name, point, change, self.cfg.outer_lr)
        if move:
            copy_flat_into(self.params, layer.params, point)

    def _take_overlapped_reply(self, fragment: int) -> None:
        """The reply of ``fragment``'s last, overlapped exchange: theta = reply + (theta - P), so
        the steps taken since go on from the servers' result; it is the new theta_sync."""
        layers = self.fragment_layers[fragment]
        params = {name: self.params[name] for name in _names(layers)}
        with torch.no_grad():
            progress = {name: p.detach() - self.started.pop(name) for name, p in params.items()}
            for name, p in params.items():
                p.copy_(self.synced[name])  # a delta or PowerSGD's reply updates theta_sync
            del self.due[fragment]
            self.deferred = bool(self.due)
            for layer in layers:
                self.finish_pull(layer.index)
            self._remember(params)
            for name, p in params.items():
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

    def _remember(self, params: dict[str, torch.Tensor]) -> None:
        """theta_sync of ``params``: a copy of them as they are now."""
        self.synced.update({name: p.detach().clone() for name, p in params.items()})

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
        # fragments: the layers that did not exchange at the checkpoint have moved on from theta_sync
        theta = {"theta": {n: p.detach().clone() for n, p in self.params.items()}} if self.cfg.fragments > 1 else {}
        return {"inner": self.inner.state_dict(), **replica, **theta}

    def load_local_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        if self.replica is not None:  # a checkpoint written before the replica existed: it starts anew
            self.replica.load_state_dict(state.get("outer_replica", {}))
        if self.cfg.fragments > 1:
            self.resumed = state["theta"]


def _names(layers: list[Layer]) -> list[str]:
    return [name for layer in layers for name in layer.params]
