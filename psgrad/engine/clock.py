"""One step's clock, the same for every engine: marks taken as the step goes, and the step's
phases (``StepStats``) filled from them.

A phase's time is the span between its marks less the work done inside it that has a column of
its own (coding in backward hooks, a colocated rank's serving, decoding while it waits), so that
the columns add up to the step; the time a shared pass kept a rank waiting for the others is a
wait (``push_wait``), not backward.
"""

from __future__ import annotations

import time

from ..comm.protocol import StepStats


class StepClock:
    """Marks of one step: ``start`` (now), then ``forward_done``, ``backward_done``, optionally
    ``exchange_started`` (the exchange begins later than backward ends: a gossip rank first sends
    the layers whose hooks did not fire) and ``exchanged``, and ``end``."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.forward_done = self.backward_done = self.exchange_started = self.exchanged = self.end = self.start

    def mark(self, name: str) -> None:
        """Set mark ``name`` (an attribute above) to now; ``backward_done`` also starts the exchange."""
        now = time.perf_counter()
        setattr(self, name, now)
        if name == "backward_done":
            self.exchange_started = now

    def fill(
        self,
        stats: StepStats,
        *,
        in_forward: float = 0.0,
        in_backward: float = 0.0,
        in_exchange: float = 0.0,
        waited: float = 0.0,
    ) -> StepStats:
        """``stats``' forward, backward, push_wait and step_time from the marks.

        1. forward: start to forward_done, less ``in_forward``.
        2. backward: forward_done to backward_done, less ``in_backward`` and ``waited``.
        3. push_wait: ``waited`` plus exchange_started to exchanged, less ``in_exchange``.
        4. step_time: start to end.
        """
        stats.forward = (self.forward_done - self.start) - in_forward
        stats.backward = max(0.0, (self.backward_done - self.forward_done) - in_backward - waited)
        stats.push_wait = waited + max(0.0, (self.exchanged - self.exchange_started) - in_exchange)
        stats.step_time = self.end - self.start
        return stats
