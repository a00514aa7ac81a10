"""Which device a worker trains on (``--device``), and why it cannot have it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from .comm.channel import Channel

Hook = TypeVar("Hook", bound=Callable)


def device_problem(device: str) -> str | None:
    """Why a worker on this node cannot have ``device``, or None."""
    if device == "cuda" and not torch.cuda.is_available():
        return "--device cuda but torch sees no CUDA device on this node"
    return None


def worker_device(device: str, *, local_worker: int) -> torch.device:
    """A worker's device: ``cuda:<its index among this node's workers>`` (modulo the GPUs seen),
    or the CPU."""
    problem = device_problem(device)
    if problem is not None:
        raise RuntimeError(problem)
    if device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_worker % torch.cuda.device_count())


def rank_device(device: str, *, transport: Channel, is_worker: bool) -> torch.device:
    """This rank's device: a worker's (``worker_device``), the CPU for a serving-only rank.
    Collective on every rank (--device may differ per rank): a server counts in no GPU index."""
    local_worker = transport.local_rank(group=int(is_worker))
    return worker_device(device, local_worker=local_worker) if is_worker else torch.device("cpu")


def outside_autocast(hook: Hook, device: torch.device) -> Hook:
    """``hook`` run with autocast off for ``device``'s type.

    A module's forward pre-hook runs inside the forward's autocast, and a gradient hook inside it
    too when the caller's backward is started in the autocast block. Coding there must not follow
    the forward's precision: PowerSGD's products would come out in bf16, which no optimizer step
    of an fp32 parameter and no wire message takes."""

    def run(*args):
        with torch.autocast(device.type, enabled=False):
            return hook(*args)

    return run  # type: ignore[return-value]
