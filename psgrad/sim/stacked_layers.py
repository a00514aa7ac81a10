"""The stacked layers: N models of one architecture as one model whose every layer holds all N
models' parameters, worker after worker along the channels (``stack_models``; psgrad.sim.stacked
states the algorithm), and their inputs stacked the same way (``stack_inputs``)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from ..models.layout import in_layout, layout_of

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
            parts = [model_tensor(model, name) for model in models]
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


def model_tensor(model: nn.Module, name: str) -> torch.Tensor:
    module, _, attribute = name.rpartition(".")
    return getattr(model.get_submodule(module), attribute)


def stack_inputs(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(B, C, ...)`` from each of N models to ``(B, N*C, ...)``: model i's channels i-th, in the
    first part's memory layout (channels-last images stay channels-last)."""
    first = parts[0]
    stacked = torch.stack(list(parts), 1).reshape(first.shape[0], len(parts) * first.shape[1], *first.shape[2:])
    return in_layout(stacked, layout_of(first))
