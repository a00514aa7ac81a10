"""Among the workers only: one worker's parameters or optimizer state to the others, the
workers' mean of a value (a metric, BatchNorm's running statistics), and a worker's shard of a
dataset.

Servers of ``--topology ps`` sum in their own loop and take part in no collective of the
workers, so a broadcast here is point to point: the first worker sends to each other worker on
its own tag. The bytes are msgpack of plain values and tensors (dtype, shape, raw bytes): no
pickle crosses the network.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
import torch

from ..comm.protocol import TAG_USER
from .world import world

_TENSOR = "__psgrad_tensor__"


def _pack(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):  # numpy's values travel as torch's
        value = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value.item()
    if isinstance(value, torch.Tensor):
        array = value.detach().cpu()
        dtype = str(array.dtype).removeprefix("torch.")
        data = array.view(torch.int16).numpy().tobytes() if array.dtype == torch.bfloat16 else array.numpy().tobytes()
        return {_TENSOR: [dtype, list(array.shape), data]}
    if isinstance(value, Mapping):
        return {key: _pack(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_pack(item) for item in value]
    return value


def _unpack(value: Any) -> Any:
    if isinstance(value, dict) and _TENSOR in value:
        dtype, shape, data = value[_TENSOR]
        if dtype == "bfloat16":
            return (
                torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.int16).copy())
                .view(torch.bfloat16)
                .reshape(shape)
            )
        return torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.dtype(dtype)).copy()).reshape(shape)
    if isinstance(value, dict):
        return {key: _unpack(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_unpack(item) for item in value]
    return value


def _send_to(value: Any, ranks: list[int]) -> None:
    """``value`` to each of ``ranks``: its msgpack bytes' length, then the bytes, on ``TAG_USER``."""
    w = world()
    data = msgpack.packb(_pack(value), use_bin_type=True)
    size = np.array([len(data)], dtype=np.int64).tobytes()
    w.transport.wait_all([w.transport.isend(part, rank, TAG_USER) for rank in ranks for part in (size, data)])


def _receive_from(rank: int) -> Any:
    """The value ``rank`` sent with ``_send_to``."""
    w = world()
    head = w.transport.irecv(8, rank, TAG_USER).wait()
    size = int(np.frombuffer(bytes(head.payload()), dtype=np.int64)[0])
    body = w.transport.irecv(size, rank, TAG_USER).wait()
    return _unpack(msgpack.unpackb(bytes(body.payload()), raw=False, strict_map_key=False))


def _send_and_receive_first_worker(value: Any) -> list[Any] | None:
    """Every worker's ``value``, in worker order, on the first worker (None on the others)."""
    w = world()
    workers = w.layout.worker_ranks
    if w.transport.rank != workers[0]:
        _send_to(value, [workers[0]])
        return None
    return [value, *(_receive_from(rank) for rank in workers[1:])]


def _mean(values: list[Any]) -> Any:
    """The mean of the workers' ``values`` (one structure each, as ``_pack`` sends them): floating
    tensors and numbers averaged, other tensors (counts, flags) and values the first worker's."""
    first = values[0]
    if any(_shape(value) != _shape(first) for value in values):
        shapes = ", ".join(f"worker {k}: {_shape(value)}" for k, value in enumerate(values))
        raise ValueError(f"psgrad.average: every worker must pass a value of the same structure, got {shapes}")
    if isinstance(first, torch.Tensor):
        if not first.is_floating_point():
            return first
        total = torch.zeros(first.shape, dtype=torch.float64)
        for value in values:
            total += value.detach().cpu().double()
        return (total / len(values)).to(first.dtype).to(first.device)
    if isinstance(first, float | int) and not isinstance(first, bool):
        return sum(values) / len(values)
    if isinstance(first, Mapping):
        return {key: _mean([value[key] for value in values]) for key in first}
    if isinstance(first, list):
        return [_mean([value[i] for value in values]) for i in range(len(first))]
    return first


def _shape(value: Any) -> Any:
    """What must match between the workers' values: a tensor's shape, a dict's keys, a list's length."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, Mapping):
        return sorted(map(str, value))
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return len(value) if isinstance(value, list) else type(value).__name__


def average(value: Any) -> Any:
    """The mean over the workers of ``value`` (collective: every worker calls it): a tensor, a
    number, or a dict, list or tuple of them (numpy's too), e.g. a test accuracy each worker
    measured on its shard. Floating tensors and numbers are averaged (in float64), other tensors
    and values are the first worker's; every worker gets the same structure back (a tuple as a
    list, a numpy array as a tensor).

    1. Every worker takes its ``value`` as it travels (``_pack``).
    2. Every other worker sends it to the first (msgpack, no pickle).
    3. The first worker averages them.
    4. It sends the mean back to every other worker."""
    values = _send_and_receive_first_worker(_unpack(_pack(value)))
    mean = _mean(values) if values is not None else None
    return _from_first_worker(mean)


def average_buffers(model: torch.nn.Module) -> None:
    """Replace ``model``'s buffers by the workers' ``average`` of them, in place (collective:
    every worker calls it): BatchNorm's running mean and variance, which follow each worker's own
    shard, averaged as ``psgrad train`` averages them before it evaluates; counts
    (``num_batches_tracked``) the first worker's. Before evaluating or saving the model."""
    buffers = dict(model.named_buffers())
    mean = average(buffers)
    with torch.no_grad():
        for name, value in mean.items():
            buffers[name].copy_(value)


def _from_first_worker(value: Any) -> Any:
    """``value`` of the first worker, on every worker (the others' ``value`` is ignored)."""
    w = world()
    workers = w.layout.worker_ranks
    if w.transport.rank == workers[0]:
        _send_to(value, workers[1:])
        return value
    return _receive_from(workers[0])


def broadcast_parameters(state: Mapping[str, torch.Tensor]) -> None:
    """Copy the first worker's tensors into ``state`` on every worker, in place
    (``broadcast_parameters(model.state_dict())``: parameters and buffers alike)."""
    theirs = _from_first_worker(dict(state))
    if theirs is state or world().transport.rank == world().layout.worker_ranks[0]:
        return
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(theirs[name])


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Load the first worker's ``optimizer.state_dict()`` on every worker (the learning rates,
    momentum buffers, ... of a resumed run)."""
    theirs = _from_first_worker(optimizer.state_dict())
    if world().transport.rank != world().layout.worker_ranks[0]:
        optimizer.load_state_dict(theirs)


def shard(dataset: Any) -> torch.utils.data.Subset:
    """This worker's part of ``dataset``: every ``num_workers()``-th sample from its index on, and
    as many samples on every worker (the last ``len % num_workers()`` are left out), so every
    worker takes as many steps an epoch: a worker that stops early leaves the others waiting for
    its gradients. ``DistributedSampler(dataset, num_replicas=num_workers(),
    rank=worker_index(), drop_last=True)`` does the same and shuffles per epoch."""
    from torch.utils.data import Subset

    w = world()
    index, count = w.layout.worker_index(w.transport.rank), w.layout.num_workers
    return Subset(dataset, range(index, len(dataset) // count * count, count))
