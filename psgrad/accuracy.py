"""What psgrad measured of each codec's accuracy, and the note a run prints when it picks a
combination that trailed dense training.

1. ``MEASURED`` holds one entry per combination measured on the accuracy proxy: codec,
   feedback, down-link codec, test accuracy as a fraction of dense at equal epochs, where
   docs/benchmarks.md or docs/training.md shows the runs, and, where they were measured, the same
   fraction on psgrad's second dataset (``--dataset digits``, real handwritten digits) and on a
   held-out real image set run outside psgrad (datasets of another kind than the proxy). A codec is a spec: its name, and the
   parameters that set it apart (``sign:bucket=32``); parameters it leaves out match any value.
   An entry measured on a gossip topology names it and holds for that topology only. An entry
   may also record that the combination did not learn a larger model at all (``failed``): at
   parity on both datasets, it still trails.
2. ``accuracy_note(cfg)`` finds the entry of a run's combination (topologies without a
   down-link count as a dense down-link) and, when it reached less than ``PARITY`` of dense on
   the proxy or less than ``HELD_OUT_PARITY`` on either real set, returns one sentence for rank 0 to print at start-up, the fraction rounded down to two places
   (0.988 reads 0.98x, never the bar's 0.99x). Unmeasured combinations get no note:
   the note reports evidence, it does not guess. Local steps (``--local-steps``) change what a
   codec's figure means: their entries name the local steps they were measured with
   (``local_key``), and a run with local steps that nothing measured is told so.
3. ``accuracy_lines(cfg)`` gives a table of speeds its accuracy (``psgrad plan``, which sets no
   feedback): the combination's measurements under every feedback, or that it is dense or was
   never measured. ``best_measured(codec)`` is a codec's best combination, for a table of codecs
   alone (``psgrad codecs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .codecs import make_codec, parse_spec
from .config import RunConfig
from .roles import topology_of

PARITY = 0.99
"""The bar for "learns as well as dense": at least 0.99x dense test accuracy at equal epochs."""

HELD_OUT_PARITY = 0.98
"""The same bar on the real sets (digits, held-out), whose three seeds spread wider than the
proxy's (on digits' 360 test images one image is 0.28 points)."""

HELD_OUT = "a held-out real image-classification set (3 seeds)"
"""Where the ``held_out`` figures come from (docs/benchmarks.md, "Which codec learns")."""

DIGITS = "real handwritten digits (--dataset digits, 3 seeds)"
"""Where the ``digits`` figures come from (``DATASET=digits bash benchmarks/proxy-accuracy.sh``)."""


_LOCAL = "H={h}, inner sgd, outer nesterov lr 0.7 momentum 0.5{overlap}"
"""``local_key`` of --local-steps H at the defaults."""

_DILOCO = "H={h}, inner sgd, outer nesterov lr 0.7 momentum 0.9{overlap}"
"""``local_key`` of --local-steps H with DiLoCo's outer optimizer (``--outer-momentum 0.9``)."""

_AVERAGING = "H={h}, inner sgd, outer sgd lr 1 momentum 0{overlap}"
"""``local_key`` of plain averaging: outer SGD at lr 1 without momentum."""


@dataclass(frozen=True)
class Measured:
    codec: str
    feedback: str
    down: str
    of_dense: float
    setting: str
    where: str
    topology: str = ""  # "": measured with a server (or alltoall) and taken for any topology
    held_out: float | None = None  # x dense on the held-out set; None: not measured there
    local: str = ""  # "": a gradient every step; else the local steps measured (``local_key``)
    digits: float | None = None  # x dense on --dataset digits; None: not measured there
    failed: str = ""  # a larger model it did not learn, and where that is shown; "": none seen

    @property
    def lowest(self) -> float:
        """The lowest of its fractions of dense over the datasets it was measured on."""
        return min(x for x in (self.of_dense, self.digits, self.held_out) if x is not None)

    @property
    def trails(self) -> bool:
        """Whether it reached less than the bar on any dataset it was measured on, or failed to
        learn a larger model."""
        real = [x for x in (self.held_out, self.digits) if x is not None]
        return bool(self.failed) or self.of_dense < PARITY or any(x < HELD_OUT_PARITY for x in real)


