"""Shared wire layout of the index-sparse codecs (top-k, threshold): sorted index gaps + values."""

from __future__ import annotations

import numpy as np
import torch

from . import _bits, _cpu
from .base import Codec, Message

VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


class SparseCodec(Codec):
    """Arrays ``gaps`` (int32, delta-coded sorted indices) and ``values`` (fp32 or fp16)."""

    compressible = frozenset({"gaps"})

    def _value_dtype(self) -> torch.dtype:
        return VALUE_DTYPES[str(self.params.get("values", "fp32"))]

    def _pack(self, flat: torch.Tensor, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        indices = torch.sort(indices).values
        values = flat[indices]
        if self._value_dtype() == torch.float16:
            values = values.clamp(-65504.0, 65504.0)
        return {"gaps": _bits.delta_encode(indices), "values": values.to(self._value_dtype())}

    @_cpu.quiet
    def _pack_cpu(self, indices: np.ndarray, values: np.ndarray) -> dict[str, torch.Tensor]:
        """The arrays from sorted indices and their values, in numpy (its diff is ~2.5x torch's)."""
        if self._value_dtype() == torch.float16:
            values = np.clip(values, -65504.0, 65504.0)
        return {
            "gaps": torch.from_numpy(np.diff(indices, prepend=0).astype(np.int32)),
            "values": torch.from_numpy(np.ascontiguousarray(values)).to(self._value_dtype()),
        }

    def _count(self, msg: Message) -> int:
        """Number of kept entries the message must hold."""
        return msg.arrays["gaps"].numel() if "gaps" in msg.arrays else 0

    def _expected(self, msg):
        count = self._count(msg)
        return {"gaps": (torch.int32, (count,)), "values": (self._value_dtype(), (count,))}

    def _check_values(self, msg):
        _bits.check_gaps(msg.arrays["gaps"], msg.numel)

    def _decode(self, msg: Message, device):
        out = torch.zeros(msg.numel, dtype=torch.float32, device=device)
        self.decode_add(msg, out)
        return out

    @_cpu.quiet
    def decode_add(self, msg: Message, out: torch.Tensor, alpha: float = 1.0) -> None:
        indices = _bits.delta_decode(msg.arrays["gaps"].to(out.device))
        values = msg.arrays["values"].to(out.device, torch.float32)
        if out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous():
            # indices are strictly increasing (check_gaps): a plain fancy add is exact, and
            # numpy's is ~1.6x torch's index_add_ here
            if alpha != 1.0:
                values = values * alpha
            target = _cpu.host(out.view(-1))
            target[_cpu.host(indices)] += _cpu.host(values)
            return
        out.view(-1).index_add_(0, indices, values, alpha=alpha)

    def _entry_bytes(self) -> int:
        return 4 + (2 if self._value_dtype() == torch.float16 else 4)
