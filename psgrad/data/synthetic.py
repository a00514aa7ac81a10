"""A learnable CIFAR-shaped dataset made from the seed: for demos and tests (always labelled synthetic)."""

from __future__ import annotations

import numpy as np

from .cifar import ImageSet


def make_synthetic(num_classes: int, size: int, seed: int, split: str) -> ImageSet:
    """Images = class prototype + noise, as uint8 (N, 3, 32, 32).

    1. Each class gets a smooth prototype: a random 3x4x4 pattern upsampled to 32x32 (the same
       for train and test, drawn from ``seed``).
    2. Each sample adds per-pixel Gaussian noise and a random brightness shift, drawn from
       ``seed`` and the split, so train and test differ but share the classes.
    """
    protos_rng = np.random.default_rng([seed, 0x5EED])
    coarse = protos_rng.uniform(40, 215, size=(num_classes, 3, 4, 4))
    prototypes = coarse.repeat(8, axis=2).repeat(8, axis=3)
    rng = np.random.default_rng([seed, 1 if split == "train" else 2])
    labels = rng.integers(0, num_classes, size=size)
    noise = rng.normal(0, 40, size=(size, 3, 32, 32))
    shift = rng.normal(0, 20, size=(size, 1, 1, 1))
    images = np.clip(prototypes[labels] + noise + shift, 0, 255).astype(np.uint8)
    return ImageSet(images, labels.astype(np.int64), f"synthetic{num_classes}/{split}")
