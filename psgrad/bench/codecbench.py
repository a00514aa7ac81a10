"""Codec report: bytes on the wire and encode/decode throughput, against a memcpy yardstick.

1. Make one fp32 gradient of ``size`` elements (a square-ish matrix, so svd has work to do).
2. For each codec, time encode + ``wire.dumps`` and ``wire.loads`` + ``decode_add`` (the server's
   hot path) ``repeat`` times after one warm-up, and keep the median.
3. Time a copy of the same fp32 bytes into a kept buffer (a plain memcpy) in the same run: every
   throughput is also reported as a ratio to it, because absolute numbers on shared machines drift.

The codecs draw their randomness from ``seed + 1``: a gradient and a codec drawn from one stream
would be correlated, and a random codec's output would compress better than it does on real data.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..codecs import make_codec
from ..comm import wire

DEFAULT_SPECS = (
    "none",
    "fp16",
    "topk:ratio=0.01",
    "topk:ratio=0.01,approx=1",
    "randomk:ratio=0.01",
    "threshold:v=2.5",
    "terngrad",
    "qsgd:levels=16",
    "qsgd:levels=4",
    "sign",
    "svd:rank=2",
)


@dataclass
class CodecRow:
    codec: str
    wire_bytes: int
    dense_bytes: int
    ratio: float
    bits_per_element: float
    encode_gbps: float
    decode_gbps: float
    roundtrip_gbps: float
    memcpy_gbps: float


def _median_seconds(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matrix_for(size: int) -> tuple[int, int]:
    rows = 2 ** (int(math.log2(max(1, size))) // 2)
    return rows, max(1, size // rows)


def run(specs: tuple[str, ...] = DEFAULT_SPECS, size: int = 1 << 20, repeat: int = 5, seed: int = 0) -> list[CodecRow]:
    """Measure every codec in ``specs`` on one gradient; see the module docstring."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(matrix_for(size), generator=gen)
    dense = grad.numel() * 4
    copy = torch.empty_like(grad)
    memcpy = dense / _median_seconds(lambda: copy.copy_(grad), repeat) / 1e9
    seed += 1
    rows = []
    for spec in specs:
        codec = make_codec(spec)
        buf = wire.dumps(codec.encode(grad, seed=seed))
        acc = torch.zeros_like(grad)
        encode = _median_seconds(lambda codec=codec: wire.dumps(codec.encode(grad, seed=seed)), repeat)
        decode = _median_seconds(lambda codec=codec, buf=buf, acc=acc: codec.decode_add(wire.loads(buf), acc), repeat)
        rows.append(
            CodecRow(
                codec=codec.spec,
                wire_bytes=len(buf),
                dense_bytes=dense,
                ratio=dense / len(buf),
                bits_per_element=8 * len(buf) / grad.numel(),
                encode_gbps=dense / encode / 1e9,
                decode_gbps=dense / decode / 1e9,
                roundtrip_gbps=dense / (encode + decode) / 1e9,
                memcpy_gbps=memcpy,
            )
        )
    return rows


def machine() -> dict[str, str | int]:
    """What the figures were measured on."""
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def table(rows: list[CodecRow]) -> str:
    head = f"{'codec':40s} {'bytes':>10s} {'ratio':>7s} {'bits/el':>7s} {'enc GB/s':>9s} {'dec GB/s':>9s} {'rt GB/s':>8s} {'rt/memcpy':>9s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.codec:40s} {r.wire_bytes:10d} {r.ratio:7.1f} {r.bits_per_element:7.3f} "
            f"{r.encode_gbps:9.2f} {r.decode_gbps:9.2f} {r.roundtrip_gbps:8.2f} {r.roundtrip_gbps / r.memcpy_gbps:9.4f}"
        )
    if rows:
        lines.append(f"memcpy of the same fp32 bytes: {rows[0].memcpy_gbps:.2f} GB/s")
    return "\n".join(lines)


def as_dicts(rows: list[CodecRow]) -> list[dict]:
    return [asdict(r) for r in rows]
