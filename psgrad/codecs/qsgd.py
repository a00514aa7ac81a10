"""QSGD: stochastic s-level quantization per bucket, bit-packed."""

from __future__ import annotations

import math

import numpy as np
import torch

from . import _bits, _buckets, _cpu
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

    def _bucket_count(self, numel: int) -> int:
        return _buckets.count(numel, int(self.params["bucket"]))

    def _norms(self, flat: torch.Tensor) -> torch.Tensor:
        """Step 1: the L2 norm of every bucket (the last one may be short)."""
        return _buckets.reduce(flat, int(self.params["bucket"]), torch.linalg.vector_norm)

    def _encode(self, flat, shape, seed):
        n, bucket, s = flat.numel(), int(self.params["bucket"]), int(self.params["levels"])
        norms = self._norms(flat)
        inv = torch.where(norms > 0, s / norms, torch.zeros_like(norms))
        if flat.device.type == "cpu":
            return self._encode_cpu(_cpu.host(flat), norms, _cpu.host(inv), seed)
        scaled = _buckets.per_bucket(flat.abs(), bucket, inv)
        levels = scaled.add_(_bits.uniform(n, seed, flat.device)).floor_().clamp_(max=s)
        return {
            "norms": norms,
            "levels": _bits.pack_bits(_bits.to_uint8(levels), self.width),
            "signs": _bits.pack_negative(flat),
        }

    @_cpu.quiet
    def _encode_cpu(self, x: np.ndarray, norms: torch.Tensor, inv: np.ndarray, seed: int) -> dict[str, torch.Tensor]:
        """Steps 2-3 one block of whole buckets at a time (``_cpu``), with the uniforms of
        :class:`_cpu.Uniforms`: level = floor(|x| s / norm + u) - 1 for u in [1, 2)."""
        n, bucket, s, width = x.size, int(self.params["bucket"]), int(self.params["levels"]), self.width
        plane = _bits.packed_nbytes(n, 1)
        levels, signs = np.empty(width * plane, dtype=np.uint8), np.empty(plane, dtype=np.uint8)
        if _cpu.native(x, inv):  # the same steps, one fused pass
            _cpu.compiled.qsgd_encode(x, inv, bucket, s, width, _cpu.Uniforms.key(seed), levels, signs)
            return {"norms": norms, "levels": torch.from_numpy(levels), "signs": torch.from_numpy(signs)}
        multiple = math.lcm(bucket, 8)
        scaled, codes = _cpu.block_buffer(n, np.float32, multiple), _cpu.block_buffer(n, np.uint8, multiple)
        negative = _cpu.block_buffer(n, np.bool_, multiple)
        uniforms = _cpu.Uniforms(seed, len(scaled))
        for start, stop in _cpu.blocks(n, multiple):
            count, block = stop - start, x[start:stop]
            level = _buckets.per_bucket_cpu(np.abs(block, out=scaled[:count]), bucket, inv[start // bucket :])
            level += uniforms.at(start, count)
            code = codes[:count]
            np.copyto(code, level, casting="unsafe")  # level >= 1: truncation is floor
            if code.max() > s + 1:  # rounding pushed |x| s / norm past s (numpy's minimum is slow)
                np.minimum(code, np.uint8(s + 1), out=code)
            code -= 1
            for j in range(width):
                levels[j * plane + start // 8 : j * plane + (stop + 7) // 8] = np.packbits(code & (1 << j))
            signs[start // 8 : (stop + 7) // 8] = np.packbits(np.less(block, 0, out=negative[:count]))
        return {"norms": norms, "levels": torch.from_numpy(levels), "signs": torch.from_numpy(signs)}

    def _decode(self, msg: Message, device):
        n, bucket, s = msg.numel, int(self.params["bucket"]), int(self.params["levels"])
        if device.type == "cpu":
            out = torch.zeros(n, dtype=torch.float32)
            self.decode_add(msg, out)
            return out
        levels = _bits.unpack_bits(msg.arrays["levels"].to(device), n, self.width).float()
        levels.mul_(_bits.unpack_signs(msg.arrays["signs"].to(device), n))
        return _buckets.per_bucket(levels, bucket, msg.arrays["norms"].to(device) / s)

    @_cpu.quiet
    def decode_add(self, msg: Message, out: torch.Tensor, alpha: float = 1.0) -> None:
        """On the CPU one block at a time: the level from its bit planes, times its sign, times
        alpha * norm / s of its bucket, added to ``out``."""
        if out.device.type != "cpu" or out.dtype != torch.float32:
            super().decode_add(msg, out, alpha)
            return
        n, bucket, width = msg.numel, int(self.params["bucket"]), self.width
        plane = _bits.packed_nbytes(n, 1)
        levels, signs = _cpu.host(msg.arrays["levels"]), _cpu.host(msg.arrays["signs"])
        factors = _cpu.host(msg.arrays["norms"]) * np.float32(alpha / int(self.params["levels"]))
        target = _cpu.host(out.view(-1))
        if _cpu.native(levels, signs, factors, target):
            _cpu.compiled.qsgd_decode_add(levels, signs, factors, bucket, width, target)
            return
        multiple = math.lcm(bucket, 8)
        codes, values = _cpu.block_buffer(n, np.uint8, multiple), _cpu.block_buffer(n, np.float32, multiple)
        words = _cpu.block_buffer(n, np.uint32, multiple)
        for start, stop in _cpu.blocks(n, multiple):
            count, first, last = stop - start, start // 8, (stop + 7) // 8
            code = codes[:count]
            code[:] = np.unpackbits(levels[first:last], count=count)
            for j in range(1, width):  # numpy's uint8 multiply is vectorized, its shift is not
                bits = np.unpackbits(levels[j * plane + first : j * plane + last], count=count)
                code += np.multiply(bits, np.uint8(1 << j), out=bits)
            value = values[:count]
            np.copyto(value, code, casting="unsafe")
            # a set sign bit flips the float's sign bit: bit * 2^31 XOR-ed into its uint32 view
            flip = words[:count]
            np.copyto(flip, np.unpackbits(signs[first:last], count=count), casting="unsafe")
            flip *= np.uint32(1 << 31)
            np.bitwise_xor(value.view(np.uint32), flip, out=value.view(np.uint32))
            _buckets.per_bucket_cpu(value, bucket, factors[start // bucket :])
            np.add(target[start:stop], value, out=target[start:stop])

    def _expected(self, msg):
        n = msg.numel
        return {
            "norms": (torch.float32, (self._bucket_count(n),)),
            "levels": (torch.uint8, (_bits.packed_nbytes(n, self.width),)),
            "signs": (torch.uint8, (_bits.packed_nbytes(n, 1),)),
        }

    def max_payload_bytes(self, shape):
        n = math.prod(shape)
        return 4 * self._bucket_count(n) + _bits.packed_nbytes(n, self.width) + _bits.packed_nbytes(n, 1)
