"""Dense codecs: ``none`` (fp32, the baseline) and ``fp16`` (half precision, saturating)."""

from __future__ import annotations

import torch

from . import _cpu
from .base import Codec, Message, register

_FP16_MAX = 65504.0


@register
class NoneCodec(Codec):
    """The identity: fp32 values, 32 bits per element."""

    name = "none"

    @property
    def unbiased(self) -> bool:
        return True

    @property
    def sums_in_code_space(self) -> bool:
        return True

    def _encode(self, flat, shape, seed):
        return {"values": flat.clone()}  # a Message never aliases the caller's tensor

    def _decode(self, msg: Message, device):
        return msg.arrays["values"].to(device, torch.float32)

    def _expected(self, msg):
        return {"values": (torch.float32, (msg.numel,))}


@register
class FP16Codec(Codec):
    """Half precision, 16 bits per element; values beyond fp16's range saturate at +-65504."""

    name = "fp16"

    def _encode(self, flat, shape, seed):
        """Clamp and cast one block at a time: torch's fp16 casts are vectorized (numpy's are
        not), and block-sized temporaries spare a 4 M-element layer two full-size ones."""
        values = torch.empty(flat.numel(), dtype=torch.float16, device=flat.device)
        scratch = flat.new_empty(min(flat.numel(), _cpu.BLOCK))
        for start, stop in _cpu.blocks(flat.numel()):
            clamped = torch.clamp(flat[start:stop], -_FP16_MAX, _FP16_MAX, out=scratch[: stop - start])
            values[start:stop].copy_(clamped)
        return {"values": values}

    def _decode(self, msg: Message, device):
        return msg.arrays["values"].to(device, torch.float32)

    def decode_add(self, msg: Message, out: torch.Tensor, alpha: float = 1.0) -> None:
        """``out += alpha * values``, block by block: adding a half tensor to a float one would
        otherwise materialize the whole float copy first."""
        values, target = msg.arrays["values"].to(out.device), out.view(-1)
        for start, stop in _cpu.blocks(values.numel()):
            target[start:stop].add_(values[start:stop], alpha=alpha)

    def _expected(self, msg):
        return {"values": (torch.float16, (msg.numel,))}

    def max_payload_bytes(self, shape):
        return 2 * super().max_payload_bytes(shape) // 4
