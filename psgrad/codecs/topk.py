"""Top-k sparsification: the k entries of largest magnitude, exact or via a sampled threshold."""

from __future__ import annotations

import math

import torch

from ._sparse import VALUE_DTYPES, SparseCodec
from .base import register

_SAMPLE = 4096  # entries sampled to estimate the threshold (DGC uses ~0.1 %-1 %)
_OVERSHOOT = 1.3  # aim the sampled threshold at 1.3 k candidates so one pass usually suffices


def sampled_topk_indices(magnitude: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """Exactly the indices of the k largest entries of ``magnitude``, found DGC-style.

    1. Take a strided sample of the magnitudes (start offset from the seed).
    2. Set the threshold at the sample's top ``1.3 k / n`` quantile.
    3. Select candidates >= threshold; if fewer than k, halve the threshold and retry (4 tries,
       then fall back to a full top-k).
    4. Run an exact top-k on the candidates only: since every non-candidate lies below the
       threshold and there are >= k candidates, the result is the exact global top-k set.
    """
    n = magnitude.numel()
    stride = max(1, n // _SAMPLE)
    sample = magnitude[seed % stride :: stride]
    ks = min(sample.numel(), max(1, math.ceil(_OVERSHOOT * k * sample.numel() / n)))
    threshold = torch.topk(sample, ks, sorted=False).values.min()
    for _ in range(4):
        candidates = torch.nonzero(magnitude >= threshold).view(-1)
        if candidates.numel() >= k:
            break
        threshold = threshold * 0.5
    else:
        return torch.topk(magnitude, k, sorted=False).indices
    if candidates.numel() == k:
        return candidates
    return candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]


@register
class TopKCodec(SparseCodec):
    """Keep the ``ceil(ratio * n)`` largest-magnitude entries; ``approx=1`` finds them through a
    sampled threshold (same set, faster); ``values=fp16`` halves the value bytes."""

    name = "topk"
    defaults = {"ratio": 0.01, "approx": False, "values": "fp32"}
    choices = {"values": tuple(VALUE_DTYPES)}

    def _validate(self, params):
        if not 0.0 < params["ratio"] <= 1.0:
            raise ValueError(f"topk: ratio must be in (0, 1], got {params['ratio']}")

    def k_for(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(float(self.params["ratio"]) * numel)))

    def _encode(self, flat, shape, seed):
        n = flat.numel()
        if n == 0:
            return self._pack(flat, torch.empty(0, dtype=torch.int64, device=flat.device))
        k = self.k_for(n)
        magnitude = flat.abs()
        if self.params["approx"] and n > 4 * k and n > 2 * _SAMPLE:
            indices = sampled_topk_indices(magnitude, k, seed)
        else:
            indices = torch.topk(magnitude, k, sorted=False).indices
        return self._pack(flat, indices)

    def _count(self, msg):
        return self.k_for(msg.numel) if msg.numel else 0

    def max_payload_bytes(self, shape):
        return self._entry_bytes() * self.k_for(math.prod(shape))