MEASURED = (
    Measured(
        "qsgd:levels=16", "none", "qsgd:levels=16", 0.998, "qsgd:levels=16 both ways, 15 epochs, median of 3 seeds",
        'docs/benchmarks.md, "Which codec learns"', held_out=1.01, digits=0.991,
    ),
    Measured(
        "qsgd:levels=16", "none", "none", 0.996,
        "qsgd:levels=16 up, dense down, 15 epochs, median of 3 seeds paired with dense",
        'docs/benchmarks.md, "Which codec learns"',
    ),
    Measured(
        "sign:bucket=0", "ef", "qsgd:levels=16", 0.983, "sign up, qsgd:levels=16 down, 15 epochs, median of 3 seeds",
        'docs/benchmarks.md, "Which codec learns"', digits=0.989,
    ),
    Measured(
        "sign:bucket=0", "ef", "sign:bucket=0", 0.972, "sign both ways, 15 epochs, median of 6 seeds paired with dense",
        'docs/benchmarks.md, "Which codec learns"', held_out=0.85, digits=0.989,
    ),
    Measured(
        "sign:bucket=128", "ef", "sign:bucket=128", 0.979, "sign:bucket=128 both ways, 15 epochs, median of 3 seeds",
        'docs/benchmarks.md, "Which codec learns"',
    ),
    Measured(
        "sign:bucket=16", "ef", "sign:bucket=16", 0.988, "sign:bucket=16 both ways, 15 epochs, median of 6 seeds paired with dense",
        'docs/benchmarks.md, "Which codec learns"',
    ),
    Measured(
        "sign:bucket=32", "ef", "sign:bucket=32", 0.984, "sign:bucket=32 both ways, 15 epochs, median of 6 seeds paired with dense",
        'docs/benchmarks.md, "Which codec learns"',
    ),
    Measured(
        "sign:bucket=32", "ef", "qsgd:levels=16", 0.990,
        "sign:bucket=32 up, qsgd:levels=16 down, 15 epochs, median of 6 seeds paired with dense",
        'docs/benchmarks.md, "Which codec learns"', held_out=0.96, digits=0.994,
    ),
    Measured(
        "sign:bucket=0", "none", "none", 0.951,
        "torus 2x4, 8 ranks, sign gossip, 15 epochs, median of 3 seeds paired with dense alltoall",
        'docs/training.md, "Decentralized training"', topology="torus",
    ),
    Measured(
        "topk", "ef", "topk", 0.843, "topk:ratio=0.01,approx=1 both ways, 15 epochs, median of 3 seeds",
        'docs/benchmarks.md, "Which codec learns"', held_out=0.61, digits=0.895,
    ),
    Measured(
        "topk", "ef", "none", 0.934, "topk:ratio=0.01 up, dense down, 15 epochs, median of 3 seeds paired with dense",
        'docs/benchmarks.md, "Which codec learns"', held_out=0.93, digits=0.969,
    ),
    Measured(
        "topk", "dgc", "none", 0.901,
        "topk:ratio=0.01 in DGC's memory (warm-up 3 epochs), dense down, 15 epochs, median of 3 seeds",
        'docs/benchmarks.md, "Which codec learns"', held_out=0.99,
    ),
    Measured(
        "powersgd:rank=2", "none", "none", 0.98,
        "powersgd:rank=2, 15 epochs, median of 6 seeds paired with dense (torch's DDP hook: 0.98 too)",
        'docs/benchmarks.md, "Which codec learns"', held_out=1.00, digits=0.989,
    ),
    Measured(
        "powersgd:rank=4", "none", "none", 0.988, "powersgd:rank=4, 15 epochs, median of 6 seeds paired with dense",
        'docs/benchmarks.md, "Which codec learns"',
    ),
    Measured(
        "powersgd:rank=8", "none", "none", 0.998, "powersgd:rank=8, 15 epochs, median of 6 seeds paired with dense",
        'docs/benchmarks.md, "Which codec learns"', held_out=1.00, digits=0.991,
    ),
    Measured(
        "none", "none", "none", 0.984, "--local-steps 32 --outer-momentum 0.9, dense exchanges, 15 epochs, median of 3 seeds paired with dense",
        'docs/benchmarks.md, "Slow links"', local=_DILOCO.format(h=32, overlap=""), digits=0.823,
    ),
    Measured(
        "powersgd:rank=8", "none", "none", 0.914, "--local-steps 32 --outer-momentum 0.9 with powersgd:rank=8, 15 epochs, median of 2 seeds",
        'docs/benchmarks.md, "Slow links"', local=_DILOCO.format(h=32, overlap=""), digits=0.789,
    ),
    Measured(
        "none", "none", "none", 0.974, "--local-steps 64 --outer-momentum 0.9, dense exchanges, 15 epochs, 1 seed",
        'docs/benchmarks.md, "Slow links"', local=_DILOCO.format(h=64, overlap=""),
    ),
    Measured(
        "none", "none", "none", 0.942, "--local-steps 8 --outer-momentum 0.9, dense exchanges, 15 epochs, 1 seed",
        'docs/benchmarks.md, "Slow links"', local=_DILOCO.format(h=8, overlap=""), digits=0.966,
    ),
    Measured(
        "powersgd:rank=8", "none", "none", 0.921, "--local-steps 8 --outer-momentum 0.9 with powersgd:rank=8, 15 epochs, 1 seed",
        'docs/benchmarks.md, "Slow links"', local=_DILOCO.format(h=8, overlap=""),
    ),
    Measured(
        "none", "none", "none", 0.981, "--local-steps 8, plain averaging (outer SGD at lr 1), 15 epochs, 1 seed",
        'docs/benchmarks.md, "Slow links"', local=_AVERAGING.format(h=8, overlap=""),
    ),
    Measured(
        "none", "none", "none", 0.953, "--local-steps 8, plain averaging, --overlap-exchange, 15 epochs, 1 seed",
        'docs/benchmarks.md, "Slow links"', local=_AVERAGING.format(h=8, overlap=", overlapped"),
    ),
    Measured(
        "none", "none", "none", 0.813, "--local-steps 32 --outer-momentum 0.9 --overlap-exchange, dense exchanges, median of 2 seeds",
        'docs/benchmarks.md, "Slow links"', local=_DILOCO.format(h=32, overlap=", overlapped"),
    ),
    Measured(
        "powersgd:rank=8", "none", "none", 0.646, "--local-steps 32 --outer-momentum 0.9 --overlap-exchange, powersgd:rank=8, 1 seed",
        'docs/benchmarks.md, "Slow links"', local=_DILOCO.format(h=32, overlap=", overlapped"),
    ),
    Measured(
        "none", "none", "none", 0.993, "--local-steps 32, dense exchanges, 15 epochs, median of 3 seeds paired with dense",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=32, overlap=""), digits=1.003,
    ),
    Measured(
        "qsgd:levels=16", "ef", "none", 0.992, "--local-steps 32, qsgd:levels=16 with ef up, dense down, median of 3 seeds",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=32, overlap=""), digits=1.006,
    ),
    Measured(
        "qsgd:levels=16", "ef", "qsgd:levels=16", 0.983, "--local-steps 32, qsgd:levels=16 with ef both ways, median of 3 seeds",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=32, overlap=""), digits=1.003,
    ),
    Measured(
        "qsgd:levels=16", "ef", "qsgd:levels=64", 0.992, "--local-steps 32, qsgd:levels=16 with ef up, qsgd:levels=64 down, median of 3 seeds",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=32, overlap=""), digits=1.006,
    ),
    Measured(
        "qsgd:levels=16", "ef", "qsgd:levels=64", 0.986, "--local-steps 64, qsgd:levels=16 with ef up, qsgd:levels=64 down, median of 3 seeds",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=64, overlap=""), digits=0.994,
    ),
    Measured(
        "powersgd:rank=8", "none", "none", 0.959, "--local-steps 32 with powersgd:rank=8, 15 epochs, 1 seed",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=32, overlap=""), digits=1.000,
    ),
    Measured(
        "qsgd:levels=16", "ef", "qsgd:levels=64", 1.003, "--local-steps 8 --overlap-exchange --overlap-steps 4, qsgd:levels=16 with ef, 64 levels down, 3 seeds",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=8, overlap=", overlapped by 4 steps"), digits=0.997,
    ),
    Measured(
        "qsgd:levels=16", "ef", "qsgd:levels=64", 0.981, "--local-steps 32 --overlap-exchange --overlap-steps 4, qsgd:levels=16 with ef, 64 levels down, 3 seeds",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=32, overlap=", overlapped by 4 steps"), digits=1.003,
    ),
    Measured(
        "qsgd:levels=16", "ef", "qsgd:levels=64", 0.972, "--local-steps 32 --overlap-exchange --overlap-steps 16, qsgd:levels=16 with ef, 64 levels down, 3 seeds",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=32, overlap=", overlapped by 16 steps"),
    ),
    Measured(
        "qsgd:levels=16", "ef", "qsgd:levels=64", 0.983, "--local-steps 32 --fragments 4 --overlap-exchange --overlap-steps 8, qsgd:levels=16 with ef, 64 levels down, 3 seeds",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=32, overlap=", 4 fragments, overlapped by 8 steps"),
    ),
    Measured(
        "qsgd:levels=16", "ef", "qsgd:levels=64", 0.974, "--local-steps 32 --fragments 4 --overlap-exchange --overlap-steps 16, qsgd:levels=16 with ef, 64 levels down, 3 seeds",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=32, overlap=", 4 fragments, overlapped by 16 steps"),
    ),
    Measured(
        "qsgd:levels=16", "ef", "qsgd:levels=64", 0.887, "--local-steps 16 --overlap-exchange, qsgd:levels=16 with ef, 64 levels down, 3 seeds",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=16, overlap=", overlapped"),
    ),
    Measured(
        "sign:bucket=0", "ef", "sign:bucket=0", 0.998, "--local-steps 8 --overlap-exchange --overlap-steps 4, sign with ef both ways, 3 seeds",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=8, overlap=", overlapped by 4 steps"), digits=0.997,
        failed="it did not learn WRN-16-4 (batch 16, the proxy: the loss stayed at chance for 520 steps)",
    ),
    Measured(
        "sign:bucket=0", "ef", "sign:bucket=0", 0.978, "--local-steps 16 --overlap-exchange --overlap-steps 8, sign with ef both ways, 1 seed",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=16, overlap=", overlapped by 8 steps"),
    ),
    Measured(
        "sign:bucket=0", "ef", "sign:bucket=0", 0.948, "--local-steps 32 --overlap-exchange --overlap-steps 8, sign with ef both ways, 1 seed",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=32, overlap=", overlapped by 8 steps"),
    ),
    Measured(
        "qsgd:levels=4", "ef", "qsgd:levels=4", 0.130, "--local-steps 16 --overlap-exchange --overlap-steps 8, qsgd:levels=4 with ef both ways, 1 seed: it diverged",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=16, overlap=", overlapped by 8 steps"),
    ),
    Measured(
        "none", "none", "none", 0.962, "--local-steps 32 --overlap-exchange, dense exchanges, median of 2 seeds",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=32, overlap=", overlapped"),
    ),
    Measured(
        "qsgd:levels=16", "ef", "qsgd:levels=16", 0.949, "--local-steps 32 --overlap-exchange, qsgd:levels=16 with ef both ways, median of 3 seeds",
        'docs/benchmarks.md, "Slow links"', local=_LOCAL.format(h=32, overlap=", overlapped"), digits=0.991,
    ),
)  # fmt: skip


