"""N models of one architecture computed as one: the simulated workers' forward and backward in
a single pass of grouped operations, instead of N passes of small ones.

A simulation of 16 workers on batches of 8 otherwise runs sixteen forwards and backwards of 8
samples, each torch operation paying its fixed cost sixteen times (docs/benchmarks.md, "`psgrad simulate`").

``stack_models(models)``:
1. Copies the first model's structure and replaces each layer that holds parameters with one that
   holds all N models' in one tensor, worker after worker along the channels:
   ``Conv2d(C, K, groups=g)`` becomes ``Conv2d(N*C, N*K, groups=N*g)``, ``BatchNorm{1,2}d(C)``
   becomes ``BatchNorm(N*C)`` (statistics per channel are statistics per worker), ``Linear``
   becomes ``StackedLinear`` (one batched matrix product). Layers without parameters (ReLU,
   pooling, flatten, residual additions) act per channel already and stay.
2. Moves every model's parameters and buffers into its slice of the stacked tensors: each model's
   ``param.data`` becomes a view, so whatever changes a model's parameters in place (pulls,
   optimizers, checkpoints) changes the stacked model, and the other way round.
3. Any other layer with parameters or buffers is refused (``StackError``): it may mix workers.

A stacked convolution (``StackedConv2d``) checks on every call whether the N workers' weights are
the same (a parameter server's or alltoall's workers right after a pull). If they are, the layer
pads with zeros and the batch is channels-last, it runs one plain convolution over a view of the
stacked activations in which the workers lie side by side, instead of the grouped one
(``SharedWeights``); the weight gradient stays per worker.

``StackedPass.run(inputs, labels, loss_fn)``: each model's batch goes in along the channels
(``(B, C, ...)`` per model to ``(B, N*C, ...)``), the output comes apart the same way, each
model's loss is its own loss function on its slice, and one backward of their sum leaves every
model's gradient (a view into the stacked gradient) in its ``param.grad``. The first pass checks,
in eval mode on that batch, that the stacked model computes each model's output: a model whose
``forward`` mixes channels (a channel padding or concatenation, say) raises ``StackError``.
"""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from .. import memory
from ..comm.waiting import Idle
from ..metrics import say
from ..models.step import StepStart
from .local import Meeting
from .stacked_layers import StackError, model_tensor, stack_inputs, stack_models
from .world import OtherRankFailed


