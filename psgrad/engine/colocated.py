"""Colocated servers (``--topology colocated``): every rank works *and* serves a shard of the layers.

BytePS's answer to the parameter server's extra machine: N ranks, N workers, and each rank owns
about 1/N of the layers (balanced by coded bytes). Per step on each rank:
1. the worker part trains a batch exactly as a worker of ``--topology ps`` does;
2. gradients of layers this rank owns are handed to its own server part as messages, without
   bytes or MPI, and their replies taken from it the same way;
3. the server part decodes, sums, updates and replies whenever the worker part gives it a chance:
   in every backward hook, every forward pre-hook, and every wait (the waits' idle work); with
   ``--serve-thread`` a helper thread polls it as well (one lock keeps the two apart);
4. ``finish`` keeps serving after this rank's last step until every other rank stopped.
Rank 0 also collects the metrics rows and, as server 0 of the ps topology does, evaluates the
servers' values (its own shard's and the others', sent at the evaluation step) with the workers'
averaged BatchNorm statistics, in a copy of the model kept for that.
"""

from __future__ import annotations

import time

import torch

from ..comm.protocol import load_buffers_vector
from ..comm.waiting import Patience
from ..context import Role, RunContext
from .serving import SERVERS, ServingThread
from .worker import Worker


class ColocatedRole(Role):
    name = "server+worker"

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.server = SERVERS[ctx.cfg.mode](ctx)
        self.worker = Worker(ctx, ctx.make_feedback(), local=self.server)
        self.thread = ServingThread(self.server) if ctx.cfg.serve_thread else None
        self.last_step = ctx.start - 1

    @property
    def doing(self) -> str:
        return f"{self.worker.doing} (serving: {self.server.doing})"

    def start(self) -> None:
        self.server.start()
        self.worker.post_start_pulls()
        if self.thread:
            self.thread.start()

    def step(self, step: int) -> list[dict]:
        self.worker.run_step(step)
        self.worker.serve()
        self.last_step = step
        if self.thread:
            self.thread.check()
        with self.server.lock:
            return self.server.take_rows()

    def _serve_until_done(self, step: int) -> None:
        with self.server.lock:
            self.server.serve_until(lambda: self.server.has_done(step), Patience())

    def evaluate(self, step: int) -> None:
        """Like separate servers: the servers' values after ``step`` (not a worker's copy, which a
        lossy --down-codec makes lag), with the workers' averaged BatchNorm statistics, on rank 0."""
        start = time.perf_counter()
        self.worker.send_buffers(step)
        self._serve_until_done(step)
        with self.server.lock:
            if self.ctx.rank != 0:
                self.server.send_values(step)
                return
            buffers = self.server.wait_for_evaluation(step, Patience())
            before, self.worker.doing = self.worker.doing, self.ctx.evaluations.doing(step)
            model = self.ctx.evaluations.model()
            self.server.load_model(model, step)
        load_buffers_vector(model, buffers)
        self.ctx.evaluations.start(model, step, time.perf_counter() - start)
        self.worker.doing = before  # started (in the background) or done (in the loop)

    def finish(self) -> list[dict]:
        self.worker.stop()
        if self.thread:
            self.thread.stop()
        self.server.finish()
        return self.server.take_rows()

    def params(self) -> dict[str, torch.Tensor]:
        return self.worker.final_params()

    def state_dict(self) -> dict:
        # the server part must hold exactly the update of the last step, as a separate server would
        self._serve_until_done(self.last_step)
        with self.server.lock:
            return {**self.worker.state_dict(), "server": self.server.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.worker.load_state_dict(state)
        self.server.load_state_dict(state["server"])
