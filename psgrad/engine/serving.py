"""The two serving modes on ``ServerBase`` (psgrad.engine.server, whose docstring states both
algorithms) and the helper thread a colocated rank may serve from.

``SyncServer``: a layer is updated once every worker's gradient of the step is in, summed in
worker order. ``AsyncServer``: each worker's gradient is applied the moment it arrives, and the
parameters go back to that worker unless it ran ``staleness`` steps ahead of the slowest.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext

import torch

from ..codecs import Message
from ..comm.protocol import TAG_MEMORY, Layer, add_code, code_message, skip_update
from ..comm.waiting import Backoff, Patience
from ..context import RunContext
from . import downmemory
from .server import ServerBase


class SyncServer(ServerBase):
    """Every step: the average of all workers' gradients, one update, one reply to all.

    The sum is taken in worker order whatever order the messages arrive in (float addition is not
    associative): a message is decoded the moment every earlier worker's is in, and held until
    then. So a run is bit-for-bit reproducible, and the same on separate or colocated servers.
    """

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.acc = {layer.index: torch.zeros(layer.numel) for layer in self.owned}
        self.count = {layer.index: 0 for layer in self.owned}  # workers summed in so far, in order
        self.held: dict[int, dict[int, Message]] = {layer.index: {} for layer in self.owned}
        self.skipping: set[int] = set()  # layers of this step a worker marked skipped (non-finite)
        # multi-round layers: the open round, its code-space sum, and the replies of earlier rounds
        self.round = {layer.index: 1 for layer in self.owned if self.rounds[layer.index] > 1}
        self.code_sum: dict[int, dict[str, torch.Tensor]] = {}
        self.code_replies: dict[int, dict[int, dict[str, torch.Tensor]]] = {}

    def start(self) -> None:
        super().start()
        if self._keeps_memory():  # the first worker may send this rank's memory to load
            first = self.workers[0]
            self._post(("memory", first), downmemory.memory_bound(self.layers, self.rank), first, TAG_MEMORY)

    def _keeps_memory(self) -> bool:
        """A serving-only rank with a down-link memory: the first worker checkpoints it for this
        rank (engine.downmemory)."""
        return self.mean_feedback is not None and self.rank not in self.workers

    def on_control(self, worker: int, msg: Message) -> bool:
        if self._keeps_memory() and (msg.meta.get("op") == "memory" or msg.layer == downmemory.MEMORY_LAYER):
            if worker != self.workers[0]:
                raise RuntimeError(f"rank {worker} asked for the down-link memory, which only the first worker keeps")
            self.sends.append(
                downmemory.answer(
                    msg,
                    feedback=self.mean_feedback,
                    layers=self.layers,
                    rank=self.rank,
                    worker=worker,
                    transport=self.transport,
                )
            )
            return True
        return super().on_control(worker, msg)

    def _on_grad(self, worker: int, layer: Layer, msg: Message) -> None:
        index = layer.index
        if len(self.active) < self.num_workers:  # a step that can never be complete
            self._stopped_early(stopped=min(set(self.workers) - self.active), step=msg.step)
        if self.sums and self.count[index] == 0 and not self.held[index]:
            # your loop counts the steps: a sum takes the step of its first gradient (a loop that
            # loaded a checkpoint goes on from its step), and every other worker's must match it
            self.layer_step[index] = msg.step
        self._check_grad(worker, layer, msg, expected=self.layer_step[index], round_=self.round.get(index, 0))
        held = self.held[index]
        held[worker] = msg
        start = time.perf_counter()
        while self.count[index] < self.num_workers and self.workers[self.count[index]] in held:
            ready = held.pop(self.workers[self.count[index]])
            if ready.meta.get("skip"):
                self.skipping.add(index)
            if index in self.round:  # summed in code space: the factors add, nothing is decoded
                add_code(self.code_sum.setdefault(index, {}), ready)
            else:
                self._codec(ready).decode_add(ready, self.acc[index], alpha=1.0 / self.num_workers)
            self.count[index] += 1
        self.times["decode"] += time.perf_counter() - start
        if self.count[index] < self.num_workers:
            return
        self.count[index] = 0
        if index in self.round and not self._close_round(layer, msg):
            return
        step, skip = msg.step, index in self.skipping
        if index not in self.round and not self.sums:
            self._apply(layer, self.acc[index], step, skip=skip)
        self.skipping.discard(index)
        self.layer_step[index] += 1
        if index not in self.round:
            if self.sums:
                self._reply_mean(layer, self.acc[index], step=self.layer_step[index], skip=skip)
            else:
                self._reply(layer, self.workers)
            self.acc[index].zero_()
        if all(self.layer_step[i] > msg.step for i in self.layer_step):
            self.completed_step = msg.step

    def _on_stop(self, worker: int) -> None:
        """A worker is done: fine between steps; with a step partly summed, the others would wait
        for ever for its gradients, so it is an error."""
        partial = [index for index in self.count if self.count[index] or self.held[index]]
        if partial:
            self._stopped_early(stopped=worker, step=self.layer_step[partial[0]])
        super()._on_stop(worker)

    def _stopped_early(self, *, stopped: int, step: int) -> None:
        """Raise: a worker stopped while another still sends gradients (your own loop, uneven steps)."""
        raise RuntimeError(
            f"rank {stopped} stopped training before its gradients of step {step}, which the other workers "
            "sent: every worker must take the same number of steps (psgrad.shard(data), or a "
            "DistributedSampler with drop_last=True, gives every worker the same number of batches)"
        )

    def _close_round(self, layer: Layer, msg: Message) -> bool:
        """Reply to a complete round of a multi-round layer; True after its last round, when the
        layer was updated with the gradient the replies stand for."""
        index, round_ = layer.index, self.round[layer.index]
        codec = self._codec(msg)
        reply = codec.reduce(round_, self.code_sum.pop(index), self.num_workers)
        self.code_replies.setdefault(index, {})[round_] = reply
        step = self.layer_step[index] + 1  # the replies bring the workers' layer to this step
        if round_ < self.rounds[index]:
            self.round[index] += 1
            self._deliver(
                layer, code_message(layer, round_, reply, codec=codec, step=step, sender=self.rank), self.workers
            )
            return False
        grad = codec.gradient(self.code_replies.pop(index))
        what = f"step {msg.step}: the gradient sum of {layer.name!r} on server rank {self.rank}"
        skip = skip_update(grad, what, self.cfg.on_nonfinite, index in self.skipping)
        if not self.sums:
            self._apply(layer, grad, msg.step, skip=skip)
        self.round[index] = 1
        self._deliver(
            layer, code_message(layer, round_, reply, codec=codec, step=step, sender=self.rank, skip=skip), self.workers
        )
        return True


class AsyncServer(ServerBase):
    """Each worker's gradient applied on arrival; a worker more than ``staleness`` steps ahead of
    the slowest active one waits for its reply."""

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.worker_count = {w: 0 for w in self.workers}  # layers in for the worker's step
        self.worker_step = {w: ctx.start for w in self.workers}
        self.deferred: set[int] = set()

    def shadow_keys(self) -> list[int]:
        return list(self.workers)

    def _shadow_of(self, layer: Layer, workers: list[int]) -> torch.Tensor:
        return self.shadow[(layer.index, workers[0])]

    def _on_grad(self, worker: int, layer: Layer, msg: Message) -> None:
        self._check_grad(worker, layer, msg, expected=self.worker_step[worker])
        start = time.perf_counter()
        grad = torch.zeros(layer.numel)
        self._codec(msg).decode_add(msg, grad, alpha=1.0 / self.num_workers)
        self.times["decode"] += time.perf_counter() - start
        self._apply(layer, grad, msg.step, skip=bool(msg.meta.get("skip")))
        self.worker_count[worker] += 1
        if self.worker_count[worker] == len(self.owned):
            self.worker_count[worker] = 0
            self.worker_step[worker] += 1
            self.deferred.add(worker)
            self._release()

    def _release(self) -> None:
        """Reply to every deferred worker that is at most ``staleness`` steps ahead of the slowest."""
        slowest = min(self.worker_step[w] for w in self.active) if self.active else 0
        for w in sorted(self.deferred):
            if self.worker_step[w] - slowest <= self.cfg.staleness:
                self.deferred.discard(w)
                for layer in self.owned:
                    self.layer_step[layer.index] = self.worker_step[w]
                    self._reply(layer, [w])
        self.completed_step = max(self.completed_step, min(self.worker_step.values()) - 1)

    def _on_stop(self, worker: int) -> None:
        super()._on_stop(worker)
        self._release()


SERVERS = {"sync": SyncServer, "async": AsyncServer}


class ServingThread:
    """Serves ``server`` from a helper thread (``--serve-thread``, colocated ranks).

    1. ``start`` gives the server a real lock; every other caller (the rank's worker) takes it too.
    2. The thread polls under the lock; when nothing arrived it sleeps with the worker's back-off
       outside the lock, so the worker gets in between.
    3. ``stop`` ends the loop and joins; an exception in the thread is kept and raised there.
    """

    def __init__(self, server: ServerBase) -> None:
        self.server = server
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="psgrad-serve", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self.server.lock = threading.Lock()
        self._thread.start()

    def _loop(self) -> None:
        backoff = Backoff(Patience(spins=0))
        try:
            while not self._stop.is_set():
                with self.server.lock:
                    worked = self.server.poll()
                if worked:
                    backoff.reset()
                else:
                    backoff.idle()
        except BaseException as err:  # raised in the main thread by stop() or check()
            self.error = err

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"serving thread failed: {self.error}") from self.error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.server.lock = nullcontext()
        self.check()
