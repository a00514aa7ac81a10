"""Alltoall topology: no server; every rank exchanges every layer's encoded gradient with all.

Per layer, in a fixed order shared by all ranks (non-blocking collectives must start in the same
order everywhere, so the sizes and the bytes go on two duplicated communicators):
1. the backward hook encodes the gradient (feedback -> codec -> wire);
2. Iallgather of the message sizes, then Iallgatherv of the bytes (every rank's block is the same
   for all receivers, so the all-gather form of the design's alltoall avoids P copies);
3. every rank decodes all P messages into the layer's accumulator (weight 1/P);
4. after backward, each rank applies the same optimizer update to the same bytes, so parameters
   stay identical on all ranks.
Rank 0's metrics row is the step's statistics summed over ranks (one small allreduce).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..backprop import Backprop
from ..codecs import make_codec
from ..comm import wire
from ..comm.channel import Handle
from ..comm.envelope import Envelope, parse
from ..comm.protocol import (
    GradientGate,
    Layer,
    StepStats,
    add_code,
    buffers_vector,
    copy_flat_into,
    encode_gradient,
    layer_rounds,
    layer_values,
    load_buffers_vector,
    skip_update,
    upload_bound,
)
from ..context import Role, RunContext
from ..optim import learning_rate
from .clock import StepClock
from .peers import PeerRows, load_replica_state, replica_state


@dataclass
class _Exchange:
    """One layer's two collectives: its sizes, then its bytes."""

    index: int
    round: int
    sizes_handle: Handle
    sizes: np.ndarray
    bytes_handle: Handle | None = None
    data: bytearray | None = None
    offsets: np.ndarray | None = None


