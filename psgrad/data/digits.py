"""``--dataset digits``: real handwritten digits, the second dataset an accuracy claim is checked on.

The UCI optical digits that scikit-learn installs with itself (1,797 images of 8x8 pixels, 16 grey
levels, 10 classes, written by 43 people): small, real, and of another kind than the generated
proxy, whose classes are separable in a way real images are not. No download: ``pip install
scikit-learn`` (psgrad's ``digits`` extra) brings the file.

1. Read the 1,797 rows (64 pixel values 0..16, then the label) from scikit-learn's
   ``datasets/data/digits.csv.gz``, found without importing scikit-learn (which imports scipy).
2. Split them once, by a fixed permutation that no run seed changes, into 1,437 training and 360
   test images (so every seed and every run is scored on the same test set).
3. Scale each image to CIFAR's shape: 0..16 to 0..255, each pixel a 4x4 block (32x32), the one
   grey channel copied to three.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np

from .cifar import DataError, ImageSet

SPLIT_SEED = 20_240_611  # the train/test split's, fixed: not a run's seed
TEST_SIZE = 360
MISSING = "--dataset digits reads scikit-learn's copy of the UCI digits: pip install 'psgrad[digits]' (or scikit-learn)"


def _rows() -> np.ndarray:
    """The 1,797 x 65 table (pixels, label) as scikit-learn ships it."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(MISSING)
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    try:
        with gzip.open(path, "rt") as f:
            return np.loadtxt(f, delimiter=",")
    except OSError as err:
        raise DataError(f"{path}: cannot read scikit-learn's digits ({err}); reinstall scikit-learn") from None


def load_digits(split: str) -> ImageSet:
    """The ``split`` ("train" or "test") of the digits, as uint8 (N, 3, 32, 32) and int64 labels."""
    rows = _rows()
    order = np.random.default_rng(SPLIT_SEED).permutation(len(rows))
    chosen = order[TEST_SIZE:] if split == "train" else order[:TEST_SIZE]
    pixels, labels = rows[chosen, :-1], rows[chosen, -1]
    small = np.rint(pixels.reshape(-1, 8, 8) * (255 / 16)).astype(np.uint8)
    large = np.kron(small, np.ones((4, 4), dtype=np.uint8))  # each pixel a 4x4 block
    images = np.ascontiguousarray(np.repeat(large[:, None], 3, axis=1))
    return ImageSet(images, labels.astype(np.int64), f"digits/{split}")
