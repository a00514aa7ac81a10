"""Memories that wrap any codec: plain pass-through, error feedback, and DGC.

All three share one interface, ``encode(layer, grad, seed) -> Message``, so the worker does not
care which is in use. Their state is a flat ``{str: Tensor}`` map that ``torch.save`` /
``torch.load(weights_only=True)`` handle.
"""

from __future__ import annotations

import math

import torch

from .choices import FEEDBACKS
from .codecs import Codec, Message, make_codec


class NoFeedback:
    """Encode each gradient as it is."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec

    def encode(self, layer: str, grad: torch.Tensor, seed: int) -> Message:
        return self.codec.encode(grad, seed=seed)

    def set_epoch(self, epoch: int) -> None:
        """Hook for schedules that change with the epoch (DGC warm-up)."""

    def codec_specs(self) -> set[str]:
        """Every codec spec this memory may encode with (receivers size their buffers by them)."""
        return {self.codec.spec}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        _entries(state, prefixes=(), memory=f"{self.codec.spec} without feedback")


class ErrorFeedback(NoFeedback):
    """Residual memory (EF-SGD).

    1. g' = g + e[layer]   (e starts at zero)
    2. send C(g')
    3. e[layer] = g' - D(C(g'))   so nothing the codec dropped is lost, only delayed.
    """

    def __init__(self, codec: Codec) -> None:
        super().__init__(codec)
        self.residuals: dict[str, torch.Tensor] = {}

    def encode(self, layer: str, grad: torch.Tensor, seed: int) -> Message:
        # one buffer per layer holds e, then g', then the new e: no per-step allocation
        memory = self.residuals.get(layer)
        if memory is None:
            memory = self.residuals[layer] = grad.detach().to(torch.float32, copy=True)
        else:
            _check_shape(memory, grad, layer=layer, memory="error feedback")
            memory.add_(grad.detach())
        return self.codec.encode_residual(memory, seed=seed)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"residual/{k}": v for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = _entries(state, prefixes=("residual/",), memory="error feedback")["residual/"]


def _entries(
    state: dict[str, torch.Tensor], *, prefixes: tuple[str, ...], memory: str
) -> dict[str, dict[str, torch.Tensor]]:
    """``state``'s entries by prefix, the prefix removed and each tensor copied. A key under no
    prefix means the state was saved by another memory: a ValueError says so rather than load
    it somewhere it is never read."""
    strangers = [key for key in state if not key.startswith(prefixes)] if prefixes else list(state)
    if strangers:
        holds = " or ".join(f"'{prefix}<layer>'" for prefix in prefixes) or "nothing"
        raise ValueError(
            f"{memory} keeps {holds}, and the state to load holds {', '.join(map(repr, strangers[:3]))}"
            f"{' ...' if len(strangers) > 3 else ''}: it was saved with another feedback or codec"
        )
    return {
        prefix: {key.removeprefix(prefix): value.clone() for key, value in state.items() if key.startswith(prefix)}
        for prefix in prefixes
    }


def _check_shape(held: torch.Tensor, grad: torch.Tensor, *, layer: str, memory: str) -> None:
    """A memory loaded from a state saved for another model must not be added to (or, of one
    element, broadcast over) a gradient it does not fit."""
    if held.shape != grad.shape:
        raise ValueError(
            f"{memory} of layer {layer!r} holds shape {tuple(held.shape)}, its gradient has {tuple(grad.shape)}: "
            "the state loaded was saved for another model"
        )


def warms_up(codec: Codec) -> bool:
    """Whether DGC's sparsity warm-up (``--dgc-warmup-epochs``) applies to ``codec``: it raises the
    codec's ``ratio``, so only a codec with one (topk, randomk)."""
    return "ratio" in codec.params


def dgc_sparsity(epoch: int, warmup_epochs: int, final: float = 0.999) -> float:
    """DGC's exponential warm-up: 75 %, 93.75 %, 98.4 %, 99.6 %, ... then ``final``."""
    if epoch >= warmup_epochs:
        return final
    return min(final, 1.0 - 0.25 ** (epoch + 1))


