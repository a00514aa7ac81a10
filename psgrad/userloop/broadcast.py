"""Among the workers only: one worker's parameters or optimizer state to the others, and a
worker's shard of a dataset.

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


def _from_first_worker(value: Any) -> Any:
    """``value`` of the first worker, on every worker (the others' ``value`` is ignored)."""
    w = world()
    workers, me = w.layout.worker_ranks, w.transport.rank
    if me == workers[0]:
        data = msgpack.packb(_pack(value), use_bin_type=True)
        size = np.array([len(data)], dtype=np.int64).tobytes()
        sends = [w.transport.isend(part, rank, TAG_USER) for rank in workers[1:] for part in (size, data)]
        w.transport.wait_all(sends)
        return value
    head = w.transport.irecv(8, workers[0], TAG_USER).wait()
    size = int(np.frombuffer(bytes(head.payload()), dtype=np.int64)[0])
    body = w.transport.irecv(size, workers[0], TAG_USER).wait()
    return _unpack(msgpack.unpackb(bytes(body.payload()), raw=False, strict_map_key=False))


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
