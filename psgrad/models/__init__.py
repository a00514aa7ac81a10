"""Model registry: ``build_model(name, num_classes, **options)``."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn

from ..choices import MODEL_NAMES
from .alexnet import AlexNet
from .resnet9 import ResNet9
from .resnet20 import ResNet20
from .small import MLP, ConvNet
from .wideresnet import WideResNet

MODELS: dict[str, Callable[..., nn.Module]] = {
    "wrn": lambda num_classes, depth=16, widen_factor=4, dropout=0.0, **_: WideResNet(
        depth, widen_factor, num_classes, dropout
    ),
    "resnet9": lambda num_classes, **_: ResNet9(num_classes),
    "alexnet": lambda num_classes, **_: AlexNet(num_classes),
    "resnet20": lambda num_classes, **_: ResNet20(num_classes),
    "mlp": lambda num_classes, **_: MLP(num_classes),
    "convnet": lambda num_classes, **_: ConvNet(num_classes),
}
if set(MODELS) != set(MODEL_NAMES):  # the command line offers MODEL_NAMES without importing this
    raise ImportError(
        f"psgrad.choices.MODEL_NAMES {sorted(MODEL_NAMES)} must name the models built here: {sorted(MODELS)}"
    )


def build_model(name: str, num_classes: int, **options) -> nn.Module:
    """A fresh model; ``options`` (depth, widen_factor, dropout) are used where they apply."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name](num_classes, **options)


_GLOBAL_RNG = threading.Lock()
"""Held while a model is built from torch's global generator: ranks simulated in one process
share it, and one rank seeding while another draws its initial weights would give them different
models."""


def seeded_model(build: Callable[[], nn.Module], *, seed: int) -> nn.Module:
    """``build()`` with torch's global generator seeded with ``seed``: the same initial model on
    every rank."""
    with _GLOBAL_RNG:
        torch.manual_seed(seed)
        return build()