class StackedPass:
    """The forward and backward of N models as one; see the module docstring."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        self.models = list(models)
        self.stacked = stack_models(self.models)
        self.step_start = StepStart(self.stacked)
        self.params = [
            (tensor, [model_tensor(model, name) for model in self.models])
            for name, tensor in self.stacked.named_parameters()
        ]
        self.counts = [
            (tensor, [model_tensor(model, name) for model in self.models])
            for name, tensor in self.stacked.named_buffers()
            if tensor.dim() == 0
        ]
        self.checked = False

    def check(self, inputs: Sequence[torch.Tensor]) -> None:
        """Raise ``StackError`` unless the stacked model gives each model's own output (eval mode,
        no buffer changes) on ``inputs``."""
        modes = [model.training for model in self.models]
        try:
            with torch.no_grad():
                for model in [*self.models, self.stacked]:
                    model.eval()
                try:
                    out = self.stacked(stack_inputs(inputs))
                except RuntimeError as err:
                    raise StackError(f"the stacked {type(self.models[0]).__name__} fails: {err}") from err
                outs = out.reshape(out.shape[0], len(inputs), -1)
                for i, (model, x) in enumerate(zip(self.models, inputs, strict=True)):
                    own = model(x).reshape(x.shape[0], -1)
                    if own.shape != outs[:, i].shape or not torch.allclose(outs[:, i], own, rtol=1e-3, atol=1e-4):
                        raise StackError(
                            f"the stacked {type(self.models[0]).__name__} does not compute each worker's output "
                            "(its forward mixes channels across workers)"
                        )
        finally:
            for model, mode in zip(self.models, modes, strict=True):
                model.train(mode)
            self.stacked.train(modes[0])
        self.checked = True

    def run(self, inputs: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], loss_fn: Callable) -> list[float]:
        """Every model's loss on its batch; every model's ``param.grad`` set to its gradient."""
        if len({x.shape for x in inputs}) != 1:
            raise StackError("the workers' batches differ in shape")
        if not self.checked:
            self.check(inputs)
        self.step_start(self.models[0].training)
        n = len(inputs)
        out = self.stacked(stack_inputs(inputs))
        outs = out.view(out.shape[0], n, out.shape[1] // n)
        losses = [loss_fn(outs[:, i], y) for i, y in enumerate(labels)]
        torch.stack(losses).sum().backward()
        for stacked, parts in self.params:
            if stacked.grad is None:
                continue
            for part, grad in zip(parts, stacked.grad.reshape(n, *parts[0].shape).unbind(), strict=True):
                part.grad = grad
        for count, parts in self.counts:
            torch._foreach_copy_(parts, [count] * len(parts))
        return [float(loss.detach()) for loss in losses]


class StackedWorkers:
    """The simulated workers' forward and backward, in ``groups`` stacked passes side by side.

    1. Each worker joins with its model and loss function as it sets up (``member(rank).join``).
    2. Each step every worker hands in its batch (``run``) and sleeps; the last to come hands the
       stacked pass to the thread that started the simulation (``serve``) and waits for it on its
       core token; each worker wakes to its loss, its gradients in its ``param.grad``.
       Why that thread: glibc gives each thread a malloc arena, and an arena other than the main
       one unmaps a heap whose memory is all free. A pass run by whichever worker came last
       faulted in its activations afresh most steps (8,000–10,000 page faults a step for 16
       workers of WRN-10-1, against 300 without stacking; a median pass of 418 ms against 351
       with every thread on the main arena, MALLOC_ARENA_MAX=1).
    3. The first pass builds and checks the stacked models. If the models cannot be stacked
       (``StackError``), the simulation says why once and every worker computes its own from then
       on; a step whose batches differ in shape is computed one worker at a time.
    4. With ``groups`` > 1 (one per core) the workers, in rank order, are split into that many
       stacked models of nearly equal size. When the closing worker holds a core for each, they
       run at once, one torch thread each: group 0 on the serving thread, the others on helper
       threads that live as long as the simulation (so each keeps its own malloc arena warm);
       otherwise one after another. Why: the lone worker gains only 1.5–1.7x from a second torch
       thread, two passes side by side nearly 2x (docs/benchmarks.md, "`psgrad simulate`").
    """

    def __init__(self, meeting: Meeting, groups: int = 1) -> None:
        self.meeting = meeting
        self.groups = max(1, min(groups, meeting.members))
        self.joined: dict[int, tuple[nn.Module, Callable]] = {}
        self.stacked: list[StackedPass] | None = None
        self.refused: str | None = None
        self.closed: str | None = None
        self.passes: queue.SimpleQueue[tuple[Future, dict, int]] = queue.SimpleQueue()
        self.helpers = (
            ThreadPoolExecutor(self.groups - 1, thread_name_prefix="psgrad-stacked") if self.groups > 1 else None
        )

    def close(self, reason: str) -> None:
        """Stop the ranks' passes that nobody will run (the simulation was interrupted or ended):
        those handed in and those still to come; let the helper threads go."""
        self.closed = reason
        while not self.passes.empty():
            self.passes.get()[0].set_exception(OtherRankFailed(f"stopping: {reason}"))
        if self.helpers is not None:
            self.helpers.shutdown(wait=False)

    def serve(self, timeout: float) -> None:
        """Run the pass a worker handed in, if one comes within ``timeout`` seconds (the thread
        that started the simulation calls this while the ranks run)."""
        try:
            done, parts, threads = self.passes.get(timeout=timeout)
        except queue.Empty:
            return
        try:
            done.set_result(self._compute(parts, threads))
        except Exception as err:  # handed to the waiting worker
            done.set_exception(err)
        except BaseException:  # Ctrl-C or SIGTERM: the simulation stops; the waiting worker stops with it
            done.set_exception(OtherRankFailed("stopping: interrupted"))
            raise

    def member(self, rank: int) -> StackedMember:
        return StackedMember(self, rank)

    def _pass(self, parts: dict) -> tuple[dict[int, float], float] | None:
        """The closing worker's part: hand the pass to ``serve`` and wait for its result. The pass
        runs with this rank's torch threads times the core tokens it holds: its own and those no
        rank holds now (the other workers sleep meanwhile)."""
        world = self.meeting.world
        borrowed = world.borrow_cores()
        try:
            done: Future = Future()
            self.passes.put((done, parts, torch.get_num_threads() * (1 + borrowed)))
            while True:  # in slices: a pass handed in after ``close`` drained the queue never runs
                try:
                    return done.result(timeout=0.2)
                except futures.TimeoutError:
                    if self.closed is not None:
                        raise OtherRankFailed(f"stopping: {self.closed}") from None
        finally:
            world.return_cores(borrowed)

    def _compute(self, parts: dict, threads: int) -> tuple[dict[int, float], float] | None:
        """Every worker's loss by rank and the pass's seconds, or None: each computes its own."""
        side_by_side = self.groups > 1 and threads >= self.groups
        threads_each = threads // self.groups if side_by_side else threads
        if torch.get_num_threads() != threads_each:
            torch.set_num_threads(threads_each)
        start = time.perf_counter()
        try:
            groups = self._split(parts)
            if self.stacked is None:
                self._check_room([self.joined[rank][0] for rank in parts])
                self.stacked = [StackedPass([self.joined[rank][0] for rank in group]) for group in groups]
            loss_fn = self.joined[next(iter(parts))][1]
            runs = [
                functools.partial(self._run_group, stacked, [parts[rank] for rank in group], loss_fn)
                for stacked, group in zip(self.stacked, groups, strict=True)
            ]
            if side_by_side:
                assert self.helpers is not None
                others = [self.helpers.submit(run) for run in runs[1:]]
                try:
                    losses = runs[0]()
                finally:  # no helper may still be writing gradients when this returns
                    futures.wait(others)
                losses += [loss for other in others for loss in other.result()]
            else:
                losses = [loss for run in runs for loss in run()]
            return dict(zip(parts, losses, strict=True)), time.perf_counter() - start
        except StackError as err:
            for rank in parts:  # a group that ran before another failed has set its gradients
                for param in self.joined[rank][0].parameters():
                    param.grad = None
            if self.stacked is None or not all(stacked.checked for stacked in self.stacked):
                self.refused = str(err)
                say(f"[psgrad] note: each worker computes on its own: {err}")
            return None

    @staticmethod
    def _check_room(models: list[nn.Module]) -> None:
        """Raise ``StackError`` when stacking would leave less memory than ``psgrad.memory``'s floor:
        the stacked copy of every model's parameters and buffers, then the stacked gradients, are
        made in one go by the serving thread, and running out of memory there ends the process
        before anything could say why. One pass per worker instead grows a worker at a time, and
        the simulation's memory watch can stop it between two."""
        params = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
        buffers = sum(b.numel() * b.element_size() for m in models for b in m.buffers())
        needed = 2 * params + buffers  # the stacked parameters and their gradients, the buffers
        short = memory.short_of(needed)
        if short is not None:
            raise StackError(
                f"stacking {len(models)} workers needs {memory.gib(needed)} for their parameters and gradients side "
                f"by side and {memory.gib(short[0])} of memory is left"
            )

    def _split(self, parts: dict) -> list[list[int]]:
        """The workers' ranks in ``self.groups`` runs of nearly equal length, in rank order."""
        ranks = list(parts)
        size, extra = divmod(len(ranks), self.groups)
        bounds = [i * size + min(i, extra) for i in range(self.groups + 1)]
        return [ranks[bounds[i] : bounds[i + 1]] for i in range(self.groups)]

    @staticmethod
    def _run_group(stacked: StackedPass, parts: list, loss_fn: Callable) -> list[float]:
        return stacked.run([images for images, _ in parts], [labels for _, labels in parts], loss_fn)


class StackedMember:
    """One worker's handle on ``StackedWorkers``: what its ``Backprop`` calls."""

    def __init__(self, group: StackedWorkers, rank: int) -> None:
        self.group, self.rank = group, rank
        self.share = 0.0  # seconds: the last pass's time over the workers, each one's compute

    def join(self, model: nn.Module, loss_fn: Callable) -> None:
        self.group.joined[self.rank] = (model, loss_fn)

    def run(self, images: torch.Tensor, labels: torch.Tensor, idle: Idle | None = None) -> float | None:
        """This worker's loss, its gradients in its ``param.grad``; None: compute them yourself."""
        if self.group.refused is not None:
            return None
        result = self.group.meeting.meet(self.rank, (images, labels), self.group._pass, idle)
        if result is None:
            return None
        losses, seconds = result
        self.share = seconds / len(losses)
        return losses[self.rank]
