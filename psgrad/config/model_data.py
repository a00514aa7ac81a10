"""The model and data settings of a run (``RunConfig``'s first --help section)."""

from __future__ import annotations

from dataclasses import dataclass

from ..choices import (
    DATASETS,
    MODEL_NAMES,
)
from ..settings import (
    MODEL_AND_DATA,
    UnusedRule,
    setting,
    unless,
)


def _wrn_only(flag: str) -> UnusedRule:
    return unless(
        lambda cfg: cfg.model == "wrn", flag + " shapes a WideResNet: it means nothing to --model {cfg.model}"
    )


def _generated_only(flag: str) -> UnusedRule:
    return unless(
        lambda cfg: cfg.dataset in ("synthetic", "proxy"),
        flag + " shapes a generated dataset (synthetic or proxy): it means nothing to --dataset {cfg.dataset}",
    )


@dataclass
class ModelDataSettings:
    """Which model trains on which data."""

    model: str = setting(
        "wrn",
        section=MODEL_AND_DATA,
        choices=MODEL_NAMES,
        help="Model architecture.",
    )
    depth: int = setting(
        16,
        section=MODEL_AND_DATA,
        low=10,
        unused=(_wrn_only("--depth"),),
        help="Only --model wrn: WideResNet depth (6n+4: 10, 16, 22, 28, 40).",
    )
    widen_factor: int = setting(
        4,
        section=MODEL_AND_DATA,
        low=1,
        unused=(_wrn_only("--widen-factor"),),
        help="Only --model wrn: WideResNet width multiplier k.",
    )
    dropout: float = setting(
        0.0,
        section=MODEL_AND_DATA,
        low=0,
        high=1,
        high_open=True,
        unused=(_wrn_only("--dropout"),),
        help="Only --model wrn: dropout between convolutions.",
    )
    dataset: str = setting(
        "synthetic",
        section=MODEL_AND_DATA,
        choices=DATASETS,
        help="Training data. synthetic and proxy are generated from --seed: synthetic is easy (dense reaches 100 % in a few epochs), proxy is the harder accuracy proxy for comparing codecs (docs/training.md); digits is real handwritten digits (scikit-learn's copy of the UCI set: pip install 'psgrad[digits]'), the second dataset accuracy claims are checked on.",
    )
    data_dir: str = setting(
        "data",
        section=MODEL_AND_DATA,
        path="dir",
        unused=(
            unless(
                lambda cfg: cfg.dataset in ("cifar10", "cifar100"),
                "--data-dir holds the CIFAR archives: --dataset {cfg.dataset} does not read it",
            ),
        ),
        help="--dataset cifar10 or cifar100: directory with the CIFAR python archives (extracted or .tar.gz).",
    )
    synthetic_classes: int = setting(
        10,
        section=MODEL_AND_DATA,
        choices=(10, 100),
        unused=(_generated_only("--synthetic-classes"),),
        help="Only --dataset synthetic or proxy: its number of classes.",
    )
    synthetic_size: int | None = setting(
        None,
        section=MODEL_AND_DATA,
        low=1,
        unused=(_generated_only("--synthetic-size"),),
        help="Training samples of a generated dataset [default: 2048 synthetic, 8192 proxy].",
    )
    partition: str = setting(
        "random",
        section=MODEL_AND_DATA,
        choices=("random", "contiguous"),
        help="How the training set is split over workers (reshuffled each epoch).",
    )
    augment: bool = setting(
        True,
        section=MODEL_AND_DATA,
        help="Random crop (4-pixel padding) and horizontal flip (no flip for digits: a mirrored digit is another symbol).",
    )
