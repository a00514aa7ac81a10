"""Random-k sparsification: k coordinates drawn from the seed, so only values travel."""

from __future__ import annotations

import math

import torch

from . import _bits
from .base import Codec, Message, register


@register
class RandomKCodec(Codec):
    """Send the values at k uniformly drawn coordinates, rescaled by n / k (unbiased).

    1. Draw k indices uniformly with replacement from a CPU generator seeded with ``seed``
       (drawing with replacement keeps encoding O(k); a duplicate simply counts twice).
    2. Send the values at those indices; the receiver regenerates the indices from the seed.
    3. Decode scatters-adds ``values * n / k``: every draw has expectation g / k, so the sum is
       unbiased.
    """

    name = "randomk"
    defaults = {"ratio": 0.01}

    def _validate(self, params):
        if not 0.0 < params["ratio"] <= 1.0:
            raise ValueError(f"randomk: ratio must be in (0, 1], got {params['ratio']}")

    @property
    def unbiased(self) -> bool:
        return True

    @property
    def feedback_safe(self) -> bool:
        # a kept coordinate leaves a residual of (1 - c n/k) x_i (c = times drawn): at least as
        # large as x_i for any ratio < 1, so the memory grows without bound
        return float(self.params["ratio"]) >= 1.0

    def k_for(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(float(self.params["ratio"]) * numel))) if numel else 0

    @staticmethod
    def _indices(numel: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
        if k == 0:  # an empty tensor: randint cannot draw from an empty range
            return torch.zeros(0, dtype=torch.int64, device=device)
        gen = _bits.generator(seed, torch.device("cpu"))
        return torch.randint(0, numel, (k,), generator=gen).to(device)

    def _encode(self, flat, shape, seed):
        k = self.k_for(flat.numel())
        return {"values": flat[self._indices(flat.numel(), k, seed, flat.device)]}

    def _decode(self, msg: Message, device):
        out = torch.zeros(msg.numel, dtype=torch.float32, device=device)
        self.decode_add(msg, out)
        return out

    def decode_add(self, msg: Message, out: torch.Tensor, alpha: float = 1.0) -> None:
        k = self.k_for(msg.numel)
        if k == 0:
            return
        indices = self._indices(msg.numel, k, msg.seed, out.device)
        values = msg.arrays["values"].to(out.device, torch.float32)
        out.view(-1).index_add_(0, indices, values, alpha=alpha * msg.numel / k)

    def _expected(self, msg):
        return {"values": (torch.float32, (self.k_for(msg.numel),))}

    def max_payload_bytes(self, shape):
        return 4 * self.k_for(math.prod(shape))
