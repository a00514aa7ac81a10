"""Threshold sparsification: keep every entry with |g| >= v."""

from __future__ import annotations

import math

import torch

from . import _cpu
from ._sparse import VALUE_DTYPES, SparseCodec
from .base import register


@register
class ThresholdCodec(SparseCodec):
    """Keep the entries with magnitude at least ``v``; how many depends on the gradient."""

    name = "threshold"
    defaults = {"v": 0.001, "values": "fp32"}
    choices = {"values": tuple(VALUE_DTYPES)}

    def _validate(self, params):
        if params["v"] < 0:
            raise ValueError(f"threshold: v must be >= 0, got {params['v']}")

    def _encode(self, flat, shape, seed):
        if flat.device.type == "cpu":
            return self._pack_cpu(*_cpu.entries_at_least(_cpu.host(flat), float(self.params["v"])))
        return self._pack(flat, torch.nonzero(flat.abs() >= float(self.params["v"])).view(-1))

    def _check_values(self, msg):
        if msg.arrays["gaps"].numel() > msg.numel:
            raise ValueError("threshold: more entries than the tensor has")
        super()._check_values(msg)

    def max_payload_bytes(self, shape):
        return self._entry_bytes() * math.prod(shape)
