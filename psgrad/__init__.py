"""psgrad: a parameter server over MPI whose every gradient travels through a codec.

The names below are imported on first use (PEP 562), not with the package: the codecs need
torch, and ``psgrad --help`` should not wait for it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_HOMES = {
    "Codec": "psgrad.codecs",
    "Message": "psgrad.codecs",
    "available_codecs": "psgrad.codecs",
    "make_codec": "psgrad.codecs",
    "wire": "psgrad.comm.wire",
    "WireError": "psgrad.comm.wire",
    "DGCMemory": "psgrad.feedback",
    "ErrorFeedback": "psgrad.feedback",
    "make_feedback": "psgrad.feedback",
    "load_model": "psgrad.checkpoint",
    # your own training loop (docs/api.md)
    "init": "psgrad.userloop",
    "rank": "psgrad.userloop",
    "size": "psgrad.userloop",
    "num_workers": "psgrad.userloop",
    "worker_index": "psgrad.userloop",
    "is_worker": "psgrad.userloop",
    "shutdown": "psgrad.userloop",
    "should_stop": "psgrad.userloop",
    "shard": "psgrad.userloop",
    "DistributedOptimizer": "psgrad.userloop",
    "ddp_hook": "psgrad.ddpcomm",
    "broadcast_parameters": "psgrad.userloop",
    "broadcast_optimizer_state": "psgrad.userloop",
    "average": "psgrad.userloop",
    "average_buffers": "psgrad.userloop",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'psgrad' has no attribute {name!r}")
    home = importlib.import_module(_HOMES[name])
    value = home if name == "wire" else getattr(home, name)
    globals()[name] = value
    return value
