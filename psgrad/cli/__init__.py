"""The ``psgrad`` command line: a thin layer over the Python API.

Importing it does not import torch (each command imports what it runs), so ``--help`` and usage
errors are quick. ``group`` is the command group; ``training``, ``compare`` (bench) and ``measure``
add its commands.
"""

from __future__ import annotations

from . import compare, measure, training
from .compare import bench
from .group import main
from .measure import codecs, plot
from .training import server, simulate, train, worker

__all__ = ["bench", "codecs", "compare", "main", "measure", "plot", "server", "simulate", "train", "training", "worker"]
