"""The codec settings of a run: what travels, with which memory, when."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..choices import (
    FEEDBACKS,
    NONFINITE_POLICIES,
)
from ..settings import (
    CODEC,
    UnusedRule,
    setting,
    unless,
)


def _dgc_only(flag: str) -> UnusedRule:
    return unless(
        lambda cfg: cfg.feedback == "dgc",
        flag + " is DGC's: it means nothing without --feedback dgc (this run has --feedback {cfg.feedback})",
    )


def _warmup_needs_ratio(cfg: Any) -> str | None:
    from ..codecs import make_codec  # torch: not needed to build the command line
    from ..feedback import warms_up

    if warms_up(make_codec(cfg.codec)):
        return None
    return (
        f"--dgc-warmup-epochs raises the codec's ratio epoch by epoch: --codec {cfg.codec} has none "
        "(topk and randomk have one)"
    )


@dataclass
class CodecSettings:
    """How gradients are coded, remembered and pushed."""

    codec: str = setting(
        "none",
        section=CODEC,
        help="Gradient codec spec, e.g. qsgd:levels=16 or topk:ratio=0.01 (every codec: psgrad codecs --list).",
        your_loop=True,
    )
    down_codec: str = setting(
        "none",
        section=CODEC,
        help="Server-to-worker codec: none sends each layer's new value; any other codec sends the encoded change since what the workers hold, the server keeping the rest for later steps (error feedback).",
        your_loop=True,
    )
    feedback: str = setting(
        "none",
        section=CODEC,
        choices=FEEDBACKS,
        help="Worker-side memory around the codec: error feedback or DGC.",
        your_loop=True,
    )
    dgc_momentum: float = setting(
        0.9,
        section=CODEC,
        low=0,
        high=1,
        high_open=True,
        unused=(_dgc_only("--dgc-momentum"),),
        help="DGC: momentum kept on the workers (use --momentum 0).",
        your_loop=True,
    )
    dgc_clip_norm: float | None = setting(
        None,
        section=CODEC,
        low=0,
        low_open=True,
        unused=(_dgc_only("--dgc-clip-norm"),),
        help="DGC: local gradient clipping norm (default: off).",
        your_loop=True,
    )
    dgc_warmup_epochs: int = setting(
        0,
        section=CODEC,
        low=0,
        unused=(_dgc_only("--dgc-warmup-epochs"), _warmup_needs_ratio),
        help="DGC: epochs of exponential sparsity warm-up (needs a codec with ratio).",
        your_loop=True,
    )
    granularity: str = setting(
        "layer",
        section=CODEC,
        choices=("layer", "model"),
        help="One message per parameter tensor, or the whole model as one.",
        your_loop=True,
    )
    push: str = setting(
        "backward",
        section=CODEC,
        choices=("backward", "after"),
        help="layer granularity: send each layer from backward as soon as its gradient is ready, or code all layers after backward and send them first layer first (the next forward starts on the first replies while the rest are in flight).",
        your_loop=True,
    )
    bucket_vectors: bool = setting(
        True,
        section=CODEC,
        unused=(
            unless(
                lambda cfg: cfg.granularity == "layer",
                "--no-bucket-vectors is for --granularity layer: --granularity model sends the whole model as one message",
            ),
        ),
        help="layer granularity: send all 1-D parameters (biases, norm scales and shifts) as one uncompressed message per step, or each as its own compressed layer.",
        your_loop=True,
    )
    on_nonfinite: str = setting(
        "abort",
        section=CODEC,
        choices=NONFINITE_POLICIES,
        help="A NaN or Inf in a gradient or a server's sum: abort the job naming the step, rank and layer, or skip: drop that layer's update at that step on every rank (counted in metrics.csv's nonfinite).",
        your_loop=True,
    )