class PeerRole(Role):
    name = "peer"

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.model, self.layers, self.cfg = ctx.model, ctx.layers, ctx.cfg
        self.feedback = ctx.make_feedback()
        self.world = ctx.transport
        self.sizes_comm = ctx.transport.dup()
        self.bytes_comm = ctx.transport.dup()
        self.rank, self.size = ctx.rank, ctx.transport.size
        self.params_by_name = dict(self.model.named_parameters())
        self.backprop = Backprop(
            self.cfg, model=self.model, loss_fn=ctx.loss_fn, device=ctx.device, shared_pass=ctx.transport.shared_pass()
        )
        self.order = sorted(range(len(self.layers)), reverse=True)  # backward produces the last layers first
        self.optimizer = ctx.make_optimizer()
        self.doing = "starting"
        self.step_index = 0
        self.gate = GradientGate(self.layers)
        self.bounds = [upload_bound(self.feedback, layer) for layer in self.layers]
        self.rounds = [layer_rounds(self.feedback.codec, layer) for layer in self.layers]
        # the order every rank starts the exchanges in: each layer's first round as backward
        # produces it, then the later rounds of multi-round layers (PowerSGD) in the same order
        self.queue = [(i, 1) for i in self.order] + [
            (i, r) for r in range(2, max(self.rounds, default=1) + 1) for i in self.order if self.rounds[i] >= r
        ]
        self.rows = PeerRows(ctx, self.world)
        self._hooks = []
        if self.cfg.granularity == "layer" and self.backprop.hooks_may_send:
            self._hooks += self.backprop.on_layer_gradients(self.params_by_name, self.gate, self._layer_ready)

    def _layer_ready(self, layer: Layer) -> None:
        self._encode(layer, self.backprop.gradient(self.params_by_name, layer))
        self._pump()

    def _encode(self, layer: Layer, grad: torch.Tensor) -> None:
        start = time.perf_counter()
        msg = encode_gradient(
            self.feedback,
            layer,
            grad,
            step=self.step_index,
            sender=self.rank,
            stream=self.rank,
            run_seed=self.cfg.seed,
            on_nonfinite=self.cfg.on_nonfinite,
        )
        self.stats.nonfinite += int(bool(msg.meta.get("skip")))
        self._ready(layer.index, 1, msg)
        self.stats.encode += time.perf_counter() - start

    def _ready(self, index: int, round_: int, msg) -> None:
        self.ready[(index, round_)] = wire.dumps(msg)
        self.stats.bytes_up += len(self.ready[(index, round_)]) * (self.size - 1)

    def _pump(self, block: bool = False) -> None:
        """Start the collectives of ready layers in order and finish the ones that completed."""
        while self.next < len(self.queue) and self.queue[self.next] in self.ready:
            index, round_ = self.queue[self.next]
            handle, sizes = self.sizes_comm.iallgather_sizes(len(self.ready[(index, round_)]))
            self.inflight.append(_Exchange(index, round_, handle, sizes))
            self.next += 1
        for entry in self.inflight:
            if entry.bytes_handle is None:
                if not (entry.sizes_handle.wait() if block else entry.sizes_handle.test()):
                    break  # bytes collectives must start in layer order on every rank
                self._check_sizes(self.layers[entry.index], entry.sizes)
                entry.bytes_handle, entry.data, entry.offsets = self.bytes_comm.iallgatherv_bytes(
                    self.ready[(entry.index, entry.round)], entry.sizes
                )
            if block:
                entry.bytes_handle.wait()
            if entry.bytes_handle.done or entry.bytes_handle.test():
                self._decode(self.layers[entry.index], entry)
        self.inflight = [e for e in self.inflight if e.bytes_handle is None or not e.bytes_handle.done]

    def _check_sizes(self, layer: Layer, sizes: np.ndarray) -> None:
        """No rank may make the others allocate more than any honest message of the layer."""
        for peer, size in enumerate(sizes.tolist()):
            if size > self.bounds[layer.index]:
                raise RuntimeError(
                    f"alltoall: rank {peer} announced {size} bytes for {layer.name!r}, more than any message of it ({self.bounds[layer.index]})"
                )

    def _decode(self, layer: Layer, entry: _Exchange) -> None:
        start = time.perf_counter()
        view = memoryview(entry.data)
        acc = self.acc[layer.index]
        multi = self.rounds[layer.index] > 1
        code_sum: dict[str, torch.Tensor] = {}
        for peer in range(self.size):
            begin, size = int(entry.offsets[peer]), int(entry.sizes[peer])
            msg = parse(
                view[begin : begin + size],
                sender=peer,
                what=f"gradient of {layer.name!r}",
                max_bytes=self.bounds[layer.index],
                shape=layer.shape,
            )
            Envelope("grad", layer.name, self.step_index, peer, entry.round if multi else 0).check(msg)
            if msg.meta.get("skip"):
                self.skipping.add(layer.index)
            if multi:  # summed in code space, in rank order
                add_code(code_sum, msg)
            else:
                make_codec(msg.codec, **msg.params).decode_add(msg, acc, alpha=1.0 / self.size)
        if multi:
            self._close_round(layer, entry.round, code_sum)
        self.stats.decode += time.perf_counter() - start
        self.stats.bytes_down += int(entry.sizes.sum()) - len(self.ready[(layer.index, entry.round)])

    def _close_round(self, layer: Layer, round_: int, code_sum: dict[str, torch.Tensor]) -> None:
        """Every rank reduces the round as a server would, then answers it itself: the next
        round's message, or after the last round the gradient (in the layer's accumulator)."""
        codec = self.feedback.codec
        reply = codec.reduce(round_, code_sum, self.size)
        if round_ < self.rounds[layer.index]:
            payload = self.feedback.advance(layer.name, layer.shape, round_, reply)
            self._ready(layer.index, round_ + 1, Envelope("grad", layer.name, self.step_index, self.rank).seal(payload))
            return
        grad = self.feedback.finish(layer.name, reply, applied=layer.index not in self.skipping)
        self.acc[layer.index].copy_(grad)

    def train_step(self, step: int, images: torch.Tensor, labels: torch.Tensor) -> StepStats:
        self.step_index, self.stats = step, StepStats(step=step)
        self.gate.reset()
        self.ready: dict[tuple[int, int], bytes] = {}  # (layer index, round) -> the message
        self.inflight: list[_Exchange] = []
        self.next = 0
        self.acc = {layer.index: torch.zeros(layer.numel) for layer in self.layers}
        self.skipping: set[int] = set()  # layers a rank marked skipped (non-finite) this step
        clock = StepClock()
        self.doing = f"step {step}: forward"

        def after_first_forward() -> None:
            clock.mark("forward_done")
            self.doing = f"step {step}: backward"

        loss = self.backprop.run(images, labels, after_first_forward)
        self.backprop.finish(self.params_by_name)
        for layer in self.layers:
            if (layer.index, 1) not in self.ready:
                self._encode(layer, self.backprop.gradient(self.params_by_name, layer))
        self.backprop.end_step(self.stats.nonfinite > 0)
        clock.mark("backward_done")
        self.doing = f"step {step}: exchanging gradients"
        while self.next < len(self.queue) or self.inflight:
            self._pump(block=True)
        clock.mark("exchanged")
        lr = learning_rate(self.cfg, step, self.ctx.steps_per_epoch, self.size)
        with torch.no_grad():
            for layer in self.layers:
                what = f"step {step}: the gradient sum of {layer.name!r} on rank {self.rank}"
                if skip_update(self.acc[layer.index], what, self.cfg.on_nonfinite, layer.index in self.skipping):
                    continue
                values = layer_values(self.params_by_name, layer)
                self.optimizer.step(layer.name, values, self.acc[layer.index], lr)
                copy_flat_into(self.params_by_name, layer.params, values)
        clock.mark("end")
        s = self.stats
        s.loss, s.apply = loss, clock.end - clock.exchanged
        return clock.fill(s, in_backward=s.encode, in_exchange=s.decode, waited=self.backprop.waited)

    # ------------------------------------------------------------------ the Role interface
    def step(self, step: int) -> list[dict]:
        self.feedback.set_epoch(step // max(1, self.ctx.steps_per_epoch))
        return self.rows.row(self.ctx.train_on_batch(step, self.train_step))

    def evaluate(self, step: int) -> None:
        """BatchNorm statistics averaged over ranks, then rank 0 evaluates a copy (training goes on
        in the model itself)."""
        start = time.perf_counter()
        flat = buffers_vector(self.model)
        if flat.numel():
            total = self.world.allreduce_sum(flat.double().numpy())
            load_buffers_vector(self.model, torch.from_numpy(total).float() / self.size)
        if self.rank == 0:
            before, self.doing = self.doing, self.ctx.evaluations.doing(step)
            model = self.ctx.evaluations.model()
            model.load_state_dict(self.model.state_dict())
            self.ctx.evaluations.start(model, step, time.perf_counter() - start)
            self.doing = before  # started (in the background) or done (in the loop)

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params_by_name.items()}

    def state_dict(self) -> dict:
        state = replica_state(self.params_by_name, self.model, self.backprop, self.optimizer)
        return {"feedback": self.feedback.state_dict(), **state}

    def load_state_dict(self, state: dict) -> None:
        self.feedback.load_state_dict(state["feedback"])
        load_replica_state(
            state, params=self.params_by_name, model=self.model, backprop=self.backprop, optimizer=self.optimizer
        )
