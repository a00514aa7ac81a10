"""Random-k sparsification: k coordinates drawn from the seed, so only values travel."""

from __future__ import annotations

import math

import numpy as np
import torch

from . import _bits
from .base import Codec, Message, register


@register
class RandomKCodec(Codec):
    """Send the values at k uniformly drawn coordinates, rescaled by n / k (unbiased), or, with
    ``shared=1``, the values themselves at coordinates every worker shares.

    1. Draw k indices uniformly with replacement from a CPU generator seeded with ``seed``
       (drawing with replacement keeps encoding O(k); a duplicate simply counts twice).
    2. Send the values at those indices; the receiver regenerates the indices from the seed.
    3. Decode scatters-adds ``values * n / k``: every draw has expectation g / k, so the sum is
       unbiased.

    ``shared=1``: k distinct coordinates (the first k distinct draws, sorted), the values are
    sent as they are and decoded without rescaling. Workers encode with a seed that does not
    depend on the worker (``Codec.shares_randomness``), so all of them keep the same coordinates
    in a step and the server's sum is the dense sum on those coordinates. Biased, but safe inside
    error feedback: a kept coordinate leaves a residual of exactly 0 and the others keep theirs,
    so ||x - D(C(x))|| <= ||x|| (the rescaled variant leaves (1 - n/k) x and grows).
    """

    name = "randomk"
    defaults = {"ratio": 0.01, "shared": False}

    def _validate(self, params):
        if not 0.0 < params["ratio"] <= 1.0:
            raise ValueError(f"randomk: ratio must be in (0, 1], got {params['ratio']}")

    @property
    def unbiased(self) -> bool:
        return not self.params["shared"]

    @property
    def feedback_safe(self) -> bool:
        # a kept coordinate leaves a residual of (1 - c n/k) x_i (c = times drawn): at least as
        # large as x_i for any ratio < 1, so the memory grows without bound; shared keeps x_i as is
        return bool(self.params["shared"]) or float(self.params["ratio"]) >= 1.0

    @property
    def shares_randomness(self) -> bool:
        return bool(self.params["shared"])

    @property
    def sums_in_code_space(self) -> bool:
        return bool(self.params["shared"])  # the same coordinates on every sender: values add up

    def k_for(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(float(self.params["ratio"]) * numel))) if numel else 0

    @staticmethod
    def _indices(numel: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
        if k == 0:  # an empty tensor: randint cannot draw from an empty range
            return torch.zeros(0, dtype=torch.int64, device=device)
        gen = _bits.generator(seed, torch.device("cpu"))
        return torch.randint(0, numel, (k,), generator=gen).to(device)

    def _kept(self, numel: int, seed: int, device: torch.device) -> torch.Tensor:
        """The indices a message of ``numel`` elements keeps; with ``shared``, exactly k distinct
        ones, sorted: the first k distinct values of a seeded stream of uniform draws (a uniform
        random k-subset, found in O(k log k) however large the layer)."""
        k = self.k_for(numel)
        if not self.params["shared"]:
            return self._indices(numel, k, seed, device)
        if k >= numel:
            return torch.arange(numel, device=device)
        rng = np.random.Generator(np.random.PCG64(int(seed) & 0xFFFF_FFFF_FFFF_FFFF))
        draws = rng.integers(0, numel, size=k + k // 4 + 16)
        while True:
            distinct, first = np.unique(draws, return_index=True)
            if distinct.size >= k:
                break
            draws = np.concatenate([draws, rng.integers(0, numel, size=2 * (k - distinct.size) + 16)])
        return torch.from_numpy(np.sort(distinct[np.argsort(first, kind="stable")[:k]])).to(device)

    def _encode(self, flat, shape, seed):
        return {"values": flat[self._kept(flat.numel(), seed, flat.device)]}

    def _decode(self, msg: Message, device):
        out = torch.zeros(msg.numel, dtype=torch.float32, device=device)
        self.decode_add(msg, out)
        return out

    def decode_add(self, msg: Message, out: torch.Tensor, alpha: float = 1.0) -> None:
        k = self.k_for(msg.numel)
        if k == 0:
            return
        indices = self._kept(msg.numel, msg.seed, out.device)
        values = msg.arrays["values"].to(out.device, torch.float32)
        scale = 1.0 if self.params["shared"] else msg.numel / k
        out.view(-1).index_add_(0, indices, values, alpha=alpha * scale)

    def _expected(self, msg):
        return {"values": (torch.float32, (self.k_for(msg.numel),))}

    def max_payload_bytes(self, shape):
        return 4 * self.k_for(math.prod(shape))
