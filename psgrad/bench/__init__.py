"""Measuring psgrad: ``launcher`` (psgrad bench: rows, table, JSON, PNG), ``baselines`` (DDP,
PowerSGD, compute only), ``netshape`` (namespaces + tbf), ``codecbench`` (psgrad codecs)."""

from .launcher import BenchRow, hidden_share, measure, summarize, table

__all__ = ["BenchRow", "hidden_share", "measure", "summarize", "table"]
