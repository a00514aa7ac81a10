"""The cost model (psgrad/plan.py) against the shaped runs of docs/benchmarks.md: each row's
measured x compute-only beside the model's prediction (docs/planning.md, "How well it predicts").

WRN-16-4, batch 16, 2 ranks; the measured figures are those of "Slow links" (compute-only 2.24
it/s in the 10 Mbit/s run, 2.49 in the 1 Mbit/s run, one round of DDP's row there) and
"Throughput on a 100 Mbit/s link" (compute-only 4.82 it/s, the mean of its two runs). Then
ResNet-20, batch 8, at 2, 4 and 8 workers on 10 Mbit/s links: "One server or colocated"
(`sudo bash benchmarks/bench-scaling.sh`), its ms a step and compute-only of each worker count.
The overlapped rows are from paired runs on an AMD EPYC VM with the run's last step (which settles
every exchange in flight) left out of the rate, two rounds each: compute-only 2.65 it/s at 1 Mbit/s
and 2.70 at 10 Mbit/s, 2.72 in the run of four fragments by 16 steps (`psgrad bench ... --steps 128 --warmup-steps 32 --repeat 2 --bandwidth 10mbit`).
Every cell is predicted with this machine's fan-in efficiency (plan.FAN_IN_EFFICIENCY). Where N
ranks share the 2 cores, each rank's own CPU work a layer (plan.own_layer_overhead_s) slows as
its compute does: it is scaled by the compute-only step of N workers over that of 2.

Last, two link-bound ResNet-20 cells from the EPYC VM, the runs that showed the link moving
during psgrad's own work as well as during compute (plan.py, module docstring, 6):
`psgrad bench --model resnet20 --batch-size 8 --steps 32 --warmup-steps 4 --repeat 2 --bandwidth 10mbit
--codecs "powersgd:rank=2 --topology colocated;qsgd:levels=16 --feedback ef --down-codec qsgd:levels=16
--topology colocated" --baselines compute`.

Usage: python benchmarks/plan-validation.py
"""

import argparse
import dataclasses

from psgrad.models import build_model
from psgrad.plan import FAN_IN_EFFICIENCY, Scenario, own_layer_overhead_s, plan

argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

SHAPES = [tuple(p.shape) for p in build_model("wrn", 100, depth=16, widen_factor=4).parameters()]
PSGD8_H32 = dict(codec="powersgd:rank=8", topology="colocated", local_steps=32)
Q16_H32 = dict(codec="qsgd:levels=16", topology="colocated", local_steps=32)
Q16_BOTH_H32 = {**Q16_H32, "down_codec": "qsgd:levels=16"}
Q16_Q64_H32 = {**Q16_H32, "down_codec": "qsgd:levels=64"}
P2 = dict(codec="powersgd:rank=2", topology="colocated")
DDP_P2 = dict(codec="powersgd:rank=2", topology="ddp-powersgd")
TEN = 1 / 2.24  # compute-only step, s, of the 10 Mbit/s run
ONE = 1 / 2.49  # ... of the 1 Mbit/s run
FAST = 1 / 4.82  # ... of the 100 Mbit/s runs
OVERLAPPED = 1 / 2.65  # ... of the 1 Mbit/s run of the overlapped rows
EPYC = 1 / 2.70  # ... of the 10 Mbit/s run of the overlapped rows
CELLS = (  # (row, options, bandwidth, compute-only step, measured x compute-only)
    (
        "powersgd:rank=8 colocated, 32 local steps, overlapped",
        {**PSGD8_H32, "overlap_exchange": True},
        10e6,
        EPYC,
        1.00,
    ),
    ("same", {**PSGD8_H32, "overlap_exchange": True}, 1e6, OVERLAPPED, 0.97),
    ("powersgd:rank=8 colocated, 32 local steps", PSGD8_H32, 10e6, TEN, 0.90),
    ("same", PSGD8_H32, 1e6, ONE, 0.64),
    (
        "qsgd:levels=16 both ways, 32 local steps, overlapped",
        {**Q16_BOTH_H32, "overlap_exchange": True},
        10e6,
        EPYC,
        1.00,
    ),
    ("same", {**Q16_BOTH_H32, "overlap_exchange": True}, 1e6, OVERLAPPED, 1.01),
    ("qsgd:levels=16 both ways, 32 local steps", Q16_BOTH_H32, 10e6, TEN, 0.99),
    ("same", Q16_BOTH_H32, 1e6, ONE, 0.57),
    ("qsgd:levels=16 up, qsgd:levels=64 down, 32 local steps", Q16_Q64_H32, 10e6, TEN, 0.86),
    ("same", Q16_Q64_H32, 1e6, ONE, 0.51),
    (
        "qsgd:levels=16 up, qsgd:levels=64 down, 8 local steps, overlapped by 4",
        {**Q16_Q64_H32, "local_steps": 8, "overlap_exchange": True, "overlap_steps": 4},
        10e6,
        EPYC,
        0.98,
    ),
    (
        "qsgd:levels=16 up, qsgd:levels=64 down, 32 local steps, overlapped by 8",
        {**Q16_Q64_H32, "overlap_exchange": True, "overlap_steps": 8},
        1e6,
        OVERLAPPED,
        0.60,
    ),
    (
        "the same in 4 fragments",
        {**Q16_Q64_H32, "overlap_exchange": True, "overlap_steps": 8, "fragments": 4},
        1e6,
        OVERLAPPED,
        0.74,
    ),
    (
        "the same, each fragment by 16",
        {**Q16_Q64_H32, "overlap_exchange": True, "overlap_steps": 16, "fragments": 4},
        1e6,
        1 / 2.72,
        1.00,
    ),
    ("qsgd:levels=16 up, dense down, 32 local steps", Q16_H32, 10e6, TEN, 0.68),
    ("none colocated, 32 local steps", dict(topology="colocated", local_steps=32), 10e6, TEN, 0.59),
    ("powersgd:rank=2 colocated", P2, 10e6, TEN, 0.82),
    ("same (fitted)", P2, 1e6, ONE, 0.28),
    ("DDP + PowerSGD hook, rank 2", DDP_P2, 10e6, TEN, 0.71),
    ("same", DDP_P2, 1e6, ONE, 0.23),
    ("powersgd:rank=8 colocated", dict(codec="powersgd:rank=8", topology="colocated"), 100e6, FAST, 0.916),
    ("powersgd:rank=2 colocated", P2, 100e6, FAST, 0.937),
    ("sign EF both ways, colocated", dict(codec="sign", down_codec="sign", topology="colocated"), 100e6, FAST, 0.938),
    (
        "sign:bucket=32 EF + qsgd:levels=16 down, colocated",
        dict(codec="sign:bucket=32", down_codec="qsgd:levels=16", topology="colocated"),
        100e6,
        FAST,
        0.876,
    ),
    ("DDP + PowerSGD hook, rank 2", DDP_P2, 100e6, FAST, 0.886),
    ("dense colocated", dict(topology="colocated"), 100e6, FAST, 0.91 / 4.82),
    ("dense DDP", dict(topology="ddp"), 100e6, FAST, 0.96 / 4.82),
    ("dense, 1 server + 2 workers", dict(topology="ps"), 100e6, FAST, 0.39 / 4.82),
)

