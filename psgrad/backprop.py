"""A worker's forward and backward of one step, with the features every role shares: micro-batches
(``--accumulate``), mixed precision (``--amp``, with a dynamic loss scale for fp16) and gradient
clipping (``--clip-grad-norm``).

The gradients in ``param.grad`` stay multiplied by the loss scale; :meth:`Backprop.gradient` is
the one way out, and divides it away, so hooks that send during backward and the sends after it
see the same unscaled gradient.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from .comm.protocol import GradientGate, Layer, layer_grad
from .config import RunConfig
from .devices import outside_autocast
from .models.layout import in_layout, map_tensors, memory_format
from .models.step import StepStart

if TYPE_CHECKING:  # the interface only: backprop itself needs no MPI
    from .comm.waiting import SharedPass

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def to_device(batch, device: torch.device):
    """``batch`` (a tensor, or tuples, lists and dicts of them) with every tensor on ``device``."""
    return map_tensors(batch, lambda tensor: tensor.to(device))


def split_batch(batch, parts: int) -> list:
    """``batch`` cut along its first dimension into ``parts`` micro-batches, structure kept."""
    if isinstance(batch, torch.Tensor):
        return list(batch.tensor_split(parts))
    if isinstance(batch, dict):
        pieces = {key: split_batch(value, parts) for key, value in batch.items()}
        return [{key: pieces[key][i] for key in batch} for i in range(parts)]
    if isinstance(batch, (tuple, list)):
        pieces = [split_batch(value, parts) for value in batch]
        return [type(batch)(piece[i] for piece in pieces) for i in range(parts)]
    if parts == 1:
        return [batch]
    raise TypeError(f"--accumulate cannot split a batch of {type(batch).__name__}: use tensors, tuples or dicts")


def batch_length(batch) -> int:
    """Samples in ``batch``: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    values = batch.values() if isinstance(batch, dict) else batch
    return batch_length(next(iter(values)))


class LossScale:
    """The dynamic loss scale of ``torch.amp.GradScaler``, for ``--amp fp16`` (1.0 otherwise).

    1. Start at 2^16: small fp16 gradients would otherwise underflow to zero.
    2. A step in which a gradient overflowed (inf or NaN; ``--on-nonfinite skip`` drops those
       layers' update) halves the scale.
    3. After 2000 steps in a row without overflow the scale doubles.
    """

    def __init__(self, enabled: bool, initial: float = 2.0**16, interval: int = 2000) -> None:
        self.enabled, self.value, self.interval, self.good = enabled, initial if enabled else 1.0, interval, 0

    def update(self, overflowed: bool) -> None:
        if not self.enabled:
            return
        if overflowed:
            self.value, self.good = max(1.0, self.value / 2), 0
            return
        self.good += 1
        if self.good >= self.interval:
            self.value, self.good = self.value * 2, 0

    def state_dict(self) -> dict:
        return {"value": self.value, "good": self.good}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.good = float(state["value"]), int(state["good"])


def _nothing() -> None:
    pass


