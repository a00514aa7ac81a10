"""Measuring psgrad: ``launcher`` (psgrad bench's jobs), ``results`` (its rows, table, JSON, PNG),
``baselines`` (DDP, PowerSGD, compute only), ``netshape`` (namespaces + tbf), ``codecbench``
(psgrad codecs), ``simulation`` (psgrad simulate against one worker alone)."""

from .launcher import measure
from .results import BenchRow, hidden_share, summarize, table

__all__ = ["BenchRow", "hidden_share", "measure", "summarize", "table"]
