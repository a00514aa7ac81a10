"""Top-k sparsification: the k entries of largest magnitude, exact or via a sampled threshold."""

from __future__ import annotations

import math

import numpy as np
import torch

from . import _cpu
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


@_cpu.quiet
def sampled_topk_cpu(x: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sampled_topk_indices` in numpy, for every size: the sorted indices of the k largest
    |x| and their values. Candidates are found one block at a time (``_cpu.entries_at_least``,
    no full-size ``|x|``), and the exact top-k among them is numpy's introselect
    (``argpartition``)."""
    n = x.size
    if n <= 2 * _SAMPLE or k * 4 >= n:
        chosen = np.sort(np.argpartition(np.abs(x), n - k)[n - k :]) if k < n else np.arange(n)
        return chosen, x[chosen]
    stride = max(1, n // _SAMPLE)
    sample = np.abs(x[seed % stride :: stride])
    ks = min(sample.size, max(1, math.ceil(_OVERSHOOT * k * sample.size / n)))
    threshold = float(np.partition(sample, sample.size - ks)[sample.size - ks])
    for _ in range(4):
        candidates, values = _cpu.entries_at_least(x, threshold)
        if candidates.size >= k:
            break
        threshold *= 0.5
    else:
        candidates, values = np.arange(n), x
    if candidates.size > k:
        chosen = np.sort(np.argpartition(np.abs(values), values.size - k)[values.size - k :])
        candidates, values = candidates[chosen], values[chosen]
    return candidates, values


@register
class TopKCodec(SparseCodec):
    """Keep the ``ceil(ratio * n)`` largest-magnitude entries; ``values=fp16`` halves the value
    bytes. On the CPU the set is always found through a sampled threshold
    (:func:`sampled_topk_cpu`: exact, 20x ``torch.topk`` at 4 M elements); on other devices
    ``approx=1`` does that in torch and ``approx=0`` runs ``torch.topk``. Both give the same set."""

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
        if flat.device.type == "cpu":
            return self._pack_cpu(*sampled_topk_cpu(_cpu.host(flat), k, seed))
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
