"""psgrad bench's results: one row per codec or baseline (medians over rounds, speed-ups paired
round by round, the busiest link's bytes), and the table, time-to-accuracy table, JSON and bar
chart made of them."""

from __future__ import annotations

import json
import math
import statistics
import sys
import textwrap
from dataclasses import KW_ONLY, asdict, dataclass, field

from ..comm.protocol import TIME_KEYS
from ..roles import topology_of
from ..runlogs import NAN
from .baselines import BASELINES

BREAKDOWN = TIME_KEYS


@dataclass
class BenchRow:
    """One row of the bench table: a codec (or baseline) and its medians over the rounds."""

    codec: str
    _: KW_ONLY
    it_per_s: float
    it_per_s_spread: float
    speedup: float
    bytes_per_step: float
    bytes_up: float
    bytes_down: float
    compression: float
    runs: int
    hidden_comm_share: float
    server_cpu: float = NAN
    loss: float = NAN
    ideal_it_per_s: float = NAN
    of_ideal: float = NAN
    times: dict[str, float] = field(default_factory=dict)  # BREAKDOWN phase -> seconds per step
    # time to accuracy (--target-accuracy): medians over the rounds that reached it
    target_seconds: float = NAN
    target_steps: float = NAN
    target_mb: float = NAN
    final_acc: float = NAN
    target_rounds: int = 0  # rounds that reached the target
    it_per_s_runs: list[float] = field(default_factory=list)
    # what psgrad measured of the row's accuracy (bench/rows.py measured_accuracy), not this bench
    of_dense: float = NAN
    trails: bool = False


def hidden_share(m: dict) -> float:
    """Share of communication hidden behind compute.

    Communication that was *not* hidden shows up as waiting (push_wait + pull_wait). The time
    communication was in flight while the worker computed is bounded by the backward + forward
    windows it overlaps: hidden = 1 - exposed wait / (exposed wait + overlap window).
    """
    exposed = m["push_wait"] + m["pull_wait"]
    window = m["backward"] + m["forward"]
    return 1.0 - exposed / max(1e-12, exposed + window)


def busiest_link(m: dict, *, topology: str, baseline: bool, servers: int, workers: int) -> float:
    """Bytes per step on the busiest link (one direction of a full-duplex NIC).

    DDP: a worker's own share; a codec row: what its topology says (``Topology.busiest_link``).
    """
    if baseline:
        return m["bytes_up"] / workers
    return topology_of(topology).busiest_link(m, servers, workers)


def _median(ms: list[dict]) -> dict:
    """Each figure's median over an item's rounds."""
    return {k: statistics.median(m[k] for m in ms) for k in ms[0]}


def _paired(ms: list[dict], refs: list[dict], *, t_net: float = 0.0) -> float:
    """Median over rounds of an item's it/s over 1 / max(the reference's step time, t_net) in the
    same round (with t_net = 0: simply over the reference's it/s)."""
    # Divide rather than multiply by 1 / r: an item against itself must come out exactly 1.0.
    return statistics.median(
        m["it_per_s"] / r["it_per_s"] if r["it_per_s"] * t_net <= 1.0 else m["it_per_s"] * t_net
        for m, r in zip(ms, refs, strict=False)
    )


