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


def make_proxy(num_classes: int, size: int, seed: int, split: str) -> ImageSet:
    """A harder learnable set for accuracy studies: dense training climbs for many epochs, so a
    codec that slows learning shows as a gap instead of hiding under a 100 % ceiling.

    1. Every class has ``MODES`` prototypes (sub-classes), each a mix of its own smooth pattern
       (coarse 4x4 and finer 8x8 structure, upsampled) and one pattern from a pool shared by all
       classes: classes overlap, and a class is a union of looks rather than one template.
    2. A sample takes one of its class's prototypes, moves it by up to ``SHIFT`` pixels and blends
       in a prototype of another class by a Beta-distributed weight (mostly small, a long tail
       of hard, near-boundary samples); then contrast, brightness and strong pixel noise.
    3. ``LABEL_NOISE`` of the *training* labels are replaced by a random class; test labels are
       clean, so the test accuracy can approach but not reach the samples' own ambiguity.
    Everything is drawn from ``seed`` (prototypes) and ``seed`` + split (samples).
    """
    protos_rng = np.random.default_rng([seed, 0xC0DE])
    shared = _patterns(protos_rng, num_classes)
    own = _patterns(protos_rng, num_classes * MODES).reshape(num_classes, MODES, 3, 32, 32)
    pick = protos_rng.integers(0, num_classes, size=(num_classes, MODES))
    prototypes = 0.55 * own + 0.45 * shared[pick]
    rng = np.random.default_rng([seed, 11 if split == "train" else 12])
    labels = rng.integers(0, num_classes, size=size)
    modes = rng.integers(0, MODES, size=size)
    others = (labels + rng.integers(1, num_classes, size=size)) % num_classes
    blend = 0.7 * rng.beta(0.7, 2.0, size=(size, 1, 1, 1))
    images = (1 - blend) * prototypes[labels, modes] + blend * prototypes[others, rng.integers(0, MODES, size=size)]
    for axis in (2, 3):  # one shift per sample and axis, applied by rolling groups of equal shift
        shifts = rng.integers(-SHIFT, SHIFT + 1, size=size)
        for value in np.unique(shifts):
            chosen = shifts == value
            images[chosen] = np.roll(images[chosen], int(value), axis=axis)
    contrast = rng.uniform(0.6, 1.4, size=(size, 1, 1, 1))
    images = 127.5 + contrast * (images - 127.5) + rng.normal(0, 25, size=(size, 1, 1, 1))
    images = images + rng.normal(0, NOISE, size=images.shape)
    if split == "train":
        flip = rng.random(size) < LABEL_NOISE
        labels = np.where(flip, rng.integers(0, num_classes, size=size), labels)
    return ImageSet(np.clip(images, 0, 255).astype(np.uint8), labels.astype(np.int64), f"proxy{num_classes}/{split}")


MODES = 6
SHIFT = 4
NOISE = 70.0
LABEL_NOISE = 0.1


def _patterns(rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` smooth RGB patterns (count, 3, 32, 32) around mid-grey: 4x4 and 8x8 cells, upsampled."""
    coarse = rng.uniform(-70, 70, size=(count, 3, 4, 4)).repeat(8, axis=2).repeat(8, axis=3)
    fine = rng.uniform(-40, 40, size=(count, 3, 8, 8)).repeat(4, axis=2).repeat(4, axis=3)
    return 127.5 + coarse + fine
