"""``DistributedOptimizer``: your optimizer, stepping on the mean of every worker's gradient, which
psgrad's engines move coded while your backward pass goes on.

Per step, on each worker:
1. Backward: when a layer's last parameter has its gradient (in the last of
   ``backward_passes_per_step`` passes), the layer is coded (feedback -> codec -> wire) and pushed
   to its server at once (``engine.worker.Worker.push``), as in ``psgrad train``.
2. ``synchronize()``: layers no hook pushed (parameters without a gradient) go now; the worker
   answers the rounds of a multi-round codec (PowerSGD); then each layer's reply is decoded into
   its parameters' ``.grad``: the mean over the workers, coded with ``--down-codec`` (the servers
   keep what it drops for later steps) or exact.
3. ``step()``: ``synchronize()`` (unless inside ``skip_synchronize()``), then your optimizer's
   own ``step``. Clip, unscale (``GradScaler.unscale_``) or log between 2 and 3.
With ``local_steps`` (``psgrad.init``) backward pushes nothing and ``synchronize()`` does nothing:
every H-th ``step()`` exchanges the change since the last exchange instead (``userloop.local``).

Why a wrapper that is a ``torch.optim.Optimizer`` (as Horovod's is), not a model wrapper: the
step is where a loop waits for the mean gradient, and LR schedulers and ``GradScaler`` take an
optimizer. It shares your optimizer's ``param_groups`` and ``state``, so a scheduler built on
either sees the same learning rates.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from torch import nn

from ..comm.protocol import Layer, StepStats, flat_parts
from ..comm.waiting import WAITING
from ..context import down_link_note
from ..devices import outside_autocast
from ..engine import downmemory
from ..engine.serving import SyncServer
from ..engine.worker import Worker
from ..metrics import say
from . import savedstop
from .broadcast import broadcast_parameters
from .local import OuterSteps
from .world import World, context, layer_plan, world


class DistributedOptimizer(torch.optim.Optimizer):
    """``optimizer`` stepping on the workers' mean gradient of ``model``'s trainable parameters
    (see the module docstring). Build it on every worker, after ``psgrad.init``: it copies the
    first worker's parameters and buffers into every other worker's model."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, *, backward_passes_per_step: int = 1):
        # torch.optim.Optimizer.__init__ is not called: the groups and state are optimizer's own
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self._optimizer_state_dict_pre_hooks: dict = {}
        self._optimizer_state_dict_post_hooks: dict = {}
        self._optimizer_load_state_dict_pre_hooks: dict = {}
        self._optimizer_load_state_dict_post_hooks: dict = {}
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}")
        self.optimizer, self.model, self.passes = optimizer, model, backward_passes_per_step
        w: World = world()
        if w.optimizers:
            raise RuntimeError("one DistributedOptimizer per process: psgrad's servers serve one layer plan")
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        if not self.params:
            raise ValueError("the model has no parameter that requires a gradient")
        named = [(name, tuple(p.shape)) for name, p in self.params.items()]
        device = next(iter(self.params.values())).device
        layers = layer_plan(w, named)
        ctx = context(w, model=_Trainable(self.params), layers=layers, device=device)
        self.calls = dict.fromkeys(self.params, 0)  # backward hook calls this step, per parameter
        self.posted = self.synchronized = self.skipping = False
        self.step_index = 0
        self.last_stats = StepStats(step=0)
        # before the worker's own hooks (torch runs a parameter's hooks in the order registered):
        # they read backprop.pushing, which the counting hook sets for the last pass
        self._hooks = [p.register_post_accumulate_grad_hook(self._count(n)) for n, p in self.params.items()]
        self.server = SyncServer(ctx) if w.layout.is_server(w.transport.rank) else None
        # the serving-only ranks whose down-link memory this rank checkpoints: the first worker's
        # job, under ps with a lossy down_codec (engine.downmemory)
        first = w.transport.rank == w.layout.worker_ranks[0]
        note = down_link_note(w.cfg, layers, down=f"down_codec={w.cfg.down_codec!r}") if first else None
        if note is not None:  # the layers are known from here: the first worker says it for the job
            say(f"[psgrad] {note}")
        keeps = first and ctx.make_down_feedback() is not None
        self.memory_servers = [r for r in w.layout.server_ranks if not w.layout.is_worker(r)] if keeps else []
        self.worker = Worker(ctx, ctx.make_feedback(), local=self.server, on_mean=self._take_mean)
        self.set_epoch(0)  # DGC's warm-up starts where psgrad train's does
        if self.server is not None:
            self.server.start()
            # a colocated rank serves its shard between the other ranks' pushes: in the forward
            # pre-hook of every module with parameters (as psgrad train's worker does), as well as
            # in the backward hooks and the waits
            owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
            self._hooks += [m.register_forward_pre_hook(outside_autocast(self._serve, device)) for m in owners]
        w.closers.append(self._close)
        w.optimizers += 1
        self._world, self._stepped = w, time.monotonic()
        w.doing, w.doing_in_psgrad = self._doing, self._doing_in_psgrad
        broadcast_parameters(model.state_dict())  # every worker starts from the first worker's model
        self.local = OuterSteps(w.cfg, self.params, layers) if w.cfg.local_steps else None

    # ------------------------------------------------------------------ what torch sees
    @property
    def param_groups(self):  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self):  # type: ignore[override]
        return self.optimizer.defaults

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    # ------------------------------------------------------------------ the step
    def synchronize(self) -> None:
        """Wait until every layer's mean gradient is in ``.grad`` (idempotent within a step).
        With ``local_steps`` it does nothing: your optimizer steps on this worker's own gradient."""
        if self.synchronized or self.local is not None:
            self.synchronized = True
            return
        self._exchange()

    def _exchange(self) -> None:
        """Push the layers no hook pushed, answer a multi-round codec's rounds, and take every
        layer's reply (``_take_mean``)."""
        worker = self.worker
        self._post()
        worker.backprop.pushing = True
        worker.push_missing()
        while worker.awaiting:
            worker.advance_rounds(only=next(iter(worker.awaiting)))
        worker.transport.wait_all(worker.sends, worker._idle())
        worker.sends = []
        worker.finish_pulls()
        self.synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not synchronize: call ``synchronize()`` before it."""
        self.skipping = True
        try:
            yield
        finally:
            self.skipping = False

    def step(self, closure=None):  # type: ignore[override]
        """Your optimizer's step on the mean gradient (``synchronize()`` first, unless skipped)."""
        if self.skipping and not self.synchronized:
            raise RuntimeError(
                "step() inside skip_synchronize() needs synchronize() first: the gradients are not in yet"
            )
        self.synchronize()
        result = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        if self.local is None or self.local.exchanges_now():
            if self.local is not None:  # this worker's change since the last exchange goes out
                self.local.changes_into_grad()
                self._exchange()
                self.local.outer_step()
            self.last_stats = self.worker.stats  # what the step sent and waited for (psgrad bench)
            self._next_step()
        else:
            self.last_stats = StepStats(step=self.step_index)  # nothing sent
            self._next_local_step()
        now = time.monotonic()  # the watchdog's default timeout grows with the slowest step
        self._world.slowest_step, self._stepped = max(self._world.slowest_step, now - self._stepped), now
        savedstop.stepped()  # the workers' vote on a saved stop, once they asked
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Your optimizer's ``zero_grad``; refused while this step's gradients are on their way."""
        if any(self.calls.values()) and not self.synchronized:
            raise RuntimeError(
                "zero_grad() after backward() but before step() or synchronize(): this step's gradients are "
                "on their way to the servers; call step() (or synchronize()) first"
            )
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def set_epoch(self, epoch: int) -> None:
        """The epoch your loop starts (call it at each one's start): ``dgc_warmup_epochs`` raises
        DGC's sparsity by it, as ``psgrad train`` does; other settings do not follow epochs."""
        self.worker.feedback.set_epoch(epoch)

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("psgrad's layer plan is fixed when the DistributedOptimizer is built: add groups before")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:  # type: ignore[override]
        """Your optimizer's state, and this rank's compression memories (error feedback, PowerSGD's
        factors, a colocated rank's down-link memory; on the first worker, the serving-only ranks'
        down-link memories) and step: save it per rank, between steps."""
        if any(self.calls.values()) and not self.synchronized:
            raise RuntimeError(
                "state_dict() after backward() but before step() or synchronize(): this step's gradients are "
                "on their way to the servers; save after step()"
            )
        return {
            "optimizer": self.optimizer.state_dict(),
            "psgrad": {
                "step": self.step_index,
                "rank": self.worker.transport.rank,
                "ranks": self.worker.transport.size,
                "feedback": self.worker.feedback.state_dict(),
                "server": self.server.state_dict() if self.server is not None else {},
                "server_memory": downmemory.fetch(**self._memory_exchange()) if self.memory_servers else {},
                **({"local": self.local.state_dict()} if self.local is not None else {}),
            },
        }

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        if "psgrad" not in state_dict:
            raise ValueError(
                "not a psgrad.DistributedOptimizer state_dict (no 'psgrad' entry): load it into your optimizer"
            )
        ours = state_dict["psgrad"]
        here = (self.worker.transport.rank, self.worker.transport.size)
        saved = (ours.get("rank", here[0]), ours.get("ranks", here[1]))  # an older psgrad saved neither
        if saved != here:
            # each rank's memories are of its own gradients and its own shard of the layers
            raise ValueError(
                f"this state_dict was saved by rank {saved[0]} of {saved[1]}, and this is rank {here[0]} of "
                f"{here[1]}: load each rank's own (e.g. ckpt-{{psgrad.rank()}}.pt), in a job of as many ranks"
            )
        if (self.local is None) != ("local" not in ours):
            raise ValueError(
                "this state_dict was saved with local_steps " + ("off" if self.local is not None else "on")
                + f", and this job has local_steps={self._world.cfg.local_steps}: load it with the same local_steps"
            )  # fmt: skip
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.worker.feedback.load_state_dict(ours["feedback"])
        if self.server is not None:
            self.server.load_state_dict(ours["server"])
        if self.memory_servers and "server_memory" in ours:  # a state_dict of an older psgrad has none
            downmemory.restore(ours["server_memory"], **self._memory_exchange())
        if self.local is not None:
            self.local.load_state_dict(ours["local"])
        self.step_index = self.worker.step = int(ours["step"])
        self.worker.stats = StepStats(step=self.step_index)

    # ------------------------------------------------------------------ inside
    def _memory_exchange(self) -> dict:
        """What engine.downmemory's exchange with the serving-only ranks needs."""
        return {
            "transport": self.worker.transport,
            "layers": self.worker.layers,
            "servers": self.memory_servers,
            "rank": self.worker.rank,
            "step": self.step_index,
            "idle": self.worker._idle(),
        }

    def _doing(self) -> str:
        """What this worker does, for the watchdog's reports: psgrad's wait, or your loop's code."""
        doing = self.worker.doing  # a wait's own words, "step 9: waiting for 'fc.weight' from rank 0"
        if WAITING.seconds():
            return doing if "waiting" in doing else f"step {self.step_index}: synchronizing"
        return f"step {self.step_index}: in your loop"

    def _doing_in_psgrad(self) -> str:
        """What this worker did when an interrupt stopped it inside psgrad's code: the wait it was
        in (a wait's words stay when it is cut short), or psgrad's hooks (coding, serving)."""
        doing = self.worker.doing
        return doing if "waiting" in doing else f"step {self.step_index}: in psgrad's hooks (coding or serving)"

    def _count(self, name: str):
        """The hook that counts backward passes, and decides whether the worker's hook pushes."""

        def hook(param: torch.Tensor) -> None:
            if self.synchronized:  # the last step ended without step(): GradScaler skipped it
                self._next_step() if self.local is None else self._next_local_step()
            self.calls[name] += 1
            if self.calls[name] > self.passes:
                raise RuntimeError(
                    f"a backward pass more than backward_passes_per_step={self.passes} before step(): "
                    "call step() after each, or raise backward_passes_per_step"
                )
            pushing = self.calls[name] == self.passes and self.local is None  # local steps: step() sends
            self.worker.backprop.pushing = pushing
            if pushing:
                self._post()

        return hook

    def _serve(self, module: nn.Module, inputs: tuple) -> None:
        self.worker.serve()  # returns None: a pre-hook's result would replace the module's inputs

    def _post(self) -> None:
        """Receives for this step's replies, once, before the first push of the step."""
        if not self.posted:
            self.worker.post_pulls(self.step_index + 1)
            self.posted = True

    def _take_mean(self, layer: Layer, flat: torch.Tensor, applied: bool) -> None:
        """A layer's mean gradient into its parameters' ``.grad`` (NaN where a worker's gradient
        was not finite and ``on_nonfinite`` is ``skip``: GradScaler then skips the step)."""
        if self.local is not None:
            self.local.take_mean(layer, flat if applied else None)
            return
        params = [self.params[name] for name in layer.params]
        for param, part in zip(params, flat_parts(flat, params), strict=True):
            if not applied:
                part = torch.full_like(part, float("nan"))
            if param.grad is None:
                param.grad = part.to(param.dtype).clone()
            else:
                param.grad.copy_(part)

    def _next_local_step(self) -> None:
        """With ``local_steps``, between exchanges: the wire's step stays, the backward count restarts."""
        self.calls = dict.fromkeys(self.params, 0)
        self.synchronized = False

    def _next_step(self) -> None:
        self.step_index += 1
        worker = self.worker
        worker.step, worker.sent, worker.stats = self.step_index, set(), StepStats(step=self.step_index)
        worker.gate.reset()
        worker.backprop.pushing = True
        self.calls = dict.fromkeys(self.params, 0)
        self.posted = self.synchronized = False

    def _close(self) -> None:
        """Tell the servers this worker is done; a colocated rank serves on until every rank is."""
        self.worker.stop()  # removes the worker's own hooks
        for handle in self._hooks:
            handle.remove()
        if self.server is not None:
            self.server.finish()


class _Trainable(nn.Module):
    """The trainable parameters of a model under their names (what the engines read of it)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._named = params

    def named_parameters(self, *args, **kwargs):  # type: ignore[override]
        return iter(self._named.items())

    def parameters(self, *args, **kwargs):  # type: ignore[override]
        return iter(self._named.values())

    def named_modules(self, *args, **kwargs):  # type: ignore[override]
        return iter(())

    def named_buffers(self, *args, **kwargs):  # type: ignore[override]
        return iter(())

    def buffers(self, *args, **kwargs):  # type: ignore[override]
        return iter(())