class DGCMemory(NoFeedback):
    """Deep Gradient Compression's worker-side memory around any codec.

    1. Local gradient clipping: scale g so that ||g|| <= ``clip_norm`` (when given).
    2. Momentum correction: u = m u + g; v = v + u  (Nesterov: u = m (u + g); v = v + u + g).
    3. Send C(v); v = v - D(C(v)).
    4. Momentum-factor masking: where D(C(v)) is non-zero, zero u and v (stale momentum would
       otherwise keep pushing coordinates that were just applied).
    With ``warmup_epochs`` > 0 and a codec that has a ``ratio``, ``set_epoch`` raises the sparsity
    along :func:`dgc_sparsity`. The server should then run plain SGD: momentum lives here.
    """

    def __init__(
        self,
        codec: Codec,
        *,
        momentum: float = 0.9,
        nesterov: bool = False,
        clip_norm: float | None = None,
        masking: bool = True,
        warmup_epochs: int = 0,
    ) -> None:
        super().__init__(codec)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"DGC momentum must be in [0, 1), got {momentum}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"DGC clip_norm must be > 0, got {clip_norm}")
        self.base_codec = codec
        self.momentum, self.nesterov, self.clip_norm, self.masking = momentum, nesterov, clip_norm, masking
        self.warmup_epochs = warmup_epochs
        self.momentums: dict[str, torch.Tensor] = {}
        self.velocities: dict[str, torch.Tensor] = {}

    def _codec_at(self, epoch: int) -> Codec:
        if self.warmup_epochs <= 0 or not warms_up(self.base_codec):
            return self.base_codec
        final = 1.0 - float(self.base_codec.params["ratio"])
        ratio = 1.0 - dgc_sparsity(epoch, self.warmup_epochs, final)
        return make_codec(self.base_codec.name, **{**self.base_codec.params, "ratio": ratio})

    def set_epoch(self, epoch: int) -> None:
        self.codec = self._codec_at(epoch)

    def codec_specs(self) -> set[str]:
        """The warm-up's first (densest) codec and the final one."""
        return {self._codec_at(0).spec, self.base_codec.spec}

    def encode(self, layer: str, grad: torch.Tensor, seed: int) -> Message:
        g = grad.detach().float()
        if self.clip_norm is not None:
            norm = float(torch.linalg.vector_norm(g))
            if norm > self.clip_norm and math.isfinite(norm):
                g = g * (self.clip_norm / norm)
        u = self.momentums.setdefault(layer, torch.zeros_like(g))
        v = self.velocities.setdefault(layer, torch.zeros_like(g))
        _check_shape(u, g, layer=layer, memory="DGC's momentum")
        _check_shape(v, g, layer=layer, memory="DGC's velocity")
        if self.nesterov:
            u.add_(g).mul_(self.momentum)
            v.add_(u).add_(g)
        else:
            u.mul_(self.momentum).add_(g)
            v.add_(u)
        msg = self.codec.encode(v, seed=seed)
        sent = torch.zeros_like(v)
        self.codec.decode_add(msg, sent)
        v.sub_(sent)
        if self.masking:
            keep = sent == 0
            u.mul_(keep)
            v.mul_(keep)
        return msg

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"momentum/{k}": t for k, t in self.momentums.items()}
        state.update({f"velocity/{k}": t for k, t in self.velocities.items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        entries = _entries(state, prefixes=("momentum/", "velocity/"), memory="DGC")
        self.momentums, self.velocities = entries["momentum/"], entries["velocity/"]


class RoundMemory(NoFeedback):
    """A worker's memory of a multi-round codec (PowerSGD), one state per layer.

    1. ``encode`` starts a layer's step: the codec's first round (or its plain one-round message
       for a shape it does not factor).
    2. ``advance`` answers the server's reply of a round with the next round's message.
    3. ``finish`` turns the last reply into the gradient every worker applies.
    The state (PowerSGD's error memory and warm-start Q) is checkpointed; a checkpoint is taken
    between steps, when no round is open.
    """

    def __init__(self, codec: Codec) -> None:
        super().__init__(codec)
        self.states: dict[str, dict[str, torch.Tensor]] = {}

    def encode(self, layer: str, grad: torch.Tensor, seed: int) -> Message:
        shape = tuple(grad.shape)
        if self.codec.rounds(shape) == 1:
            return self.codec.encode(grad, seed=seed)
        arrays = self.codec.first_round(self.states.setdefault(layer, {}), grad, seed)
        return self._message(shape, arrays, 1, seed)

    def advance(self, layer: str, shape: tuple[int, ...], round_: int, reply: dict[str, torch.Tensor]) -> Message:
        """The message of round ``round_ + 1`` after the server's reply to ``round_``."""
        arrays = self.codec.next_round(self.states[layer], shape, reply)
        return self._message(shape, arrays, round_ + 1)

    def finish(
        self, layer: str, reply: dict[str, torch.Tensor], applied: bool = True, gradient: bool = True
    ) -> torch.Tensor | None:
        """The flat gradient of the layer's last reply (``applied`` False: the server skipped it;
        ``gradient`` False: only the memory is updated)."""
        return self.codec.finish(self.states[layer], reply, applied, gradient)

    def _message(self, shape: tuple[int, ...], arrays: dict[str, torch.Tensor], round_: int, seed: int = 0) -> Message:
        meta = {"round": round_}
        return Message(self.codec.name, dict(self.codec.params), shape, "float32", arrays, seed=seed, meta=meta)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"round/{layer}/{key}": t for layer, state in self.states.items() for key, t in state.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.states = {}
        entries = _entries(state, prefixes=("round/",), memory=f"{self.codec.name}'s memory")["round/"]
        for key, tensor in entries.items():
            layer, _, name = key.rpartition("/")
            self.states.setdefault(layer, {})[name] = tensor


def make_feedback(kind: str, codec: Codec, **options: float) -> NoFeedback:
    """``none`` | ``ef`` (error feedback) | ``dgc`` (options: momentum, nesterov, clip_norm, ...)."""
    if kind == "none":
        return RoundMemory(codec) if codec.multi_round else NoFeedback(codec)
    if kind == "ef":
        return ErrorFeedback(codec)
    if kind == "dgc":
        return DGCMemory(codec, **options)
    raise ValueError(f"unknown feedback {kind!r}; choose one of {', '.join(FEEDBACKS)}")


def feedback_for(cfg) -> NoFeedback:
    """The worker-side memory around ``cfg.codec``, with every DGC option ``cfg`` (a RunConfig)
    gives: the one each worker of a run, and DDP's hook, encode through."""
    options = (
        {
            "momentum": cfg.dgc_momentum,
            "nesterov": cfg.nesterov,
            "clip_norm": cfg.dgc_clip_norm,
            "warmup_epochs": cfg.dgc_warmup_epochs,
        }
        if cfg.feedback == "dgc"
        else {}
    )
    return make_feedback(cfg.feedback, make_codec(cfg.codec), **options)
