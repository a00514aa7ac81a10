"""The ``psgrad`` command line: a thin layer over the Python API.

Importing it does not import torch (each command imports what it runs), so ``--help`` and usage
errors are quick. ``group`` is the command group; ``training``, ``benching``, ``measure`` and
``planning`` add its commands.
"""

from __future__ import annotations

from . import benching, measure, planning, training
from .benching import bench
from .group import main
from .measure import codecs, compare, plot
from .planning import plan
from .training import server, simulate, train, worker

__all__ = [
    "bench", "benching", "codecs", "compare", "main", "measure", "plan", "planning", "plot", "server", "simulate",
    "train", "training", "worker",
]  # fmt: skip
