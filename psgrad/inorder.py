"""Work done one piece at a time, in the order it was handed over, on a thread of its own.

``InOrder.submit(work)`` returns a ``torch.futures.Future`` at once; the thread runs the pieces
first in, first out, and each piece's result (or error, as a ``RuntimeError`` that names it)
completes its future:
1. The thread starts with the first piece, as a daemon: a process never waits for it to end.
2. It takes the next piece from the queue, runs it, and sets its future's result.
3. A piece that raises sets its future's exception, and every later piece fails with that error
   without running. A piece that failed on one rank may have left a collective half done there,
   so the collectives that follow would no longer pair up between the ranks.

Why a thread and not chained futures: the pieces hold collectives, and collectives must be issued
in the same order on every rank. Callbacks of chained futures run on whichever thread completed
the work before, so two pieces' collectives could interleave in another order on each rank.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch


def _value(future: torch.futures.Future) -> torch.Tensor:
    return future.wait()


class InOrder:
    """One daemon thread named ``name`` that runs submitted work in submission order."""

    def __init__(self, *, name: str) -> None:
        self.name = name
        self._pieces: queue.SimpleQueue[tuple[Callable[[], torch.Tensor], torch.futures.Future]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None

    def submit(
        self, work: Callable[[], torch.Tensor], *, devices: list[torch.device] | None = None
    ) -> torch.futures.Future:
        """``work``'s result, in a future that completes once every piece before it has run.
        ``devices``: the CUDA devices the result's tensors live on; the future then makes its
        readers' streams wait for the work the thread queued on them."""
        future: torch.futures.Future = torch.futures.Future(devices=devices)
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
            self._thread.start()
        self._pieces.put((work, future))
        # Python's set_exception stores the error as the future's value, which a C++ reader (DDP)
        # would try to use as a tensor ("Unable to cast ... to Tensor"); a callback that raises
        # makes torch set a real error on the future ``then`` returns.
        return future.then(_value)

    def _serve(self) -> None:
        while True:
            work, future = self._pieces.get()
            if self._failed is not None:
                future.set_exception(RuntimeError(f"not run: an earlier piece failed with {self._failed!r}"))
                continue
            try:
                result = work()
            except Exception as exc:  # noqa: BLE001 - handed to the future's owner, who raises it
                self._failed = exc
                future.set_exception(exc)
            else:
                future.set_result(result)
