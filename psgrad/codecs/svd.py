"""ATOMO-style spectral coding: the gradient as a matrix, sent as a few singular triplets."""

from __future__ import annotations

import math

import torch

from . import _bits
from .base import Codec, Message, register


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Rows = first dimension (output channels), columns = the rest; vectors become one row."""
    if len(shape) >= 2:
        return shape[0], math.prod(shape[1:])
    return 1, math.prod(shape)


def atomo_probabilities(sigma: torch.Tensor, budget: int) -> torch.Tensor:
    """Inclusion probabilities p_i = min(1, c * sigma_i) with sum p_i = budget (ATOMO, eq. 6).

    1. Sort sigma descending (torch.linalg.svd already does).
    2. For j = 0, 1, ...: assume the j largest get p = 1, and c = (budget - j) / sum(sigma[j:]).
    3. Accept the first j for which c * sigma[j] <= 1.
    """
    nonzero = int((sigma > 0).sum())
    if nonzero <= budget:
        return (sigma > 0).to(sigma.dtype)
    for j in range(budget):
        c = (budget - j) / float(sigma[j:].sum())
        if c * float(sigma[j]) <= 1.0:
            return torch.cat([torch.ones(j, dtype=sigma.dtype), (c * sigma[j:]).clamp(max=1.0)])
    return torch.cat([torch.ones(budget, dtype=sigma.dtype), torch.zeros(len(sigma) - budget, dtype=sigma.dtype)])


def top_singular_triplets(
    matrix: torch.Tensor, rank: int, *, generator: torch.Generator, oversample: int = 8, power_iters: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``rank`` largest singular triplets, by a seeded randomized range finder when that is cheaper.

    1. If rank + oversample is not well below min(rows, cols), a full thin SVD is as cheap: use it.
    2. Y = M G with a Gaussian G (cols x (rank + oversample)) drawn from ``generator``.
    3. ``power_iters`` times: Q = orth(Y), Y = M (M^T Q), which sharpens the spectrum's decay.
    4. Q = orth(Y); the small matrix B = Q^T M has the top singular values of M; its SVD
       B = Ub S Vh gives M's triplets U = Q Ub, S, Vh (exact when rank(M) <= rank + oversample).
    """
    rows, cols = matrix.shape
    width = rank + oversample
    if 2 * width >= min(rows, cols):
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
        return u[:, :rank], s[:rank], vh[:rank]
    gauss = torch.randn(cols, width, generator=generator, device=matrix.device, dtype=matrix.dtype)
    y = matrix @ gauss
    for _ in range(power_iters):
        q = torch.linalg.qr(y).Q
        y = matrix @ (matrix.T @ q)
    q = torch.linalg.qr(y).Q
    ub, s, vh = torch.linalg.svd(q.T @ matrix, full_matrices=False)
    return (q @ ub)[:, :rank], s[:rank], vh[:rank]


@register
class SVDCodec(Codec):
    """Rank-``rank`` spectral coding of the gradient reshaped to a matrix.

    1. Reshape g to (rows, cols).
    2. ``sample=0``: keep the ``rank`` largest triplets (exact when rank(g) <= rank, biased), found
       by ``top_singular_triplets`` (a seeded randomized SVD on large matrices).
       ``sample=1``: keep triplet i with probability p_i (ATOMO) and scale S_i by 1 / p_i;
       E = g, and about ``rank`` triplets travel.
    3. Send U_k (rows x k), S_k (k), V_k^T (k x cols) in fp32; decode U_k diag(S_k) V_k^T.
    """

    name = "svd"
    defaults = {"rank": 2, "sample": False}

    def _validate(self, params):
        if params["rank"] < 1:
            raise ValueError(f"svd: rank must be >= 1, got {params['rank']}")

    @property
    def unbiased(self) -> bool:
        return bool(self.params["sample"])

    def _encode(self, flat, shape, seed):
        rows, cols = matrix_shape(shape)
        if flat.numel() == 0:
            return {"u": flat.new_zeros(rows, 0), "s": flat.new_zeros(0), "v": flat.new_zeros(0, cols)}
        rank = int(self.params["rank"])
        if not self.params["sample"]:
            u, s, vh = top_singular_triplets(flat.view(rows, cols), rank, generator=_bits.generator(seed, flat.device))
            return {"u": u.contiguous(), "s": s.contiguous(), "v": vh.contiguous()}
        # ATOMO sampling needs every singular value
        u, s, vh = torch.linalg.svd(flat.view(rows, cols), full_matrices=False)
        p = atomo_probabilities(s.cpu(), rank).to(s.device)
        rand = torch.rand(len(s), generator=_bits.generator(seed, s.device), device=s.device)
        keep = torch.nonzero(rand < p).view(-1)
        return {"u": u[:, keep].contiguous(), "s": s[keep] / p[keep], "v": vh[keep].contiguous()}

    def _decode(self, msg: Message, device):
        u, s, v = (msg.arrays[key].to(device, torch.float32) for key in ("u", "s", "v"))
        return ((u * s) @ v).view(-1)

    def _expected(self, msg):
        rows, cols = matrix_shape(msg.shape)
        k = msg.arrays["s"].numel() if "s" in msg.arrays else 0
        if k > min(rows, cols):
            raise ValueError(f"svd: {k} triplets for a {rows}x{cols} matrix")
        return {"u": (torch.float32, (rows, k)), "s": (torch.float32, (k,)), "v": (torch.float32, (k, cols))}

    def max_payload_bytes(self, shape):
        rows, cols = matrix_shape(shape)
        k = min(rows, cols) if self.params["sample"] else min(rows, cols, int(self.params["rank"]))
        return 4 * k * (rows + cols + 1)

    def budget_bits(self, shape):
        rows, cols = matrix_shape(shape)
        k = min(rows, cols, int(self.params["rank"]))
        return 32 * k * (rows + cols + 1) / max(1, rows * cols)