class Backprop:
    """Forward and backward of one batch on one worker; see the module docstring."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        model: nn.Module,
        loss_fn: Callable,
        device: torch.device,
        shared_pass: SharedPass | None = None,
    ) -> None:
        """``shared_pass``: the pass this rank computes together with others, when its transport
        has one (``Transport.shared_pass``); it is used without micro-batches and --amp."""
        self.cfg, self.model, self.loss_fn, self.device = cfg, model, loss_fn, device
        self.layout = memory_format(cfg.memory_format, device)
        self.step_start = StepStart(model)
        self.scale = LossScale(cfg.amp == "fp16")
        self.pushing = True
        self.shared_pass = shared_pass if cfg.accumulate == 1 and cfg.amp == "off" else None
        self.waited = 0.0  # seconds of the last run spent waiting, not computing (a shared pass's turn)
        if self.shared_pass is not None:
            self.shared_pass.join(model, loss_fn)

    @property
    def hooks_may_send(self) -> bool:
        """Whether gradient hooks may send layers during backward: not when clipping, which needs
        the norm of the whole gradient first."""
        return self.cfg.clip_grad_norm == 0

    def run(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        after_first_forward: Callable[[], None],
        idle: Callable[[], bool] | None = None,
    ) -> float:
        """Training mode on and the gradients cleared (``StepStart``), then for each of
        ``--accumulate`` micro-batches: forward (under autocast with ``--amp``), loss x its share
        of the batch x the loss scale, backward. Hooks may send only during the last backward
        (``pushing``). Returns the batch's mean loss.

        ``after_first_forward`` runs once, between the first forward and its backward (workers
        finish their pulls and post the next ones there). With a shared pass it runs first, then
        the shared pass sets the gradients (no hook fires: the roles send every layer after
        backward); ``idle`` runs while this rank waits for the others to hand in their batches.
        The time it spent there beyond its share of the pass is ``waited`` (a wait, not compute)."""
        self.step_start()
        self.waited = 0.0
        if self.shared_pass is not None:
            after_first_forward()
            start = time.perf_counter()
            loss = self.shared_pass.run(self.batch(images), to_device(labels, self.device), idle)
            if loss is not None:
                self.waited = max(0.0, time.perf_counter() - start - self.shared_pass.share)
                return loss
            after_first_forward = _nothing
        k = self.cfg.accumulate
        micro = list(zip(split_batch(images, k), split_batch(labels, k), strict=True))
        amp = AMP_DTYPES.get(self.cfg.amp)
        total = 0.0
        for index, (x, y) in enumerate(micro):
            self.pushing = index == len(micro) - 1
            with torch.autocast(self.device.type, dtype=amp) if amp else contextlib.nullcontext():
                loss = self.loss_fn(self.model(self.batch(x)), to_device(y, self.device))
            if index == 0:
                after_first_forward()
            share = batch_length(y) / batch_length(labels)
            (loss.float() * (share * self.scale.value)).backward()
            total += float(loss.detach()) * share
        self.pushing = True
        return total

    def batch(self, images):
        """The model's input: ``images`` on the device, in the ``--memory-format`` layout."""
        return in_layout(to_device(images, self.device), self.layout)

    def finish(self, params: dict[str, torch.Tensor]) -> None:
        """After the last backward: with ``--clip-grad-norm``, scale every gradient so that the
        whole (unscaled) gradient's L2 norm is at most the bound."""
        if not self.cfg.clip_grad_norm:
            return
        grads = [p.grad for p in params.values() if p.grad is not None]
        if not grads:
            return
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
        norm /= self.scale.value
        if norm > self.cfg.clip_grad_norm:  # a non-finite norm is left for --on-nonfinite to see
            factor = self.cfg.clip_grad_norm / (norm + 1e-6)
            for grad in grads:
                grad.mul_(factor)

    def on_layer_gradients(
        self, params: dict[str, torch.Tensor], gate: GradientGate, callback: Callable[[Layer], None]
    ) -> list:
        """Call ``callback(layer)`` during backward the moment a layer's last parameter has its
        gradient, in the last micro-batch only (earlier ones only accumulate); returns the hook
        handles. Workers, alltoall peers and gossip ranks send from here."""
        layer_of = {name: layer for layer in gate.layers for name in layer.params}

        def hook_for(name: str):
            def hook(param: torch.Tensor) -> None:
                if self.pushing and gate.arrived(layer_of[name]):
                    callback(layer_of[name])

            return hook

        return [
            p.register_post_accumulate_grad_hook(outside_autocast(hook_for(n), p.device))
            for n, p in params.items()
            if p.requires_grad
        ]

    def gradient(self, params: dict[str, torch.Tensor], layer: Layer) -> torch.Tensor:
        """``layer``'s flat gradient with the loss scale divided away (a new tensor if scaled)."""
        grad = layer_grad(params, layer)
        return grad / self.scale.value if self.scale.value != 1.0 else grad

    def end_step(self, overflowed: bool) -> None:
        """Tell the loss scale whether any layer of this step's gradient was non-finite."""
        self.scale.update(overflowed)