def summarize(
    results: dict[str, list[dict]],
    *,
    servers: int = 1,
    workers: int = 2,
    bandwidth_bits: int | None = None,
    topologies: dict[str, str] | None = None,
) -> list[BenchRow]:
    """One row per item: medians over rounds, speed-up and ratio vs none, ideal vs compute-only.

    ``topologies`` names each codec row's topology (default ps) for its busiest link.
    """

    base = _median(results["none"]) if results.get("none") else None
    compute = _median(results["compute"]) if results.get("compute") else None
    t_compute = 1.0 / compute["it_per_s"] if compute else None
    rows = []
    for item, ms in results.items():
        if not ms:
            continue
        med = _median(ms)
        its = [m["it_per_s"] for m in ms]
        per_step = med["bytes_up"] + med["bytes_down"]
        ideal = of_ideal = NAN
        if t_compute is not None:
            link = busiest_link(
                med,
                topology=(topologies or {}).get(item, "ps"),
                baseline=item.split()[0] in BASELINES,
                servers=servers,
                workers=workers,
            )
            t_net = link * 8 / bandwidth_bits if bandwidth_bits else 0.0
            ideal = 1.0 / max(t_compute, t_net)
            of_ideal = _paired(ms, results["compute"], t_net=t_net)
        head = item.split()[0] if item.split() else item
        rows.append(
            BenchRow(
                item,
                it_per_s=med["it_per_s"],
                it_per_s_spread=(max(its) - min(its)) / 2,
                speedup=_paired(ms, results["none"]) if base else NAN,
                bytes_per_step=per_step,
                bytes_up=med["bytes_up"],
                bytes_down=med["bytes_down"],
                compression=(base["bytes_up"] + base["bytes_down"]) / per_step if base and per_step else NAN,
                runs=len(ms),
                hidden_comm_share=NAN if head in BASELINES else hidden_share(med),
                server_cpu=med.get("server_cpu", NAN),
                loss=med.get("loss", NAN),
                ideal_it_per_s=ideal,
                of_ideal=of_ideal,
                times={k: med.get(k, 0.0) for k in BREAKDOWN},
                **_target_medians(ms),
                it_per_s_runs=its,
            )
        )
    return rows


def target_note(m: dict, target: float | None) -> str:
    """The launcher's line after a row's job: its final accuracy and when it reached ``target``."""
    if not target or "final_acc" not in m:
        return ""
    reached = m["target_steps"] == m["target_steps"]
    where = (
        f"{target:.3f} at step {m['target_steps']}, {m['target_seconds']:.1f} s"
        if reached
        else f"{target:.3f} not reached"
    )
    return f", test accuracy {m['final_acc']:.3f} ({where})"


def _target_medians(ms: list[dict]) -> dict:
    """Median time/steps/bytes to target over the rounds that reached it, and the final accuracy."""
    if not any("final_acc" in m for m in ms):
        return {}
    reached = [m for m in ms if m["target_steps"] == m["target_steps"]]
    out = {"final_acc": statistics.median(m["final_acc"] for m in ms), "target_rounds": len(reached)}
    for key in ("target_seconds", "target_steps", "target_mb"):
        out[key] = statistics.median(m[key] for m in reached) if reached else NAN
    return out


def target_table(rows: list[BenchRow], target: float) -> str:
    """Rows by seconds to ``target`` test accuracy, fastest first; rows that never reached it last."""
    ranked = sorted(rows, key=lambda r: (r.target_seconds != r.target_seconds, r.target_seconds, r.codec))
    width = max([30, *(len(r.codec) for r in rows)])
    head = (
        f"{'row':{width}s} {'s to target':>11s} {'steps':>7s} {'MB':>9s} {'final acc':>9s} {'reached':>8s} {'it/s':>7s}"
    )
    lines = [
        f"time to test accuracy {target:.3f} (training seconds; evaluation pauses excluded)",
        head,
        "-" * len(head),
    ]
    for r in ranked:
        if r.final_acc != r.final_acc:
            lines.append(f"{r.codec:{width}s} {'-':>11s} {'-':>7s} {'-':>9s} {'-':>9s} {'-':>8s} {r.it_per_s:7.2f}")
            continue
        reached = f"{r.target_rounds}/{r.runs}"
        lines.append(
            f"{r.codec:{width}s} {_num(r.target_seconds, 11, 1)} {_num(r.target_steps, 7, 0)} {_num(r.target_mb, 9, 1)} "
            f"{r.final_acc:9.3f} {reached:>8s} {r.it_per_s:7.2f}"
        )
    lines.append(
        "'-' in seconds: never reached in any round; compute-only rows train no single model and are not evaluated"
    )
    return "\n".join(lines)


def _num(value: float, width: int, digits: int) -> str:
    return f"{'-':>{width}s}" if value != value or math.isinf(value) else f"{value:{width}.{digits}f}"


LEGEND = {
    "it/s": "training steps per second, evaluation pauses excluded (median over rounds); ± = half the spread between rounds",
    "speedup": "it/s over the `none` row's, paired per round (median of the per-round ratios)",
    "of ideal": "it/s over the ideal rate: the compute-only rate, or the busiest link's bytes at --bandwidth if slower",
    "MB/step": "bytes sent per step by all ranks",
    "ratio": "dense gradient bytes over the bytes sent",
    "loss": "training loss at the last step",
    "acc": "test accuracy at equal epochs over dense's, the lowest over the datasets psgrad measured the row's "
    'combination on (docs/benchmarks.md, "Which codec learns"; not measured by this bench); ! trails dense, '
    "? never measured",
}