RESNET20 = [tuple(p.shape) for p in build_model("resnet20", 100).parameters()]
SIGN = dict(codec="sign", down_codec="sign")
SCALING = {  # workers: compute-only ms, then ms a step of none 1 server, colocated; sign EF both ways the same
    2: (30.6, 2467.6, 999.7, 79.7, 48.9),
    4: (64.2, 4972.4, 1757.9, 189.7, 105.4),
    8: (130.9, 9953.8, 2741.0, 445.1, 226.9),
}
SCALED = [  # (row, options, workers, compute-only step, measured x compute-only)
    (f"ResNet-20 {name}, {n} workers", options, n, ms[0] / 1e3, ms[0] / ms[i])
    for n, ms in SCALING.items()
    for i, (name, options) in enumerate(
        [
            ("none, 1 server", dict(topology="ps")),
            ("none colocated", dict(topology="colocated")),
            ("sign EF both ways, 1 server", dict(topology="ps", **SIGN)),
            ("sign EF both ways, colocated", dict(topology="colocated", **SIGN)),
        ],
        start=1,
    )
]


LINK_BOUND = [  # ResNet-20, 2 workers, 10 Mbit/s, compute-only 34.67 it/s
    ("ResNet-20 powersgd:rank=2 colocated, 2 workers", dict(codec="powersgd:rank=2"), 16.90 / 34.67),
    (
        "ResNet-20 qsgd:levels=16 EF both ways, colocated",
        dict(codec="qsgd:levels=16", down_codec="qsgd:levels=16"),
        11.44 / 34.67,
    ),
]


def show(row: str, scenario: Scenario, measured: float) -> None:
    predicted = plan(scenario).utilisation
    print(
        f"{row:55s} {scenario.bandwidth_bps / 1e6:5.0f} Mbit/s  measured {measured:.3f}  predicted {predicted:.3f}  "
        f"{predicted / measured - 1:+.0%}"
    )


for row, options, rate, step, measured in CELLS:
    show(
        row,
        Scenario(
            shapes=SHAPES, workers=2, bandwidth_bps=rate, compute_s=step, fan_in_efficiency=FAN_IN_EFFICIENCY, **options
        ),
        measured,
    )
for row, options, workers, step, measured in SCALED:
    scenario = Scenario(
        shapes=RESNET20,
        workers=workers,
        bandwidth_bps=10e6,
        compute_s=step,
        fan_in_efficiency=FAN_IN_EFFICIENCY,
        **options,
    )
    shared = step / (SCALING[2][0] / 1e3)  # N ranks on 2 cores: each rank's CPU work slows alike
    show(row, dataclasses.replace(scenario, layer_overhead_s=own_layer_overhead_s(scenario) * shared), measured)
for row, options, measured in LINK_BOUND:
    run = dict(shapes=RESNET20, workers=2, bandwidth_bps=10e6, compute_s=1 / 34.67, topology="colocated")
    show(row, Scenario(**run, fan_in_efficiency=FAN_IN_EFFICIENCY, **options), measured)
