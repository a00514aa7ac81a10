"""CIFAR-10/100 from the standard python-pickle archives, read with a restricted unpickler.

The archives are pickles (that is how CIFAR is distributed). They are only ever read from the
local directory the user names, and the unpickler below refuses every class except the numpy
array reconstruction these files contain, so a tampered file cannot run code. Nothing else in
psgrad unpickles anything.
"""

from __future__ import annotations

import io
import pickle
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LAYOUTS = {
    "cifar10": (
        "cifar-10-batches-py",
        [f"data_batch_{i}" for i in range(1, 6)],
        "test_batch",
        b"labels",
        "cifar-10-python.tar.gz",
    ),
    "cifar100": ("cifar-100-python", ["train"], "test", b"fine_labels", "cifar-100-python.tar.gz"),
}
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 carry bytes; pure data
}
URL_HINT = "https://www.cs.toronto.edu/~kriz/cifar.html"


class DataError(ValueError):
    """A dataset that cannot serve the run: its files are there but cannot be read as CIFAR, or it
    holds fewer samples than one batch a worker (``ShardLoader``). The message says what is wrong
    and what to do."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR archive")
        return super().find_class(module, name)


@dataclass
class ImageSet:
    """uint8 images (N, 3, 32, 32) and int64 labels (N,)."""

    images: np.ndarray
    labels: np.ndarray
    name: str


def _load_member(raw: bytes, where: str, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    try:
        entry = _RestrictedUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as err:
        raise DataError(f"{where} is not a readable CIFAR batch: {err}") from None
    if not isinstance(entry, dict) or b"data" not in entry or label_key not in entry:
        raise DataError(f"{where} lacks the b'data' / {label_key!r} entries of a CIFAR batch")
    data = np.asarray(entry[b"data"], dtype=np.uint8)
    labels = np.asarray(entry[label_key], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise DataError(f"{where}: expected N x 3072 images and N labels, got {data.shape} and {labels.shape}")
    return data.reshape(-1, 3, 32, 32), labels


def missing_data(dataset: str, data_dir: str | Path) -> str | None:
    """Why ``dataset`` cannot be read from ``data_dir`` (neither its folder nor its archive is
    there), or None: the check a launch makes before any rank starts."""
    if dataset not in LAYOUTS:
        return None
    (folder, *_, archive), root = LAYOUTS[dataset], Path(data_dir)
    if (root / folder).is_dir() or (root / archive).is_file():
        return None
    return (
        f"{dataset}: neither {root / folder}/ nor {root / archive} exists. Download {archive} from {URL_HINT} "
        f"into {root} (extracted or not), or use --dataset synthetic."
    )


def load_cifar(dataset: str, data_dir: str | Path, split: str) -> ImageSet:
    """Read ``split`` ('train' or 'test') of ``dataset`` from ``data_dir`` (extracted or .tar.gz)."""
    folder, train_files, test_file, label_key, archive = LAYOUTS[dataset]
    members = train_files if split == "train" else [test_file]
    root = Path(data_dir)
    raws: list[tuple[str, bytes]] = []
    if (root / folder).is_dir():
        for member in members:
            path = root / folder / member
            if not path.is_file():
                raise FileNotFoundError(
                    f"{dataset}: expected {path} (download {archive} from {URL_HINT} and extract it in {root})"
                )
            raws.append((str(path), path.read_bytes()))
    elif (root / archive).is_file():
        try:
            with tarfile.open(root / archive, "r:gz") as tar:
                for member in members:
                    try:
                        raws.append((f"{archive}:{folder}/{member}", tar.extractfile(f"{folder}/{member}").read()))
                    except (KeyError, AttributeError):
                        raise FileNotFoundError(f"{dataset}: {root / archive} has no {folder}/{member}") from None
        except (tarfile.TarError, EOFError, zlib.error) as err:  # a download cut short, or not a .tar.gz
            raise DataError(
                f"{dataset}: {root / archive} cannot be read ({type(err).__name__}: {err}); it is truncated or "
                f"corrupt: download {archive} again from {URL_HINT}"
            ) from None
    else:
        raise FileNotFoundError(missing_data(dataset, root))
    parts = [_load_member(raw, where, label_key) for where, raw in raws]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    classes = 10 if dataset == "cifar10" else 100
    if labels.min(initial=0) < 0 or labels.max(initial=0) >= classes:
        raise DataError(f"{dataset}: labels outside 0..{classes - 1}")
    return ImageSet(images, labels, f"{dataset}/{split}")
