"""sign+norm: one bit per element and one scale."""

from __future__ import annotations

import math

import torch

from . import _bits
from .base import Codec, Message, register


@register
class SignCodec(Codec):
    """Scaled sign (as CHOCO-SGD's ``sign+norm``).

    1. scale = mean |g| (so the decoded tensor has the same L1 norm as g).
    2. Send sign bits (1 = negative) packed 8 per byte, and the scale as one fp32.
    3. Decode: scale * (+1 or -1).
    """

    name = "sign"

    def _encode(self, flat, shape, seed):
        scale = flat.abs().mean() if flat.numel() else flat.new_zeros(())
        return {"scale": scale.reshape(1).float(), "signs": _bits.pack_negative(flat)}

    def _decode(self, msg: Message, device):
        return _bits.unpack_signs(msg.arrays["signs"].to(device), msg.numel).mul_(msg.arrays["scale"].to(device))

    def decode_add(self, msg: Message, out: torch.Tensor, alpha: float = 1.0) -> None:
        signs = _bits.unpack_signs(msg.arrays["signs"].to(out.device), msg.numel)
        out.view(-1).addcmul_(signs, msg.arrays["scale"].to(out.device), value=alpha)

    def encode_residual(self, x: torch.Tensor, seed: int = 0) -> Message:
        """Fused: pack the sign bits, decode them once into s (+-1, exactly what the receiver
        will see), scale = <x, s> / n = mean |x| (one dot product, no |x| temporary), x -= scale s."""
        if x.dtype != torch.float32 or x.numel() == 0 or not x.is_contiguous():
            return super().encode_residual(x, seed)
        flat = x.view(-1)
        packed = _bits.pack_negative(flat)
        signs = _bits.unpack_signs(packed, flat.numel())
        scale = (torch.dot(flat, signs) / flat.numel()).reshape(1)
        flat.addcmul_(signs, scale, value=-1.0)
        return Message(self.name, dict(self.params), tuple(x.shape), "float32", {"scale": scale, "signs": packed})

    def _expected(self, msg):
        return {"scale": (torch.float32, (1,)), "signs": (torch.uint8, (_bits.packed_nbytes(msg.numel, 1),))}

    def max_payload_bytes(self, shape):
        return 4 + _bits.packed_nbytes(math.prod(shape), 1)
