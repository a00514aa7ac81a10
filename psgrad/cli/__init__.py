"""The ``psgrad`` command line: a thin layer over the Python API.

Importing it does not import torch (each command imports what it runs), so ``--help`` and usage
errors are quick. ``group`` is the command group; ``training`` and ``measure`` add its commands.
"""

from __future__ import annotations

from . import measure, training
from .group import main
from .measure import bench, codecs, plot
from .training import server, simulate, train, worker

__all__ = ["bench", "codecs", "main", "measure", "plot", "server", "simulate", "train", "training", "worker"]
