"""``python -m psgrad.bench JOB.json``: one launcher job (see psgrad.bench.launcher)."""

import sys

from .launcher import _child

_child(sys.argv[1])
