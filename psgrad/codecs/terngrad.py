"""TernGrad: stochastic ternary coding {-s, 0, +s}, 2 bits per element."""

from __future__ import annotations

import math

import numpy as np
import torch

from . import _bits, _cpu
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
        if flat.device.type == "cpu":
            return self._encode_cpu(_cpu.host(flat), seed)
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

    @_cpu.quiet
    def _encode_cpu(self, x: np.ndarray, seed: int) -> dict[str, torch.Tensor]:
        """The same steps in two blocked passes (``_cpu``): the first finds max |g| (and with
        ``clip=1`` the standard deviation), the second draws u in [1, 2) and keeps an entry when
        (u - 1) s < |g|, i.e. u s < |g| + s."""
        n = x.size
        peak, total, squares = 0.0, 0.0, 0.0
        ones = _cpu.block_buffer(n, np.float32)
        ones.fill(1.0)
        for start, stop in _cpu.blocks(n):
            block = x[start:stop]
            peak = max(peak, float(block.max()), -float(block.min()))
            if self.params["clip"]:  # BLAS dots: a sum and a sum of squares at memory speed
                total += float(np.dot(block, ones[: stop - start]))
                squares += float(np.dot(block, block))
        scale = peak
        if self.params["clip"] and n > 1:  # torch.std's estimator: divide by n - 1
            bound = _SIGMAS * math.sqrt(max(0.0, squares - total * total / n) / (n - 1))
            scale = min(peak, bound)
        plane = _bits.packed_nbytes(n, 1)
        codes = np.empty(2 * plane, dtype=np.uint8)
        if _cpu.native(x):  # the second pass, fused
            _cpu.compiled.terngrad_encode(x, scale, _cpu.Uniforms.key(seed), codes)
            return {"scale": torch.tensor([scale], dtype=torch.float32), "codes": torch.from_numpy(codes)}
        magnitude, keep = _cpu.block_buffer(n, np.float32), _cpu.block_buffer(n, np.bool_)
        negative, chosen = _cpu.block_buffer(n, np.bool_), _cpu.block_buffer(n, np.bool_)
        uniforms = _cpu.Uniforms(seed, len(magnitude))
        for start, stop in _cpu.blocks(n):
            count, block = stop - start, x[start:stop]
            # no clamp to the bound needed: scale <= bound, so an entry beyond it is kept either way
            mag = np.abs(block, out=magnitude[:count])
            mag += np.float32(scale)
            draw = uniforms.at(start, count)
            draw *= np.float32(scale)
            kept = np.less(draw, mag, out=keep[:count])
            neg = np.less(block, 0, out=negative[:count])
            # bit plane 0 holds code 1 (+s), plane 1 code 2 (-s): pack_bits' layout of 2-bit codes
            codes[plane + start // 8 : plane + (stop + 7) // 8] = np.packbits(
                np.logical_and(kept, neg, out=chosen[:count])
            )
            codes[start // 8 : (stop + 7) // 8] = np.packbits(np.greater(kept, neg, out=chosen[:count]))
        return {"scale": torch.tensor([scale], dtype=torch.float32), "codes": torch.from_numpy(codes)}

    @_cpu.quiet
    def decode_add(self, msg: Message, out: torch.Tensor, alpha: float = 1.0) -> None:
        if out.device.type != "cpu" or out.dtype != torch.float32:
            super().decode_add(msg, out, alpha)
            return
        codes, plane = _cpu.host(msg.arrays["codes"]), _bits.packed_nbytes(msg.numel, 1)
        scale, target = alpha * float(msg.arrays["scale"][0]), _cpu.host(out.view(-1))
        _cpu.add_bits(codes[:plane], target, scale, 0.0)
        _cpu.add_bits(codes[plane:], target, -scale, 0.0)

    def _decode(self, msg: Message, device):
        codes, plane = msg.arrays["codes"].to(device), _bits.packed_nbytes(msg.numel, 1)
        values = _bits.unpack_ones(codes[:plane], msg.numel)
        values.sub_(_bits.unpack_ones(codes[plane:], msg.numel))  # code 3 (both bits) decodes to 0
        return values.mul_(msg.arrays["scale"].to(device))

    def _expected(self, msg):
        return {"scale": (torch.float32, (1,)), "codes": (torch.uint8, (_bits.packed_nbytes(msg.numel, 2),))}

    def max_payload_bytes(self, shape):
        return 4 + _bits.packed_nbytes(math.prod(shape), 2)