WIDE_LEGEND = {
    "hidden": "share of communication hidden behind compute",
    "srv cpu": "server CPU seconds per second",
    "ideal": "the ideal rate, it/s",
}


def _accuracy(r: BenchRow) -> str:
    """The ``acc`` column: rounded down (under the bar never reads as the bar), ``!`` when it
    trails dense, ``?`` never measured, ``-`` for compute-only, which learns nothing."""
    from ..accuracy import marked  # loads the codecs: not for the bench's --help

    if r.of_dense == r.of_dense:
        return marked(r.of_dense, trails=r.trails)
    return "-" if r.codec.split()[0] == "compute" else "?"


def table(rows: list[BenchRow], wide: bool = False) -> str:
    """The it/s table: by default the columns that rank configurations (it/s, speed-up, share of
    the ideal rate, bytes, loss, and the accuracy psgrad measured of each row); ``wide`` adds
    overlap, server CPU, the ideal rate and the per-step time breakdown. A legend of the columns
    follows."""
    width = max([30, *(len(r.codec) for r in rows)])
    head = (
        f"{'codec':{width}s} {'it/s':>7s} {'±':>5s} {'speedup':>7s} {'of ideal':>8s} {'MB/step':>8s} {'ratio':>7s} "
        f"{'loss':>8s} {'acc':>6s}"
    )
    if wide:
        head += f" {'hidden':>6s} {'srv cpu':>7s} {'ideal':>6s} " + " ".join(f"{k[:8]:>8s}" for k in BREAKDOWN)
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (
            f"{r.codec:{width}s} {r.it_per_s:7.2f} {r.it_per_s_spread:5.2f} {_num(r.speedup, 7, 2)} "
            f"{_num(r.of_ideal, 8, 2)} {r.bytes_per_step / 1e6:8.3f} {_num(r.compression, 7, 1)} {_num(r.loss, 8, 3)} "
            f"{_accuracy(r):>6s}"
        )
        if wide:
            line += (
                f" {_num(r.hidden_comm_share, 6, 2)} {_num(r.server_cpu, 7, 2)} {_num(r.ideal_it_per_s, 6, 2)} "
                + " ".join(f"{r.times.get(k, 0.0) * 1e3:8.1f}" for k in BREAKDOWN)
            )
        lines.append(line)
    lines += [f"  {k}: {text}" for k, text in (LEGEND | (WIDE_LEGEND if wide else {})).items()]
    lines.append("  '-': not applicable to the row (a baseline has no codec bytes, no `none` row to pair with, ...)")
    if wide:
        lines.append(f"  {' '.join(BREAKDOWN)}: ms per step, mean over workers")
    else:
        lines.append("  --wide adds overlap, server CPU, the ideal rate and the time breakdown per step")
    return "\n".join(lines)


def as_json(rows: list[BenchRow]) -> list[dict]:
    """Rows as plain objects; NaN (not applicable) becomes null."""
    return [{k: (None if isinstance(v, float) and v != v else v) for k, v in asdict(r).items()} for r in rows]


def plot_bars(rows: list[BenchRow], path: str, title: str = "") -> None:
    """Horizontal bars of it/s (± half the spread), one row per item, labels readable at any length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.codec for r in rows][::-1]
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.4 * len(rows)))
    ax.barh(labels, [r.it_per_s for r in rows][::-1], xerr=[r.it_per_s_spread for r in rows][::-1])
    ax.set_xlabel("it/s")
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(
    rows: list[BenchRow],
    header: str,
    *,
    json_path: str | None = None,
    plot_path: str | None = None,
    out=sys.stdout,
    target: float | None = None,
    wide: bool = False,
) -> None:
    print(header, file=sys.stderr)
    if target:
        print(target_table(rows, target) + "\n", file=out)
    print(table(rows, wide), file=out)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(as_json(rows), f, indent=1)
    if plot_path:
        plot_bars(rows, plot_path, header)
