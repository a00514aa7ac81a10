"""QSGD: stochastic s-level quantization per bucket, bit-packed."""

from __future__ import annotations

import math

import torch

from . import _bits
from .base import Codec, Message, register


@register
class QSGDCodec(Codec):
    """Unbiased stochastic quantization to ``levels`` magnitude levels per bucket of ``bucket`` entries.

    1. Split g into buckets; each bucket sends its L2 norm (fp32).
    2. For each entry x = |g_i| / norm * s in [0, s]: level = floor(x) + Bernoulli(x - floor(x)),
       so E[level] = x and the decoded value level / s * norm * sign(g_i) is unbiased.
    3. Levels (0..s) are packed in ceil(log2(s + 1)) bits, signs in 1 bit: for s = 15 that is
       5 bits per element plus 32 / bucket bits of norm.
    """

    name = "qsgd"
    defaults = {"levels": 16, "bucket": 512}
    compressible = frozenset({"levels"})

    def _validate(self, params):
        if not 1 <= params["levels"] <= 255:
            raise ValueError(f"qsgd: levels must be in 1..255, got {params['levels']}")
        if params["bucket"] < 1:
            raise ValueError(f"qsgd: bucket must be >= 1, got {params['bucket']}")

    @property
    def unbiased(self) -> bool:
        return True

    @property
    def width(self) -> int:
        return max(1, math.ceil(math.log2(int(self.params["levels"]) + 1)))

    def _buckets(self, numel: int) -> int:
        return -(-numel // int(self.params["bucket"]))

    @staticmethod
    def _per_bucket(values: torch.Tensor, bucket: int, factors: torch.Tensor) -> torch.Tensor:
        """values[i] *= factors[i // bucket] in place, without padding or repeating ``factors``."""
        full = values.numel() // bucket * bucket
        values[:full].view(-1, bucket).mul_(factors[: full // bucket, None])
        if full < values.numel():
            values[full:].mul_(factors[-1])
        return values

    def _encode(self, flat, shape, seed):
        n, bucket, s = flat.numel(), int(self.params["bucket"]), int(self.params["levels"])
        full = n // bucket * bucket
        norms = torch.linalg.vector_norm(flat[:full].view(-1, bucket), dim=1)
        if full < n:
            norms = torch.cat([norms, torch.linalg.vector_norm(flat[full:]).reshape(1)])
        inv = torch.where(norms > 0, s / norms, torch.zeros_like(norms))
        scaled = self._per_bucket(flat.abs(), bucket, inv)
        levels = scaled.add_(_bits.uniform(n, seed, flat.device)).floor_().clamp_(max=s)
        return {
            "norms": norms,
            "levels": _bits.pack_bits(_bits.to_uint8(levels), self.width),
            "signs": _bits.pack_negative(flat),
        }

    def _decode(self, msg: Message, device):
        n, bucket, s = msg.numel, int(self.params["bucket"]), int(self.params["levels"])
        levels = _bits.unpack_bits(msg.arrays["levels"].to(device), n, self.width).float()
        levels.mul_(_bits.unpack_signs(msg.arrays["signs"].to(device), n))
        return self._per_bucket(levels, bucket, msg.arrays["norms"].to(device) / s)

    def _expected(self, msg):
        n = msg.numel
        return {
            "norms": (torch.float32, (self._buckets(n),)),
            "levels": (torch.uint8, (_bits.packed_nbytes(n, self.width),)),
            "signs": (torch.uint8, (_bits.packed_nbytes(n, 1),)),
        }

    def max_payload_bytes(self, shape):
        n = math.prod(shape)
        return 4 * self._buckets(n) + _bits.packed_nbytes(n, self.width) + _bits.packed_nbytes(n, 1)
