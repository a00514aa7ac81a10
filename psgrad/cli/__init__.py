"""The ``psgrad`` command line: a thin layer over the Python API.

Importing it does not import torch (each command imports what it runs), so ``--help`` and usage
errors are quick. ``group`` is the command group; ``training``, ``compare`` (bench), ``measure``
and ``planning`` add its commands.
"""

from __future__ import annotations

from . import compare, measure, planning, training
from .compare import bench
from .group import main
from .measure import codecs, plot
from .planning import plan
from .training import server, simulate, train, worker

__all__ = [
    "bench", "codecs", "compare", "main", "measure", "plan", "planning", "plot", "server", "simulate", "train",
    "training", "worker",
]  # fmt: skip
