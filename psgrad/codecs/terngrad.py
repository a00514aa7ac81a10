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
        scale = flat.abs().max() if flat.numel() else flat.new_zeros(())
        rand = torch.rand(flat.numel(), generator=_bits.generator(seed, flat.device), device=flat.device)
        keep = (rand * scale < flat.abs()).to(torch.uint8)
        codes = keep + keep * (flat < 0).to(torch.uint8)
        return {"scale": scale.reshape(1).float(), "codes": _bits.pack_bits(codes, 2)}

    def _decode(self, msg: Message, device):
        scale = float(msg.arrays["scale"][0])
        table = torch.tensor([0.0, scale, -scale, 0.0], device=device)
        codes = _bits.unpack_bits(msg.arrays["codes"].to(device), msg.numel, 2)
        return table[codes.long()]

    def _expected(self, msg):
        return {"scale": (torch.float32, (1,)), "codes": (torch.uint8, (_bits.packed_nbytes(msg.numel, 2),))}

    def max_payload_bytes(self, shape):
        return 4 + _bits.packed_nbytes(math.prod(shape), 2)