def local_key(cfg: RunConfig, *, inner: bool = True) -> str:
    """What sets one run with ``--local-steps`` apart from another for accuracy ("" without);
    without ``inner``, all but the inner optimizer (your loop's is its own)."""
    if not cfg.local_steps:
        return ""
    overlap = f", {cfg.fragments} fragments" if cfg.fragments > 1 else ""
    overlap += ", overlapped" if cfg.overlap_exchange else ""
    if cfg.overlap_exchange and cfg.overlap_steps not in (0, cfg.local_steps):
        overlap += f" by {cfg.overlap_steps} steps"
    inner_optimizer = f", inner {cfg.inner_optimizer}" if inner else ""
    return (
        f"H={cfg.local_steps}{inner_optimizer}, outer {cfg.outer_optimizer} "
        f"lr {cfg.outer_lr:g} momentum {cfg.outer_momentum:g}{overlap}"
    )


def covers(entry_spec: str, spec: str) -> bool:
    """Whether a measured codec ``entry_spec`` is the codec ``spec``: the same name, and the same
    value of every parameter the entry names (compared after the codec's own parsing)."""
    name, pinned = parse_spec(entry_spec)
    codec, entry = make_codec(spec), make_codec(entry_spec)
    return codec.name == name and all(codec.params[key] == entry.params[key] for key in pinned)


