"""TernGrad: stochastic ternary coding {-s, 0, +s}, 2 bits per element."""

from __future__ import annotations

import math

import torch

from . import _bits
from .base import Codec, Message, register

_SIGMAS = 2.5  # TernGrad's gradient clipping bound, in standard deviations


@register
class TernGradCodec(Codec):
    """Stochastic ternarization with max-norm scaling (unbiased) or 2.5-sigma clipping (``clip=1``).

    1. With ``clip=1`` clamp g to [-2.5 sigma, 2.5 sigma] (lower variance, biased).
    2. s = max |g|.
    3. Each entry becomes sign(g) * s with probability |g| / s, else 0 (so E = g).
    4. Codes 0 (zero), 1 (+s), 2 (-s) are packed 2 bits each; s travels as one fp32.
    """

    name = "terngrad"
    defaults = {"clip": False}
    compressible = frozenset({"codes"})

    @property
    def unbiased(self) -> bool:
        return not self.params["clip"]

    def _encode(self, flat, shape, seed):
        if self.params["clip"] and flat.numel() > 1:
            bound = _SIGMAS * float(flat.std())
            flat = flat.clamp(-bound, bound)
        scale = float(flat.abs().max()) if flat.numel() else 0.0
        x = _bits.host_array(flat)
        keep = _bits.host_array(_bits.uniform(flat.numel(), seed, flat.device)) * scale < abs(x)
        negative = x < 0
        # bit plane 0 holds code 1 (+s), plane 1 code 2 (-s): pack_bits' layout of the 2-bit codes
        codes = _bits.pack_planes([keep & ~negative, keep & negative])
        return {"scale": torch.tensor([scale], dtype=torch.float32), "codes": codes}

    def _decode(self, msg: Message, device):
        codes, plane = msg.arrays["codes"].to(device), _bits.packed_nbytes(msg.numel, 1)
        values = _bits.unpack_ones(codes[:plane], msg.numel)
        values.sub_(_bits.unpack_ones(codes[plane:], msg.numel))  # code 3 (both bits) decodes to 0
        return values.mul_(msg.arrays["scale"].to(device))

    def _expected(self, msg):
        return {"scale": (torch.float32, (1,)), "codes": (torch.uint8, (_bits.packed_nbytes(msg.numel, 2),))}

    def max_payload_bytes(self, shape):
        return 4 + _bits.packed_nbytes(math.prod(shape), 2)
