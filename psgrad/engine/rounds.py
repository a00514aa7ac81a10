"""The working engine's side of a codec of several rounds (PowerSGD), mixed into ``Worker``.

1. Each server reply to round r of a layer (``code``) is answered with round r + 1 the moment it
   arrives: in the hooks and in every wait (``advance_rounds``), blocking only where the forward
   pass needs the layer.
2. The reply to the last round is the gradient every rank applies (``_apply_code``): the run's
   optimizer applies it here as the server does to its copy; a colocated rank takes its own
   shard's bits from its server part; where the servers only sum, it goes to ``on_mean``.
"""

from __future__ import annotations

import time

import torch

from ..codecs import Message
from ..comm.envelope import Envelope
from ..comm.protocol import Layer, layer_tag
from ..optim import update_lr


class Rounds:
    """The multi-round methods of ``engine.worker.Worker`` (see the module docstring)."""

    def advance_rounds(self, only: int | None = None) -> bool:
        """Answer the servers' replies of open rounds with the next round's message; blocking for
        layer ``only`` (the forward needs it), otherwise only what arrived. True if any did."""
        if self._advancing:
            return False
        self._advancing, worked = True, False
        try:
            for index in [only] if only is not None else list(self.awaiting):
                reply = self._receive(index, block=only is not None)
                if reply is None:
                    continue
                start = time.perf_counter()
                worked, layer, round_ = True, self.layers[index], self.awaiting.pop(index)
                self._check_reply(layer, reply, ("code",), round_)
                payload = self.feedback.advance(layer.name, layer.shape, round_, reply.arrays)
                msg = Envelope("grad", layer.name, self.pull_step - 1, self.rank).seal(payload)
                if round_ + 1 < self.rounds[index]:
                    self.awaiting[index] = round_ + 1
                if self.pulls[index] is not None:
                    self.pulls[index] = self.transport.irecv(
                        self.bounds[index], layer.owner, layer_tag(index), key=index, buffer=self.buffers[index]
                    )
                self.stats.encode += time.perf_counter() - start
                self._send(layer, msg)
        finally:
            self._advancing = False
        return worked

    def _apply_code(self, layer: Layer, msg: Message, start: float) -> None:
        """The last round's reply: the gradient every rank applies, with the same optimizer."""
        self._check_reply(layer, msg, ("code",), self.rounds[layer.index])
        applied, local = not msg.meta.get("skip"), self._is_local(layer.owner)
        grad = self.feedback.finish(layer.name, msg.arrays, applied, gradient=not local or self.ctx.sums)
        mid = time.perf_counter()
        if self.ctx.sums:
            self.on_mean(layer, grad, applied)
        elif applied:
            param = self.params[layer.params[0]].detach().view(-1)
            with torch.no_grad():
                if local:  # this rank's server part applied the same update to its copy: take its bits
                    param.copy_(self.local.values[layer.index])
                else:
                    step = self.pull_step - 1
                    lr = update_lr(self.cfg, step, self.ctx.steps_per_epoch, self.ctx.layout.num_workers)
                    self.optimizer.step(layer.name, param, grad, lr)
        self.stats.decode += mid - start
        self.stats.apply += time.perf_counter() - mid
