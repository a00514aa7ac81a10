"""Buckets: consecutive runs of ``bucket`` elements (the last may be short), each with a factor of
its own. QSGD sends a norm per bucket, sign a scale per bucket; both multiply values by them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def count(numel: int, bucket: int) -> int:
    """Buckets covering ``numel`` elements."""
    return -(-numel // bucket)


def reduce(values: torch.Tensor, bucket: int, fn: Callable[..., torch.Tensor]) -> torch.Tensor:
    """One number per bucket of flat ``values``: ``fn(matrix, dim=1)`` over the whole buckets and
    ``fn(rest)`` over a short last one (QSGD's L2 norms, sign's mean magnitudes)."""
    full = values.numel() // bucket * bucket
    out = fn(values[:full].view(-1, bucket), dim=1)
    if full < values.numel():
        out = torch.cat([out, fn(values[full:]).reshape(1)])
    return out


def per_bucket(values: torch.Tensor, bucket: int, factors: torch.Tensor) -> torch.Tensor:
    """values[i] *= factors[i // bucket] in place, without padding or repeating ``factors``."""
    full = values.numel() // bucket * bucket
    values[:full].view(-1, bucket).mul_(factors[: full // bucket, None])
    if full < values.numel():
        values[full:].mul_(factors[-1])
    return values


def per_bucket_cpu(values: np.ndarray, bucket: int, factors: np.ndarray) -> np.ndarray:
    """The same in numpy, for a block that starts a bucket (``factors`` starts at its bucket)."""
    full = values.size // bucket * bucket
    if full:
        matrix = values[:full].reshape(-1, bucket)
        np.multiply(matrix, factors[: full // bucket, None], out=matrix)
    if full < values.size:
        values[full:] *= factors[full // bucket]
    return values
