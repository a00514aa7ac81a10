"""``psgrad bench``: the same training for each codec (and baseline), one table of it/s and bytes.

1. Under one ``mpiexec``, run ``steps`` training steps per codec with the same model, batch and
   data; the first ``warmup`` steps are excluded from every figure.
2. With ``repeat`` R, the codecs run R rounds interleaved (none, a, b, none, a, b, ...) so drift of a
   shared machine hits all of them alike; the median and spread are reported.
3. it/s speed-up is against the ``none`` codec measured in the same invocation.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass, replace

from .config import RunConfig
from .train import run
from .transport import Transport

BREAKDOWN = ("forward", "backward", "encode", "push_wait", "pull_wait", "decode", "apply")


@dataclass
class BenchRow:
    codec: str
    it_per_s: float
    it_per_s_spread: float
    speedup: float
    bytes_per_step: float
    bytes_up: float
    bytes_down: float
    compression: float
    runs: int
    hidden_comm_share: float
    forward: float = 0.0
    backward: float = 0.0
    encode: float = 0.0
    push_wait: float = 0.0
    pull_wait: float = 0.0
    decode: float = 0.0
    apply: float = 0.0


def _measure(rows: list[dict], warmup: int) -> dict:
    tail = rows[warmup:] or rows
    wall = [r["wall"] for r in tail]
    # wall-clock rate between the first and last measured step (not the sum of per-step times,
    # which would miss time spent between steps)
    out = {"it_per_s": (len(wall) - 1) / (wall[-1] - wall[0]) if len(wall) > 1 else 1.0 / tail[0]["step_time"]}
    for key in ("bytes_up", "bytes_down", *BREAKDOWN):
        out[key] = statistics.fmean(r[key] for r in tail)
    return out


def hidden_share(m: dict) -> float:
    """Share of communication hidden behind compute.

    Communication that was *not* hidden shows up as waiting (push_wait + pull_wait). The time
    communication was in flight while the worker computed is bounded by the backward + forward
    windows it overlaps; hidden = 1 - exposed wait / (exposed wait + overlap window), where the
    window counts only when bytes were actually sent.
    """
    exposed = m["push_wait"] + m["pull_wait"]
    window = m["backward"] + m["forward"]
    return 1.0 - exposed / max(1e-12, exposed + window)


def run_codecs(cfg: RunConfig, specs: list[str], steps: int, warmup: int, repeat: int) -> list[BenchRow]:
    """Every rank calls this; rank 0 returns the rows."""
    results: dict[str, list[dict]] = {s: [] for s in specs}
    for _ in range(repeat):
        for spec in specs:
            result = run(replace(cfg, codec=spec, steps=steps + warmup, eval_every=0, progress=False, log_dir=None))
            if result.rank == 0:
                results[spec].append(_measure(result.rows, warmup))
    if Transport().rank != 0:
        return []
    base = statistics.median(m["it_per_s"] for m in results.get("none", [])) if "none" in results else None
    dense = None
    rows = []
    for spec in specs:
        ms = results[spec]
        its = [m["it_per_s"] for m in ms]
        med = {k: statistics.median(m[k] for m in ms) for k in ms[0]}
        per_step = med["bytes_up"] + med["bytes_down"]
        if spec == "none":
            dense = per_step
        rows.append(
            BenchRow(
                spec,
                med["it_per_s"],
                (max(its) - min(its)) / 2,
                med["it_per_s"] / base if base else float("nan"),
                per_step,
                med["bytes_up"],
                med["bytes_down"],
                (dense or per_step) / per_step if dense else float("nan"),
                len(ms),
                hidden_share(med),
                **{k: med[k] for k in BREAKDOWN},
            )
        )
    return rows


def table(rows: list[BenchRow]) -> str:
    head = (
        f"{'codec':34s} {'it/s':>7s} {'±':>5s} {'speedup':>7s} {'MB/step':>8s} {'ratio':>7s} {'hidden':>6s} "
        + " ".join(f"{k[:8]:>8s}" for k in BREAKDOWN)
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.codec:34s} {r.it_per_s:7.2f} {r.it_per_s_spread:5.2f} {r.speedup:7.2f} {r.bytes_per_step / 1e6:8.3f} {r.compression:7.1f} {r.hidden_comm_share:6.2f} "
            + " ".join(f"{getattr(r, k) * 1e3:8.1f}" for k in BREAKDOWN)
        )
    lines.append("times in ms per step (mean over workers); MB/step = bytes up + down summed over workers")
    return "\n".join(lines)


def as_json(rows: list[BenchRow]) -> list[dict]:
    out = []
    for r in rows:
        d = asdict(r)
        d["bytes_per_step"] = None if d["bytes_per_step"] != d["bytes_per_step"] else d["bytes_per_step"]
        out.append({k: (None if isinstance(v, float) and v != v else v) for k, v in d.items()})
    return out


def plot_bars(rows: list[BenchRow], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.2), 4))
    ax.bar([r.codec for r in rows], [r.it_per_s for r in rows], yerr=[r.it_per_s_spread for r in rows])
    ax.set_ylabel("it/s")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(
    cfg: RunConfig, specs: list[str], steps: int, warmup: int, repeat: int, json_path: str | None, plot_path: str | None
) -> None:
    rows = run_codecs(cfg, specs, steps, warmup, repeat)
    if Transport().rank != 0:
        return
    print(
        f"psgrad bench: model {cfg.model}, batch {cfg.batch_size}/worker, {steps} steps after {warmup} warm-up, repeat {repeat}, data {cfg.dataset}",
        file=sys.stderr,
    )
    print(table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(as_json(rows), f, indent=1)
    if plot_path:
        plot_bars(rows, plot_path)
