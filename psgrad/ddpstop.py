"""``psgrad.should_stop()`` in a torch DDP script (torchrun, ``psgrad.ddp_hook``): a SIGTERM is
saved, not lost. The ranks agree on a step, each saves its state after it, and the job ends as
the script ends.

1. The first call asks for it, on every rank after the same step: a gloo group of its own for
   the votes, and SIGTERM noted from then on, not raised (stopsaving.NotedStop). A second one
   (2 s or more after the first: torchrun passes on the one a scheduler sent it), or no step
   agreed within ``PATIENCE`` seconds, runs the handler there was before: by default the process
   ends by the signal, as without saved stops.
2. Every call takes part in the ranks' votes (stopsaving.StopVotes): an all-gather of the signal
   this rank noted, started about every ``VOTE_SECONDS``, and read ``MIN_LAG`` calls later, when
   every rank has started it (DDP's all-reduces keep the ranks within a step of one another).
3. A vote with a signal in it is the agreed stop: after that step ``should_stop()`` is True on
   every rank, and each says so once.
"""

from __future__ import annotations

import signal

import numpy as np
import torch
import torch.distributed as dist

from .metrics import say
from .stopsaving import MIN_LAG, NotedStop, StopVotes, named_ranks


class _GroupVotes:
    """The channel StopVotes votes on: all-gathers of one int64 over a torch process group."""

    def __init__(self, group) -> None:
        self.group, self.size = group, dist.get_world_size(group)

    def iallgather_sizes(self, value: int) -> tuple[dist.Work, np.ndarray]:
        out = torch.zeros(self.size, dtype=torch.int64)
        work = dist.all_gather_single(out, torch.tensor([value], dtype=torch.int64), group=self.group, async_op=True)
        return work, out.numpy()  # the array is the tensor's memory: filled once the work is done


class DDPStop:
    """One rank's part (module docstring)."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.votes = StopVotes(_GroupVotes(dist.new_group(backend="gloo")), lag=MIN_LAG)
        self.noted = NotedStop(self.rank, until="every rank agrees on: psgrad.should_stop() then says so")
        self.steps = 0  # calls since the first
        self.agreed = False
        before = signal.signal(signal.SIGTERM, self._note)
        self.before = signal.SIG_DFL if before is None else before  # None: a handler set outside Python

    def _note(self, signum: int, frame) -> None:
        """SIGTERM's handler: the first is noted; a stop at once runs the handler before (1)."""
        if self.noted.take(signum):
            return
        signal.signal(signum, self.before)
        if callable(self.before):
            self.before(signum, frame)
        else:
            signal.raise_signal(signum)

    def stepped(self) -> bool:
        """After a step: read the vote due, start the next (2-3); whether to stop now."""
        if self.agreed:
            return True
        signals = self.votes.due(self.steps)
        if signals is not None and signals.any():
            self.agreed = True
            self.noted.agreed()
            ranks = named_ranks(np.flatnonzero(signals).tolist())
            name = signal.Signals(int(signals.max())).name
            say(
                f"[psgrad rank {self.rank}] {name} on {ranks}: every rank stops after this step "
                "(psgrad.should_stop() is True): save and end your loop"
            )
            return True
        self.steps += 1
        self.votes.start(self.steps, noted=self.noted.signum)
        return False


_STOP: DDPStop | None = None


def in_ddp() -> bool:
    """Whether this process is a rank of a torch.distributed job."""
    return dist.is_available() and dist.is_initialized()


def should_stop() -> bool:
    """Whether every rank stops after this step, its state to be saved: a SIGTERM reached the job
    (module docstring). Call it on every rank after each ``optimizer.step()``."""
    global _STOP
    if _STOP is None:
        _STOP = DDPStop()
    return _STOP.stepped()
