"""Codec report: bytes on the wire and encode/decode throughput, against a memcpy yardstick.

1. Make the fp32 gradients to code: one square-ish matrix per size (so svd has work to do), or
   one tensor per parameter of a model (``run_model``: the layers of the model it trains).
2. For each codec, time encode + ``wire.dumps`` and ``wire.loads`` + ``decode_add`` (the server's
   hot path) over those tensors, ``repeat`` times after one warm-up, and keep the medians.
   Before every timed call a buffer larger than the last-level cache is written: each call
   starts with the gradient in memory, not in cache (4 M fp32 elements would fit a 32 MB L3 and
   flatter any codec that reads them twice).
3. Time a copy of the same fp32 bytes into kept buffers (a plain memcpy), cold in the same way:
   every throughput is also reported as a ratio to it, because absolute numbers on shared
   machines drift.

The codecs draw their randomness from ``seed + 1``: a gradient and a codec drawn from one stream
would be correlated, and a random codec's output would compress better than it does on real data.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from ..codecs import kernels_name, make_codec
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
    "powersgd:rank=2",
)


DEFAULT_SIZES = (1 << 18, 1 << 22, 1 << 24)
"""256 K, 4 M and 16 M elements: a small layer, one that fits a 32 MB L3, and one that does not
(WRN-28-10's largest convolution holds 640 x 640 x 9 = 3.7 M)."""
_EVICT_ELEMENTS = 1 << 25  # 128 MB of fp32, more than any last-level cache measured here


@dataclass
class CodecRow:
    codec: str
    size: int
    tensors: int
    wire_bytes: int
    dense_bytes: int
    ratio: float
    bits_per_element: float
    encode_gbps: float
    decode_gbps: float
    roundtrip_gbps: float
    memcpy_gbps: float


class ColdTimer:
    """Median seconds of a call, each run starting with cold caches (see the module docstring)."""

    def __init__(self) -> None:
        self._evict = torch.empty(_EVICT_ELEMENTS)

    def seconds(self, fn: Callable[[], object]) -> float:
        """One timed call of ``fn`` after evicting the caches."""
        self._evict.fill_(1.0)
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def median(self, fn: Callable[[], object], repeat: int) -> float:
        fn()
        return statistics.median(self.seconds(fn) for _ in range(repeat))


def matrix_for(size: int) -> tuple[int, int]:
    rows = 2 ** (int(math.log2(max(1, size))) // 2)
    return rows, max(1, size // rows)


def parse_size(text: str) -> int:
    """``"4M"`` -> 4,194,304; K and M are powers of two, plain numbers are elements."""
    units = {"K": 1 << 10, "M": 1 << 20}
    clean = text.strip().upper()
    number, unit = (clean[:-1], units[clean[-1]]) if clean[-1:] in units else (clean, 1)
    if not number.isdigit() or int(number) < 1:
        raise ValueError(f"expected a size like 262144, 256K or 4M, got {text!r}")
    if int(number) * unit > wire.MAX_ELEMENTS:
        raise ValueError(f"{text!r} is more than {wire.MAX_ELEMENTS:,} elements, the most one message may carry")
    return int(number) * unit


def run(
    specs: Sequence[str] = DEFAULT_SPECS, sizes: Sequence[int] = DEFAULT_SIZES, repeat: int = 5, seed: int = 0
) -> list[CodecRow]:
    """Measure every codec in ``specs`` on one gradient of each size; see the module docstring."""
    rows = []
    for size in sizes:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        rows += _measure(specs, [matrix_for(size)], repeat, seed)
    return rows


def run_model(
    specs: Sequence[str], shapes: Sequence[tuple[int, ...]], repeat: int = 5, seed: int = 0
) -> list[CodecRow]:
    """Measure every codec over a model's layers (``shapes``), each coded as its own message:
    one row per codec, its figures for the whole gradient of one step."""
    return _measure(specs, list(shapes), repeat, seed)


def _measure(specs: Sequence[str], shapes: list[tuple[int, ...]], repeat: int, seed: int) -> list[CodecRow]:
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(shape, generator=gen) for shape in shapes]
    accumulators = [torch.zeros_like(g) for g in grads]
    copies = [torch.empty_like(g) for g in grads]
    numel = sum(g.numel() for g in grads)
    dense = numel * 4
    timer = ColdTimer()
    memcpy = dense / timer.median(lambda: [c.copy_(g) for c, g in zip(copies, grads, strict=True)], repeat) / 1e9
    seed += 1
    rows = []
    for spec in specs:
        codec = make_codec(spec)
        buffers = [wire.dumps(codec.encode(g, seed=seed)) for g in grads]

        def encode(codec=codec):
            return [wire.dumps(codec.encode(g, seed=seed)) for g in grads]

        def decode(codec=codec, buffers=buffers):
            for buf, acc in zip(buffers, accumulators, strict=True):
                codec.decode_add(wire.loads(buf), acc)

        encode_s, decode_s = timer.median(encode, repeat), timer.median(decode, repeat)
        wire_bytes = sum(len(b) for b in buffers)
        rows.append(
            CodecRow(
                codec=codec.spec,
                size=numel,
                tensors=len(grads),
                wire_bytes=wire_bytes,
                dense_bytes=dense,
                ratio=dense / wire_bytes,
                bits_per_element=8 * wire_bytes / numel,
                encode_gbps=dense / encode_s / 1e9,
                decode_gbps=dense / decode_s / 1e9,
                roundtrip_gbps=dense / (encode_s + decode_s) / 1e9,
                memcpy_gbps=memcpy,
            )
        )
    return rows


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine() -> dict[str, str | int]:
    """What the figures were measured on."""
    return {
        "machine": platform.machine(),
        "processor": cpu_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "kernels": kernels_name(),
    }


ACCURACY_LEGEND = (
    "acc: the best test accuracy at equal epochs over dense's that psgrad measured with the codec (any feedback "
    "and down-link, a gradient every step; the lowest over the datasets measured, "
    'docs/benchmarks.md, "Which codec learns"); ! even the best trails dense, ? never measured: psgrad bench '
    "and psgrad plan give a combination's own"
)


def _accuracy(spec: str) -> str:
    """The ``acc`` column (``ACCURACY_LEGEND``), rounded down: under the bar never reads as the bar."""
    from ..accuracy import best_measured, marked

    if spec == "none":
        return "1.00"
    best = best_measured(spec)
    return "?" if best is None else marked(best.lowest, trails=best.trails)


def table(rows: list[CodecRow]) -> str:
    """One table per gradient size (or model), each under a line with its size and memcpy rate;
    ``ACCURACY_LEGEND`` says what its last column is."""
    width = max([40, *(len(r.codec) for r in rows)])  # a long spec widens the column, never shifts a row
    head = (
        f"{'codec':{width}s} {'bytes':>10s} {'ratio':>7s} {'bits/el':>7s} {'enc GB/s':>9s} {'dec GB/s':>9s} "
        f"{'rt GB/s':>8s} {'rt/memcpy':>9s} {'acc':>5s}"
    )
    lines: list[str] = []
    for (size, tensors), group in _groups(rows):
        what = f"{size:,} fp32 elements ({4 * size / 1e6:.1f} MB)" + (f" in {tensors} tensors" if tensors > 1 else "")
        lines += ["", f"{what}; memcpy of the same bytes {group[0].memcpy_gbps:.2f} GB/s", head, "-" * len(head)]
        for r in group:
            lines.append(
                f"{r.codec:{width}s} {r.wire_bytes:10d} {r.ratio:7.1f} {r.bits_per_element:7.3f} "
                f"{r.encode_gbps:9.2f} {r.decode_gbps:9.2f} {r.roundtrip_gbps:8.2f} {r.roundtrip_gbps / r.memcpy_gbps:9.4f} "
                f"{_accuracy(r.codec):>5s}"
            )
    return "\n".join(lines[1:])


def _groups(rows: list[CodecRow]) -> list[tuple[tuple[int, int], list[CodecRow]]]:
    groups: dict[tuple[int, int], list[CodecRow]] = {}
    for row in rows:
        groups.setdefault((row.size, row.tensors), []).append(row)
    return list(groups.items())


def as_dicts(rows: list[CodecRow]) -> list[dict]:
    return [asdict(r) for r in rows]
