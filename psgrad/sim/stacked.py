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

import copy
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
from ..models.layout import in_layout, layout_of
from ..models.step import StepStart
from .local import Meeting, OtherRankFailed

_STACKABLE = (nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d, nn.Linear)


class StackError(ValueError):
    """These models cannot be computed as one stacked model."""


class StackedLinear(nn.Module):
    """N ``Linear(in, out)`` layers: input ``(..., N*in)``, output ``(..., N*out)``, worker-major."""

    def __init__(self, n: int, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.n, self.in_features, self.out_features = n, in_features, out_features
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(n, out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.n, self.in_features).transpose(0, 1)  # (N, rows, in)
        if self.bias is None:
            out = torch.bmm(rows, self.weight.transpose(1, 2))
        else:
            out = torch.baddbmm(self.bias.unsqueeze(1), rows, self.weight.transpose(1, 2))
        return out.transpose(0, 1).reshape(*lead, self.n * self.out_features)


class StackedConv2d(nn.Conv2d):
    """N ``Conv2d`` layers as one grouped convolution over the workers' channels, worker-major.

    When every worker holds the same weights (a parameter server's or alltoall's workers right
    after a pull), the layer pads with zeros and the input is channels-last, it computes forward
    and input gradient as one plain convolution instead (``SharedWeights``): oneDNN's grouped
    convolutions with 16 channels per group took twice the time of the plain ones in NHWC
    (docs/benchmarks.md, "`psgrad simulate`")."""

    def __init__(self, n: int, layer: nn.Conv2d) -> None:
        super().__init__(
            n * layer.in_channels, n * layer.out_channels, layer.kernel_size, layer.stride, layer.padding,
            layer.dilation, n * layer.groups, layer.bias is not None, layer.padding_mode,
        )  # fmt: skip
        self.n = n
        shares = self.padding_mode == "zeros" and not isinstance(self.padding, str)
        self.one_workers = _OneWorkersConvolution(self) if shares else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_workers is not None and x.is_contiguous(memory_format=torch.channels_last) and self._same_weights():
            return SharedWeights.apply(x, self.weight, self.bias, self)
        return super().forward(x)

    def _same_weights(self) -> bool:
        return all(
            torch.equal(per_worker[1:], per_worker[:1].expand_as(per_worker[1:]))
            for per_worker in (t.view(self.n, -1) for t in (self.weight, self.bias) if t is not None)
        )


class _OneWorkersConvolution:
    """One plain convolution, with one worker's weights, that computes all N workers of a stacked
    channels-last ``(B, N*C, H, W)`` tensor: a view of the stacked memory (``into``; ``back`` views
    its result as stacked again) and the convolution's settings over it. Neither view copies.

    1. Stride 1 (``wide``): the memory is a ``(B, C, H, W*N)`` image, worker n's pixel (h, w) at
       width w*N + n. The width's dilation and padding multiplied by N make each output pixel
       read only its own worker's neighbours and zero padding.
    2. Any stride (``five_d``): the memory is a channels-last ``(B, C, H, W, N)`` volume; a 3-D
       convolution with a kernel one worker deep and stride 1 along the workers.
    Both give the same values. For stride 1 the wide one was 4 % faster over a WRN-10-1 pass; for
    stride 2 only the 3-D one exists, and it is faster than the grouped convolution (forward
    4.9 against 7.6 ms, input gradient 7.5 against 9.6 on the first strided 3x3 of WRN-10-1 at
    16 x 8 images)."""

    def __init__(self, layer: StackedConv2d) -> None:
        self.n, self.groups = layer.n, layer.groups // layer.n
        (ph, pw), (dh, dw) = layer.padding, layer.dilation
        self.five_d = layer.stride != (1, 1)
        if self.five_d:
            self.into, self.back = self._five_d, self._stacked_from_five_d
            self.stride, self.padding, self.dilation = [*layer.stride, 1], [ph, pw, 0], [dh, dw, 1]
        else:
            self.into, self.back = self._wide, self._stacked_from_wide
            self.stride, self.padding, self.dilation = [1, 1], [ph, pw * self.n], [dh, dw * self.n]

    def weight(self, stacked_weight: torch.Tensor) -> torch.Tensor:
        """Worker 0's slice of the stacked weight, shaped for this convolution."""
        weight = stacked_weight[: stacked_weight.shape[0] // self.n]
        return weight.unsqueeze(-1) if self.five_d else weight

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Every worker's output, from the stacked ``weight`` and ``bias`` (worker 0's slices are used)."""
        if bias is not None:
            bias = bias[: bias.shape[0] // self.n]
        out = torch.convolution(
            self.into(x), self.weight(weight), bias, self.stride, self.padding, self.dilation, False,
            [0] * len(self.stride), self.groups,
        )  # fmt: skip
        return self.back(out)

    def input_gradient(self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        grad_x = torch.ops.aten.convolution_backward(
            self.into(grad), self.into(x), self.weight(weight), None, self.stride, self.padding, self.dilation,
            False, [0] * len(self.stride), self.groups, [True, False, False],
        )[0]  # fmt: skip
        return self.back(grad_x)

    def _wide(self, x: torch.Tensor) -> torch.Tensor:
        b, channels, h, w = x.shape
        return x.permute(0, 2, 3, 1).view(b, h, w * self.n, channels // self.n).permute(0, 3, 1, 2)

    def _stacked_from_wide(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last)
        b, channels, h, wide = x.shape
        return x.permute(0, 2, 3, 1).view(b, h, wide // self.n, self.n * channels).permute(0, 3, 1, 2)

    def _five_d(self, x: torch.Tensor) -> torch.Tensor:
        b, channels, h, w = x.shape
        return x.permute(0, 2, 3, 1).view(b, h, w, self.n, channels // self.n).permute(0, 4, 1, 2, 3)

    def _stacked_from_five_d(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last_3d)
        b, channels, h, w, n = x.shape
        return x.permute(0, 2, 3, 4, 1).view(b, h, w, n * channels).permute(0, 3, 1, 2)


class SharedWeights(torch.autograd.Function):
    """A stacked convolution whose N workers hold the same weights, as one plain one.

    1. Forward: ``_OneWorkersConvolution`` with worker 0's weights computes every worker's
       output, in the stacked layout.
    2. Backward: the input gradient is that convolution's, the same way; the weight gradient
       must stay per worker, so it is the grouped convolution's (and the bias's a sum per
       channel)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: StackedConv2d):
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.has_bias = layer, bias is not None
        out = layer.one_workers.forward(x, weight, bias)
        # a view returned from here may not be changed in place (AlexNet's ReLU(inplace=True) does)
        return _own(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        layer: StackedConv2d = ctx.layer
        grad = grad.contiguous(memory_format=torch.channels_last)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # a view keeps its base alive, a second reference to the memory: autograd would add a
            # second gradient to it out of place (an 8 MB copy), where it adds to a tensor of its own in place
            grad_x = _own(layer.one_workers.input_gradient(grad, x, weight))
        if ctx.needs_input_grad[1]:
            grad_w = torch.ops.aten.convolution_backward(
                grad, x, weight, None, list(layer.stride), list(layer.padding), list(layer.dilation), False,
                [0, 0], layer.groups, [False, True, False],
            )[1]  # fmt: skip
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum((0, 2, 3))
        return grad_x, grad_w, grad_b, None


def _own(view: torch.Tensor) -> torch.Tensor:
    """The same memory as a tensor of its own, not a view. (Through ``set_(tensor)``: a Python
    storage object, ``untyped_storage()``, would hold a second reference to the memory.)"""
    own = view.new_empty(0).set_(view)
    return own.as_strided_(view.shape, view.stride(), view.storage_offset())


def _stacked_layer(layer: nn.Module, n: int) -> nn.Module:
    """An empty layer with the room of ``n`` copies of ``layer``."""
    if isinstance(layer, nn.Conv2d):
        return StackedConv2d(n, layer)
    if isinstance(layer, nn.Linear):
        return StackedLinear(n, layer.in_features, layer.out_features, layer.bias is not None)
    return type(layer)(n * layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats)


def stack_models(models: Sequence[nn.Module]) -> nn.Module:
    """One model that computes all of ``models`` (same architecture) at once; see the module
    docstring. Afterwards the models' parameters and buffers live in the stacked model's."""
    n = len(models)
    stacked = copy.deepcopy(models[0])
    for name, layer in list(stacked.named_modules()):
        own = [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]
        if not own:
            continue
        if type(layer) not in _STACKABLE:
            raise StackError(f"layer {name!r} ({type(layer).__name__}) has parameters and is not one of {_names()}")
        parent, _, attribute = name.rpartition(".")
        like = own[0][1]
        setattr(stacked.get_submodule(parent), attribute, _stacked_layer(layer, n).to(like.device, like.dtype))
    with torch.no_grad():
        for name, tensor in [*stacked.named_parameters(), *stacked.named_buffers()]:
            parts = [_tensor(model, name) for model in models]
            if tensor.dim() == 0:  # a BatchNorm's batch count: the same on every worker
                tensor.copy_(parts[0])
                continue
            per_model = tensor.view(n, *parts[0].shape)
            for i, part in enumerate(parts):
                per_model[i].copy_(part)
                part.data = per_model[i]
    return stacked


def _names() -> str:
    return ", ".join(t.__name__ for t in _STACKABLE)


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    module, _, attribute = name.rpartition(".")
    return getattr(model.get_submodule(module), attribute)


def stack_inputs(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(B, C, ...)`` from each of N models to ``(B, N*C, ...)``: model i's channels i-th, in the
    first part's memory layout (channels-last images stay channels-last)."""
    first = parts[0]
    stacked = torch.stack(list(parts), 1).reshape(first.shape[0], len(parts) * first.shape[1], *first.shape[2:])
    return in_layout(stacked, layout_of(first))


class StackedPass:
    """The forward and backward of N models as one; see the module docstring."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        self.models = list(models)
        self.stacked = stack_models(self.models)
        self.step_start = StepStart(self.stacked)
        self.params = [
            (tensor, [_tensor(model, name) for model in self.models])
            for name, tensor in self.stacked.named_parameters()
        ]
        self.counts = [
            (tensor, [_tensor(model, name) for model in self.models])
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