def measured(cfg: RunConfig) -> Measured | None:
    """The measurement of ``cfg``'s combination of codec, feedback and down-link, if there is one
    (an entry measured on one topology holds for that topology only)."""
    return next((m for m in measured_with_any_feedback(cfg) if m.feedback == cfg.feedback), None)


def _down_link(cfg: RunConfig) -> str:
    """The run's down-link codec as measured: a topology without servers replies dense."""
    return cfg.down_codec if topology_of(cfg.topology).has_servers else "none"


def is_dense(cfg: RunConfig) -> bool:
    """Dense training, the reference every figure is a fraction of: no codec either way, a
    gradient every step."""
    return cfg.codec == "none" and _down_link(cfg) == "none" and not cfg.local_steps


def measured_with_any_feedback(cfg: RunConfig) -> list[Measured]:
    """Every measurement of ``cfg``'s codec, down-link, topology and local steps, whatever
    feedback it ran with, in ``MEASURED``'s order (for a caller that does not set feedback)."""
    down = _down_link(cfg)
    return [
        m
        for m in MEASURED
        if m.topology in ("", cfg.topology)
        and m.local == local_key(cfg)
        and covers(m.codec, cfg.codec)
        and covers(m.down, down)
    ]


def best_measured(codec_spec: str) -> Measured | None:
    """Of the per-step measurements of ``codec_spec`` (any feedback and down-link, with a server
    or alltoall), the one whose lowest fraction of dense over the datasets is highest: what the
    codec reached at best, for a table of codecs alone (``psgrad codecs``)."""
    found = [m for m in MEASURED if not m.local and not m.topology and covers(m.codec, codec_spec)]
    return max(found, key=lambda m: m.lowest, default=None)


