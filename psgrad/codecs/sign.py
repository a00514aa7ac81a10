"""sign+norm: one bit per element and one scale."""

from __future__ import annotations

import math

import torch

from . import _bits, _cpu
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
        if flat.device.type == "cpu":
            packed, l1 = _cpu.negative_bits(_cpu.host(flat), with_l1=True)
            scale = torch.tensor([l1 / max(1, flat.numel())], dtype=torch.float32)
            return {"scale": scale, "signs": torch.from_numpy(packed)}
        scale = flat.abs().mean() if flat.numel() else flat.new_zeros(())
        return {"scale": scale.reshape(1).float(), "signs": _bits.pack_negative(flat)}

    def _decode(self, msg: Message, device):
        out = torch.zeros(msg.numel, dtype=torch.float32, device=device)
        self.decode_add(msg, out)
        return out

    def decode_add(self, msg: Message, out: torch.Tensor, alpha: float = 1.0) -> None:
        scale = msg.arrays["scale"].to(out.device)
        if out.device.type == "cpu" and out.dtype == torch.float32:
            _cpu.add_rows(_cpu.SIGN_ROWS, _cpu.host(msg.arrays["signs"]), _cpu.host(out.view(-1)), alpha * float(scale))
            return
        signs = _bits.unpack_signs(msg.arrays["signs"].to(out.device), msg.numel)
        out.view(-1).addcmul_(signs, scale, value=alpha)

    def _expected(self, msg):
        return {"scale": (torch.float32, (1,)), "signs": (torch.uint8, (_bits.packed_nbytes(msg.numel, 1),))}

    def max_payload_bytes(self, shape):
        return 4 + _bits.packed_nbytes(math.prod(shape), 1)
