"""Alltoall topology: no server; every rank exchanges every layer's encoded gradient with all.

Per layer, in a fixed order shared by all ranks (non-blocking collectives must start in the same
order everywhere, so the sizes and the bytes go on two duplicated communicators):
1. the backward hook encodes the gradient (feedback -> codec -> wire);
2. Iallgather of the message sizes, then Iallgatherv of the bytes (every rank's block is the same
   for all receivers, so the all-gather form of the design's alltoall avoids P copies);
3. every rank decodes all P messages into the layer's accumulator (weight 1/P);
4. after backward, each rank applies the same optimizer update to the same bytes, so parameters
   stay identical on all ranks.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from . import wire
from .codecs import make_codec
from .config import RunConfig
from .feedback import NoFeedback
from .optim import LayerOptimizer, learning_rate
from .roles import Layer
from .transport import Transport
from .worker import GradientGate, StepStats, encode_gradient, layer_grad


class PeerWorker:
    def __init__(
        self,
        model: nn.Module,
        transport: Transport,
        layers: list[Layer],
        cfg: RunConfig,
        feedback: NoFeedback,
        steps_per_epoch: int,
    ) -> None:
        self.model, self.layers, self.cfg, self.feedback = model, layers, cfg, feedback
        self.world = transport
        self.sizes_comm = Transport(transport.comm.Dup())
        self.bytes_comm = Transport(transport.comm.Dup())
        self.rank, self.size = transport.rank, transport.size
        self.params = dict(model.named_parameters())
        self.layer_of = {name: layer for layer in layers for name in layer.params}
        self.order = sorted(range(len(layers)), reverse=True)  # backward produces the last layers first
        self.optimizer = LayerOptimizer.from_config(cfg)
        self.steps_per_epoch = steps_per_epoch
        self.doing = "starting"
        self.step = 0
        self.gate = GradientGate(layers)
        self._hooks = []
        if cfg.granularity == "layer":
            for name, param in self.params.items():
                if param.requires_grad:
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._grad_ready(name)))

    def _grad_ready(self, name: str):
        def hook(param: torch.Tensor) -> None:
            layer = self.layer_of[name]
            if self.gate.arrived(layer):
                self._encode(layer, layer_grad(self.params, layer))
                self._pump()

        return hook

    def _encode(self, layer: Layer, grad: torch.Tensor) -> None:
        start = time.perf_counter()
        self.ready[layer.index] = encode_gradient(self.feedback, layer, grad, self.step, self.rank, self.cfg.seed)
        self.stats.encode += time.perf_counter() - start
        self.stats.bytes_up += len(self.ready[layer.index]) * (self.size - 1)

    def _pump(self, block: bool = False) -> None:
        """Start the collectives of ready layers in order and finish the ones that completed."""
        while self.next < len(self.order) and self.order[self.next] in self.ready:
            index = self.order[self.next]
            request, sizes = self.sizes_comm.iallgather_sizes(len(self.ready[index]))
            self.inflight.append([index, "sizes", request, sizes, None, None])
            self.next += 1
        for entry in self.inflight:
            index = entry[0]
            if entry[1] == "sizes":
                if not self._done(self.sizes_comm, entry[2], block):
                    break  # bytes collectives must start in layer order on every rank
                entry[1] = "bytes"
                entry[2], entry[4], entry[5] = self.bytes_comm.iallgatherv_bytes(self.ready[index], entry[3])
            if entry[1] == "bytes" and self._done(self.bytes_comm, entry[2], block):
                self._decode(self.layers[index], entry[4], entry[3], entry[5])
                entry[1] = "done"
        self.inflight = [e for e in self.inflight if e[1] != "done"]

    @staticmethod
    def _done(comm: Transport, request, block: bool) -> bool:
        if block:
            comm.wait_request(request)
            return True
        return bool(request.Test())

    def _decode(self, layer: Layer, data: bytearray, sizes, offsets) -> None:
        start = time.perf_counter()
        view = memoryview(data)
        acc = self.acc[layer.index]
        for peer in range(self.size):
            msg = wire.loads(view[int(offsets[peer]) : int(offsets[peer]) + int(sizes[peer])])
            if msg.kind != "grad" or msg.layer != layer.name or msg.step != self.step or msg.sender != peer:
                raise RuntimeError(
                    f"alltoall: rank {peer} sent {msg.layer!r} step {msg.step}; expected {layer.name!r} step {self.step}"
                )
            make_codec(msg.codec, **msg.params).decode_add(msg, acc, alpha=1.0 / self.size)
        self.stats.decode += time.perf_counter() - start
        self.stats.bytes_down += int(sum(sizes)) - len(self.ready[layer.index])

    def train_step(self, step: int, images: torch.Tensor, labels: torch.Tensor, loss_fn) -> StepStats:
        self.step, self.stats = step, StepStats(step=step)
        self.gate.reset()
        self.ready: dict[int, bytes] = {}
        self.inflight: list[list] = []
        self.next = 0
        self.acc = {layer.index: torch.zeros(layer.numel) for layer in self.layers}
        start = time.perf_counter()
        self.doing = f"step {step}: forward"
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        loss = loss_fn(self.model(images), labels)
        t_fwd = time.perf_counter()
        self.doing = f"step {step}: backward"
        loss.backward()
        for layer in self.layers:
            if layer.index not in self.ready:
                self._encode(layer, layer_grad(self.params, layer))
        t_bwd = time.perf_counter()
        self.doing = f"step {step}: exchanging gradients"
        while self.next < len(self.order) or self.inflight:
            self._pump(block=True)
        t_wait = time.perf_counter()
        lr = learning_rate(self.cfg, step, self.steps_per_epoch, self.size)
        with torch.no_grad():
            for layer in self.layers:
                values = torch.cat([self.params[n].detach().reshape(-1) for n in layer.params])
                self.optimizer.step(layer.name, values, self.acc[layer.index], lr)
                offset = 0
                for n in layer.params:
                    p = self.params[n]
                    p.copy_(values[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        end = time.perf_counter()
        s = self.stats
        s.loss = float(loss.detach())
        s.forward, s.backward = t_fwd - start, (t_bwd - t_fwd) - s.encode
        s.push_wait, s.apply, s.step_time = t_wait - t_bwd - s.decode, end - t_wait, end - start
        return s