def accuracy_lines(cfg: RunConfig) -> list[str]:
    """What psgrad measured of ``cfg``'s combination, for a table of predicted speeds that does
    not set feedback (``psgrad plan``): a line for each feedback it was measured with (its
    fractions of dense, and whether it trails), or one line saying it is dense or unmeasured."""
    found = {m.feedback: m for m in reversed(measured_with_any_feedback(cfg))}  # the first entry wins
    if not found:
        if is_dense(cfg):
            return ["accuracy: dense, the reference the codecs' figures are fractions of"]
        return [
            'accuracy: psgrad never measured this combination (docs/benchmarks.md, "Which codec learns" and '
            '"Slow links", list what it did): compare a run of it with --codec none before relying on its speed'
        ]
    lines = ["accuracy, measured (test accuracy at equal epochs, x dense; not predicted):"]
    for feedback, m in sorted(found.items()):
        real = f", {rounded_down(m.digits)}x on digits" if m.digits is not None else ""
        real += f", {rounded_down(m.held_out)}x held-out" if m.held_out is not None else ""
        verdict = f", but {m.failed}" if m.failed else ": trails dense" if m.trails else ": at parity"
        lines.append(
            f"  --feedback {feedback}: {rounded_down(m.of_dense)}x on the proxy{real}{verdict} ({m.setting}; {m.where})"
        )
    return lines


def accuracy_note(cfg: RunConfig, *, dense: str = "--codec none", your_loop: bool = False) -> str | None:
    """One sentence when ``cfg``'s combination trailed dense on either dataset, else None;
    ``dense`` is how the caller's users ask for dense training (``codec='none'`` in a script).
    ``your_loop``: local steps are ``init``'s keyword, and their inner optimizer is the script's,
    where every figure was measured with psgrad train's inner SGD."""
    found = measured(cfg)
    local_steps = "local_steps" if your_loop else "--local-steps"
    inner_sgd = ", measured with psgrad train's inner SGD" if your_loop and cfg.local_steps else ""
    if found is None and cfg.local_steps:
        return (
            f"note: {local_steps} with these settings ({local_key(cfg, inner=not your_loop)}, codec {cfg.codec}) was "
            'never measured for accuracy; docs/benchmarks.md, "Slow links", has the settings that were: compare with '
            f"a run without {local_steps}"
        )
    if found is None or not found.trails:
        return None
    held_out = f", {rounded_down(found.digits)}x on {DIGITS}" if found.digits is not None else ""
    held_out += f" and {rounded_down(found.held_out)}x on {HELD_OUT}" if found.held_out is not None else ""
    what = "these local steps and codec" if found.local else "this combination of codec, feedback and down-link"
    reached = (
        f"note: {what} reached {rounded_down(found.of_dense)}x dense test "
        f"accuracy at equal epochs on the accuracy proxy ({found.setting}; {found.where}){held_out}{inner_sgd}"
    )
    if found.failed:
        return f"{reached}, but {found.failed}: compare it with {dense} before relying on it"
    return f"{reached}: expect it to need more epochs than {dense}, and compare the two"


def marked(fraction: float, *, trails: bool) -> str:
    """A fraction of dense in a table's accuracy column: ``rounded_down``, and ``!`` when it trails."""
    return rounded_down(fraction) + ("!" if trails else "")


def rounded_down(value: float) -> str:
    """Rounded down to two places: a combination under the bar never reads as the bar."""
    return f"{math.floor(value * 100 + 1e-9) / 100:.2f}"
