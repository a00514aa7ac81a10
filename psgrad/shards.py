"""This rank's data for a run: a worker's batches (psgrad's dataset shards or the caller's
loader) and rank 0's test set, read before the first step and agreed on by every rank, so a
dataset that cannot serve the run stops the job once, before any training."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .agreement import read_agreed
from .comm.layout import RankLayout
from .config import RunConfig
from .data import DataError, ImageSet, RankData, ShardLoader, load_dataset

if TYPE_CHECKING:  # the interface only
    from .comm.channel import Channel


class IterLoader:
    """Adapts a re-iterable loader of (inputs, labels) to ``batch(step)`` (epochs restart it)."""

    def __init__(self, iterable: Iterable) -> None:
        self.iterable = iterable
        self.steps_per_epoch = len(iterable)  # type: ignore[arg-type]
        self._it, self._next = None, 0

    def batch(self, step: int):
        if self._it is None or step != self._next or step % self.steps_per_epoch == 0:
            self._it = iter(self.iterable)
            for _ in range(step % self.steps_per_epoch):
                next(self._it)
        self._next = step + 1
        return next(self._it)


def load_split(cfg: RunConfig, split: str) -> ImageSet:
    """``split`` ("train" or "test") of ``cfg``'s dataset: read (CIFAR) or generated from its seed."""
    return load_dataset(
        cfg.dataset,
        split,
        data_dir=cfg.data_dir,
        synthetic_classes=cfg.synthetic_classes,
        synthetic_size=cfg.synthetic_samples,
        seed=cfg.seed,
    )


def shard_loader(cfg: RunConfig, *, worker: int, workers: int) -> ShardLoader:
    """Worker ``worker``'s batches of ``cfg``'s training set, split over ``workers`` as the run says."""
    images = load_split(cfg, "train")
    return ShardLoader(
        images,
        dataset=cfg.dataset,
        worker=worker,
        workers=workers,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        partition=cfg.partition,
        augment=cfg.augment,
    )


def your_loader(loader_fn: Callable, *, worker: int, workers: int) -> object:
    """Worker ``worker``'s loader from the caller's ``loader_fn``, as an object with
    ``batch(step)`` (a re-iterable loader adapted); DataError for an epoch of no batches, in which
    a run counted in epochs could not take a step."""
    loader = loader_fn(worker, workers)
    loader = loader if hasattr(loader, "batch") else IterLoader(loader)
    if not loader.steps_per_epoch >= 1:
        raise DataError(
            f"loader_fn({worker}, {workers}) gave a loader of {loader.steps_per_epoch} steps per epoch: "
            "every worker needs at least one batch"
        )
    return loader


def rank_data(
    cfg: RunConfig, *, transport: Channel, layout: RankLayout, loader_fn: Callable | None, own_test_set: bool
) -> RankData:
    """This rank's batches and test set, and the run's steps (collective).

    1. A worker's loader (the caller's ``loader_fn``, else its shard of ``cfg.dataset``) and rank
       0's test set, read on every rank before the first step (``read_agreed``): a dataset that
       cannot be read, or is too small for one batch a worker, stops the job here, not at the
       first evaluation hours in.
    2. The steps per epoch: the mean of the workers' (one allreduce), so every rank agrees.
    3. The run's steps: --steps, else --epochs of them (at least one).
    """
    rank = transport.rank

    def read() -> tuple[object | None, ImageSet | None]:
        loader = None
        if layout.is_worker(rank):
            index, workers = layout.worker_index(rank), layout.num_workers
            if loader_fn is not None:
                loader = your_loader(loader_fn, worker=index, workers=workers)
            else:
                loader = shard_loader(cfg, worker=index, workers=workers)
        return loader, load_split(cfg, "test") if rank == 0 and own_test_set else None

    loader, test_set = read_agreed(transport, read, problems=(DataError, FileNotFoundError))
    spe = int(transport.allreduce_sum([loader.steps_per_epoch if loader else 0])[0] // layout.num_workers)
    total = cfg.steps if cfg.steps is not None else max(1, math.ceil(cfg.epochs * spe))
    label = cfg.dataset_label if loader_fn is None else "custom data"
    return RankData(loader=loader, test_set=test_set, label=label, steps_per_epoch=spe, total=total)
