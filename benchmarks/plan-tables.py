"""The cost model's tables past this machine (docs/planning.md): WRN-28-10 on CIFAR-100 and a
1.2 B-parameter transformer, at 16 to 1,024 workers on three kinds of link, for DDP, DDP with
torch's PowerSGD hook and psgrad's colocated PowerSGD with and without local steps.

Compute times are modelled, not measured: 6 x parameters x tokens for the transformer (the
usual estimate of a training step's FLOPs) and 3 x forward FLOPs for WRN-28-10 (5.25 GFLOPs an
image), on an A100 at an assumed 40 % of its 312 TFLOPS bf16 peak; codecs code at an assumed
200 GB/s on the GPU.

Usage: python benchmarks/plan-tables.py   (prints the markdown tables)
"""

import argparse
import math

from psgrad.models import build_model
from psgrad.plan import Scenario, plan

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

A100 = 312e12 * 0.40
WRN = [tuple(p.shape) for p in build_model("wrn", 100, depth=28, widen_factor=10).parameters()]
WRN_STEP = 3 * 5.25e9 * 128 / A100  # batch 128 per GPU
D, LAYERS, VOCAB, TOKENS = 2048, 24, 50_304, 8 * 2048
GPT = [(D, D)] * 4 * LAYERS + [(4 * D, D), (D, 4 * D)] * LAYERS + [(VOCAB, D), (13 * D * LAYERS,)]
GPT_STEP = 6 * sum(math.prod(shape) for shape in GPT) * TOKENS / A100
LINKS = (("100 Gbit/s, 0.1 ms", 100e9, 1e-4), ("10 Gbit/s, 1 ms", 10e9, 1e-3), ("1 Gbit/s, 100 ms", 1e9, 0.1))
CONFIGS = (
    ("DDP (ring all-reduce)", dict(topology="ddp")),
    ("DDP + PowerSGD hook, rank 4", dict(topology="ddp-powersgd", codec="powersgd:rank=4")),
    ("psgrad colocated, PowerSGD rank 8", dict(topology="colocated", codec="powersgd:rank=8")),
    ("... with 32 local steps", dict(topology="colocated", codec="powersgd:rank=8", local_steps=32)),
    ("... overlapped", dict(topology="colocated", codec="powersgd:rank=8", local_steps=32, overlap_exchange=True)),
)
WORKERS = (16, 64, 256, 1024)


def table(name: str, shapes, step: float) -> None:
    params = sum(math.prod(shape) for shape in shapes)
    print(f"**{name}** ({params / 1e6:,.0f} M parameters, compute {step * 1e3:.0f} ms a step, modelled):\n")
    print("| configuration | link | " + " | ".join(f"N = {n}" for n in WORKERS) + " |")
    print("|---|---|" + "---|" * len(WORKERS))
    for label, options in CONFIGS:
        for link, rate, rtt in LINKS:
            cells = []
            for n in WORKERS:
                scenario = Scenario(
                    shapes=shapes, workers=n, bandwidth_bps=rate, rtt_s=rtt, compute_s=step, code_gbps=200.0, **options
                )
                result = plan(scenario)
                limit = f" ({result.bottleneck})" if result.utilisation < 0.9 else ""
                cells.append(f"{result.utilisation:.2f}{limit}")
            print(f"| {label} | {link} | " + " | ".join(cells) + " |")
    print()


table("WRN-28-10, CIFAR-100, batch 128 a GPU", WRN, WRN_STEP)
table("Transformer, width 2048, 24 layers, 8 x 2048 tokens a GPU", GPT, GPT_STEP)
