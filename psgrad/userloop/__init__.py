"""psgrad in your own training loop (docs/api.md): ``init`` on every rank, then your optimizer
wrapped in ``DistributedOptimizer``. ``psgrad.train.run`` stays the loop that is psgrad's."""

from .broadcast import average, average_buffers, broadcast_optimizer_state, broadcast_parameters, shard
from .optimizer import DistributedOptimizer
from .savedstop import should_stop
from .world import init, is_worker, num_workers, rank, shutdown, size, worker_index

__all__ = [
    "DistributedOptimizer",
    "average",
    "average_buffers",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "init",
    "is_worker",
    "num_workers",
    "rank",
    "shard",
    "should_stop",
    "shutdown",
    "size",
    "worker_index",
]
