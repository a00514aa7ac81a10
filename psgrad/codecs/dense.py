"""Dense codecs: ``none`` (fp32, the baseline) and ``fp16`` (half precision, saturating)."""

from __future__ import annotations

import torch

from .base import Codec, Message, register

_FP16_MAX = 65504.0


@register
class NoneCodec(Codec):
    """The identity: fp32 values, 32 bits per element."""

    name = "none"

    @property
    def unbiased(self) -> bool:
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
        return {"values": flat.clamp(-_FP16_MAX, _FP16_MAX).half()}

    def _decode(self, msg: Message, device):
        return msg.arrays["values"].to(device, torch.float32)

    def _expected(self, msg):
        return {"values": (torch.float16, (msg.numel,))}

    def max_payload_bytes(self, shape):
        return 2 * super().max_payload_bytes(shape) // 4
