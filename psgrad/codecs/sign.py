"""sign+norm: one bit per element and one scale, or one scale per bucket."""

from __future__ import annotations

import math

import torch

from . import _bits, _buckets, _cpu
from .base import Codec, Message, register


@register
class SignCodec(Codec):
    """Scaled sign (as CHOCO-SGD's ``sign+norm``), the scale per tensor or per bucket.

    1. scale = mean |g|, over the whole tensor (``bucket=0``, the default) or over each run of
       ``bucket`` consecutive elements (the last may be short): the decoded tensor has g's L1
       norm, bucket by bucket.
    2. Send sign bits (1 = negative) packed 8 per byte, and the scales as fp32.
    3. Decode: scale of the element's bucket * (+1 or -1).

    A scale per bucket costs 32 / bucket bits per element (``bucket=32``: 2 bits in all) and
    follows the gradient's magnitude inside a layer: a filter whose gradient is 10x another's
    no longer gets the layer's average (docs/codecs.md has what it buys in accuracy).
    """

    name = "sign"
    defaults = {"bucket": 0}

    def _validate(self, params):
        if params["bucket"] < 0:
            raise ValueError(f"sign: bucket must be >= 0 (0: one scale per tensor), got {params['bucket']}")

    def _scale_count(self, numel: int) -> int:
        bucket = int(self.params["bucket"])
        return 1 if bucket == 0 else max(1, _buckets.count(numel, bucket))

    def _encode(self, flat, shape, seed):
        n, bucket = flat.numel(), int(self.params["bucket"])
        if self._scale_count(n) > 1:
            if flat.device.type == "cpu":
                packed, means = _cpu.negative_bits_and_means(_cpu.host(flat), bucket)
                return {"scale": torch.from_numpy(means), "signs": torch.from_numpy(packed)}
            scales = _buckets.reduce(flat.abs(), bucket, torch.mean)
            return {"scale": scales.float(), "signs": _bits.pack_negative(flat)}
        if flat.device.type == "cpu":
            packed, l1 = _cpu.negative_bits(_cpu.host(flat), with_l1=True)
            scale = torch.tensor([l1 / max(1, n)], dtype=torch.float32)
            return {"scale": scale, "signs": torch.from_numpy(packed)}
        scale = flat.abs().mean() if n else flat.new_zeros(())
        return {"scale": scale.reshape(1).float(), "signs": _bits.pack_negative(flat)}

    def _decode(self, msg: Message, device):
        out = torch.zeros(msg.numel, dtype=torch.float32, device=device)
        self.decode_add(msg, out)
        return out

    def decode_add(self, msg: Message, out: torch.Tensor, alpha: float = 1.0) -> None:
        scale = msg.arrays["scale"].to(out.device)
        on_cpu = out.device.type == "cpu" and out.dtype == torch.float32
        if scale.numel() > 1:
            bucket = int(self.params["bucket"])
            if on_cpu:
                factors = _cpu.host(scale) * float(alpha)
                _cpu.add_signs_per_bucket(_cpu.host(msg.arrays["signs"]), _cpu.host(out.view(-1)), factors, bucket)
                return
            signs = _bits.unpack_signs(msg.arrays["signs"].to(out.device), msg.numel)
            out.view(-1).add_(_buckets.per_bucket(signs, bucket, scale).to(out.dtype), alpha=alpha)
            return
        if on_cpu:
            signed = alpha * float(scale)
            _cpu.add_bits(_cpu.host(msg.arrays["signs"]), _cpu.host(out.view(-1)), -signed, signed)
            return
        signs = _bits.unpack_signs(msg.arrays["signs"].to(out.device), msg.numel)
        out.view(-1).addcmul_(signs, scale, value=alpha)

    def _expected(self, msg):
        return {
            "scale": (torch.float32, (self._scale_count(msg.numel),)),
            "signs": (torch.uint8, (_bits.packed_nbytes(msg.numel, 1),)),
        }

    def max_payload_bytes(self, shape):
        n = math.prod(shape)
        return 4 * self._scale_count(n) + _bits.packed_nbytes(n, 1)
