#!/usr/bin/env python
"""psgrad's codecs against GRACE's torch compressors, same tensors, same process, one thread.

Usage (docs/benchmarks.md, "Against GRACE"):
    git clone https://github.com/sands-lab/grace /tmp/grace
    .venv/bin/python benchmarks/grace-compare.py --grace /tmp/grace [--sizes 4M,16M] [--repeat 5]

GRACE is read from the checkout given, for this measurement only: psgrad neither vendors nor
imports it. For every size and pair of the same method:

1. Make one fp32 gradient (seeded normal; the matrix shape ``psgrad codecs`` uses).
2. Round r = 1..repeat (after one warm-up of each): time psgrad's round trip as the server's hot
   path runs it (encode + wire.dumps, then wire.loads + decode_add into a kept accumulator), then
   GRACE's compress + decompress on the same tensor (GRACE serializes nothing; its time is
   conservative in its favour). Before each timed call a 128 MB buffer is written, so that
   both start with the tensor out of cache (as a layer's gradient is after backward).
3. Report both medians, psgrad's GB/s (dense fp32 bytes / round trip) and the median of the
   per-round ratios GRACE time / psgrad time (> 1: psgrad is faster).
Both libraries share the process, so both run with the malloc setting every psgrad process uses
(freed memory kept, psgrad/runtime/allocator.py; ``PSGRAD_MALLOC=system`` for glibc's defaults).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

from psgrad.bench import codecbench
from psgrad.codecs import make_codec
from psgrad.comm import wire
from psgrad.runtime.allocator import keep_freed_memory

# psgrad spec, GRACE module, GRACE class, constructor arguments
PAIRS = (
    ("fp16", "fp16", "FP16Compressor", ()),
    ("qsgd:levels=16", "qsgd", "QSGDCompressor", (16,)),
    ("terngrad:clip=1", "terngrad", "TernGradCompressor", ()),
    ("sign", "efsignsgd", "EFSignSGDCompressor", (0.1,)),
    ("randomk:ratio=0.01", "randomk", "RandomKCompressor", (0.01,)),
    ("threshold:v=2.5", "threshold", "ThresholdCompressor", (2.5,)),
    ("topk:ratio=0.01", "topk", "TopKCompressor", (0.01,)),
    ("topk:ratio=0.01,approx=1", "dgc", "DgcCompressor", (0.01,)),
)


def _grace(root: Path, module: str, cls: str, args: tuple):
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return getattr(importlib.import_module(f"grace_dl.torch.compressor.{module}"), cls)(*args)


def compare(grace_root: Path, sizes: list[int], repeat: int, only: set[str] | None = None, seed: int = 0) -> list[dict]:
    """Run the pairs on every size; see the module docstring."""
    rows = []
    for size in sizes:
        grad = torch.randn(codecbench.matrix_for(size), generator=torch.Generator().manual_seed(seed))
        dense = grad.numel() * 4
        acc = torch.zeros_like(grad)
        timer = codecbench.ColdTimer()
        for spec, module, cls, args in PAIRS:
            if only and spec.split(":")[0] not in only:
                continue
            codec, grace = make_codec(spec), _grace(grace_root, module, cls, args)

            def ours(codec=codec, grad=grad, acc=acc):
                msg = wire.loads(wire.dumps(codec.encode(grad, seed=seed + 1)))
                codec.decode_add(msg, acc)

            def theirs(grace=grace, grad=grad):
                compressed, ctx = grace.compress(grad, "layer")
                grace.decompress(compressed, ctx)

            ours(), theirs()
            times = [(timer.seconds(ours), timer.seconds(theirs)) for _ in range(repeat)]
            psgrad_s = statistics.median(t[0] for t in times)
            rows.append(
                {
                    "size": size,
                    "psgrad": spec,
                    "grace": cls,
                    "psgrad_ms": 1e3 * psgrad_s,
                    "grace_ms": 1e3 * statistics.median(t[1] for t in times),
                    "psgrad_gbps": dense / psgrad_s / 1e9,
                    "speedup": statistics.median(t[1] / t[0] for t in times),
                }
            )
            print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict) -> str:
    return (
        f"{row['size']:>9d} {row['psgrad']:28s} {row['grace']:22s} {row['psgrad_ms']:9.2f} "
        f"{row['grace_ms']:9.2f} {row['psgrad_gbps']:8.2f} {row['speedup']:8.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grace", type=Path, required=True, help="a checkout of sands-lab/grace")
    parser.add_argument("--sizes", default="4M,16M", help="elements per tensor, comma-separated (K, M suffixes)")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds; medians are reported")
    parser.add_argument(
        "--only", default="", help="psgrad codec names to measure, comma-separated (default: all pairs)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    opts = parser.parse_args()
    if not (opts.grace / "grace_dl" / "torch" / "compressor").is_dir():
        parser.error(f"{opts.grace} is not a checkout of sands-lab/grace (no grace_dl/torch/compressor)")
    torch.set_num_threads(1)
    malloc = keep_freed_memory()
    print(json.dumps({**codecbench.machine(), "malloc": malloc}))
    print(f"{'size':>9s} {'psgrad':28s} {'GRACE':22s} {'psgrad ms':>9s} {'GRACE ms':>9s} {'GB/s':>8s} {'speedup':>9s}")
    rows = compare(
        opts.grace,
        [codecbench.parse_size(s) for s in opts.sizes.split(",")],
        opts.repeat,
        {n for n in opts.only.split(",") if n},
    )
    if opts.json:
        opts.json.write_text(json.dumps({"machine": codecbench.machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
