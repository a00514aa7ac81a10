"""The parameter-server topology: ranks 0..S-1 serve, the others work (``--topology ps``).

A server rank's step is "serve until every layer it owns took step t's gradients"; server 0
also collects the workers' step statistics (the metrics rows) and evaluates. A worker rank's step
is one batch through the servers (engine.worker).
"""

from __future__ import annotations

import time

import torch

from ..comm.protocol import load_buffers_vector
from ..context import Role, RunContext
from .serving import SERVERS
from .worker import Worker


class ServerRole(Role):
    name = "server"

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.server = SERVERS[ctx.cfg.mode](ctx)

    @property
    def doing(self) -> str:
        return self.server.doing

    def start(self) -> None:
        self.server.start()

    def step(self, step: int) -> list[dict]:
        self.server.serve_until(lambda: self.server.has_done(step))
        return self.server.take_rows()

    def evaluate(self, step: int) -> None:
        if self.ctx.rank != 0:
            self.server.send_values(step)
            return
        start = time.perf_counter()
        buffers = self.server.wait_for_evaluation(step)
        self.server.doing = self.ctx.evaluations.doing(step)
        model = self.ctx.evaluations.model()
        self.server.load_model(model, step)  # its own layers and the other servers' for this step
        load_buffers_vector(model, buffers)
        self.ctx.evaluations.start(model, step, time.perf_counter() - start)

    def finish(self) -> list[dict]:
        self.server.finish()
        return self.server.take_rows()

    def params(self) -> dict[str, torch.Tensor]:
        if self.ctx.rank != 0:
            return {}
        model = self.ctx.evaluations.model()
        self.server.load_model(model)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def state_dict(self) -> dict:
        return {"server": self.server.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.server.load_state_dict(state["server"])


class WorkerRole(Role):
    name = "worker"

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.worker = Worker(ctx, ctx.make_feedback())

    @property
    def doing(self) -> str:
        return self.worker.doing

    def start(self) -> None:
        self.worker.post_start_pulls()

    def step(self, step: int) -> list[dict]:
        self.worker.run_step(step)
        return []

    def evaluate(self, step: int) -> None:
        self.worker.send_buffers(step)

    def finish(self) -> list[dict]:
        self.worker.stop()
        return []

    def params(self) -> dict[str, torch.Tensor]:
        return self.worker.final_params()

    def state_dict(self) -> dict:
        return self.worker.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.worker.load_state_dict(state)


def ps_role(ctx: RunContext) -> Role:
    """Server ranks serve, the others work."""
    return ServerRole(ctx) if ctx.layout.is_server(ctx.rank) else WorkerRole(ctx)
