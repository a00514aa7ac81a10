"""Probe (docs/benchmarks.md, "Session 20" and "Session 21"): could ``psgrad simulate`` put its workers along the
batch instead of stacking them into grouped convolutions?

The batch layout, for N workers of B images with the same weights:
1. every convolution's forward and input gradient is one plain call on all N x B images;
2. each worker's weight gradient is a plain call on its contiguous slice of B images;
3. BatchNorm is one call per worker on its slice (its own statistics);
4. the linear layer's per-worker gradients are one batched matrix product.

The script checks that this gives every worker its own gradients (float64, 3 workers of 4
images), and that so does a fourth way to the weight gradients (one grouped forward convolution,
``as_forward_convolution``), then times, on one torch thread with freed memory kept:
- the weight gradients of WRN-10-1's convolutions, per pass and per layer: one plain call on
  N x B images, N calls on slices, one grouped call as the stacked pass makes it, one grouped
  forward convolution;
- whole forward and backward passes, in alternating rounds: the lone worker on N x B images, the
  batch layout, and psgrad's stacked pass (``psgrad.stacked.StackedPass``).

With ``--two-cores`` (session 22) it times instead what two cores could do: the lone worker on two
torch threads against the workers split into two halves, each half's pass on a thread of its own
(one torch thread each, so the halves run side by side): batch layout, stacked pass, and, as the
bound no per-worker split can beat, a plain pass on each half's images.

    .venv/bin/python launch/batch-layout-probe.py [--workers 16] [--batch-size 8] [--rounds 16] [--two-cores]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from psgrad.allocator import keep_freed_memory
from psgrad.models import build_model
from psgrad.stacked import StackedPass

CHANNELS_LAST = torch.channels_last


def weight_gradient(grad_out, inputs, weight, stride: int, padding: int, groups: int = 1) -> torch.Tensor:
    conf = ([stride, stride], [padding, padding], [1, 1], False, [0, 0], groups)
    return torch.ops.aten.convolution_backward(grad_out, inputs, weight, None, *conf, [False, True, False])[1]


class SlicedConv(torch.autograd.Function):
    """A convolution on the whole batch whose weight gradient is taken per worker, into ``bank``
    (one copy of the weight per worker)."""

    @staticmethod
    def forward(ctx, x, weight, bank, stride, padding, workers):
        ctx.save_for_backward(x, weight)
        ctx.conf = (stride, padding, workers)
        return F.conv2d(x, weight, None, stride, padding)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        stride, padding, workers = ctx.conf
        grad_x = None
        if ctx.needs_input_grad[0]:
            conf = ([stride, stride], [padding, padding], [1, 1], False, [0, 0], 1)
            grad_x = torch.ops.aten.convolution_backward(grad_out, x, weight, None, *conf, [True, False, False])[0]
        xs, gs = x.chunk(workers), grad_out.chunk(workers)
        bank = torch.stack([weight_gradient(g, part, weight, stride, padding) for g, part in zip(gs, xs, strict=True)])
        return grad_x, None, bank, None, None, None


class WorkerConv(nn.Module):
    def __init__(self, conv: nn.Conv2d, workers: int) -> None:
        super().__init__()
        self.conv, self.workers = conv, workers
        self.bank = nn.Parameter(conv.weight.detach().expand(workers, *conv.weight.shape).clone())

    def forward(self, x):
        weight = self.conv.weight.detach()
        return SlicedConv.apply(x, weight, self.bank, self.conv.stride[0], self.conv.padding[0], self.workers)


class WorkerBatchNorm(nn.Module):
    def __init__(self, bn: nn.BatchNorm2d, workers: int) -> None:
        super().__init__()
        self.workers = workers
        self.weight = nn.Parameter(bn.weight.detach().expand(workers, -1).clone())
        self.bias = nn.Parameter(bn.bias.detach().expand(workers, -1).clone())
        self.register_buffer("mean", bn.running_mean.expand(workers, -1).clone())
        self.register_buffer("var", bn.running_var.expand(workers, -1).clone())

    def forward(self, x):
        # unbind, not slicing: a slice's backward writes a zero tensor of the whole batch
        parts = x.view(self.workers, -1, *x.shape[1:]).unbind(0)
        return torch.cat(
            [
                F.batch_norm(part, self.mean[i], self.var[i], self.weight[i], self.bias[i], True, 0.1, 1e-5)
                for i, part in enumerate(parts)
            ]
        )


class WorkerLinear(nn.Module):
    def __init__(self, fc: nn.Linear, workers: int) -> None:
        super().__init__()
        self.workers = workers
        self.weight = nn.Parameter(fc.weight.detach().expand(workers, -1, -1).clone())
        self.bias = nn.Parameter(fc.bias.detach().expand(workers, -1).clone())

    def forward(self, x):
        rows = x.view(self.workers, -1, x.shape[1])
        return torch.baddbmm(self.bias.unsqueeze(1), rows, self.weight.transpose(1, 2)).flatten(0, 1)


WORKER_LAYERS = {nn.Conv2d: WorkerConv, nn.BatchNorm2d: WorkerBatchNorm, nn.Linear: WorkerLinear}


def batch_layout(model: nn.Module, workers: int) -> nn.Module:
    """A copy of ``model`` for ``workers`` workers along the batch (their gradients by layer name)."""
    copied = copy.deepcopy(model)
    for module in list(copied.modules()):
        for name, child in list(module.named_children()):
            if type(child) in WORKER_LAYERS:
                setattr(module, name, WORKER_LAYERS[type(child)](child, workers))
    return copied


def per_worker_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, module in model.named_modules():
        if isinstance(module, WorkerConv):
            grads[f"{name}.weight"] = module.bank.grad
        elif isinstance(module, (WorkerBatchNorm, WorkerLinear)):
            grads[f"{name}.weight"], grads[f"{name}.bias"] = module.weight.grad, module.bias.grad
    return grads


def wrn(dtype=torch.float32) -> nn.Module:
    return build_model("wrn", 10, depth=10, widen_factor=1).to(dtype).to(memory_format=CHANNELS_LAST)


def batch(count: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(count, 3, 32, 32, dtype=dtype).contiguous(memory_format=CHANNELS_LAST)
    return images, torch.randint(0, 10, (count,))


def check(workers: int = 3, size: int = 4) -> None:
    """Every worker's gradients equal those of its own pass (float64)."""
    torch.manual_seed(0)
    model = wrn(torch.float64)
    spread = batch_layout(model, workers)
    images, labels = batch(workers * size, torch.float64)
    F.cross_entropy(spread(images), labels, reduction="sum").div(size).backward()
    grads = per_worker_gradients(spread)
    for i, (x, y) in enumerate(zip(images.chunk(workers), labels.chunk(workers), strict=True)):
        own = copy.deepcopy(model)
        F.cross_entropy(own(x), y).backward()
        for name, param in own.named_parameters():
            torch.testing.assert_close(grads[name.replace(".conv.", ".")][i], param.grad, rtol=1e-9, atol=1e-12)
    print(f"check: each of {workers} workers' gradients equal its own pass's (float64)")
    for cin, cout, pixels, stride, kernel in [(3, 5, 8, 1, 3), (4, 6, 8, 2, 3), (4, 6, 8, 2, 1)]:
        x = torch.randn(workers * size, cin, pixels, pixels, dtype=torch.float64)
        g = torch.randn(workers * size, cout, pixels // stride, pixels // stride, dtype=torch.float64)
        w = torch.zeros(cout, cin, kernel, kernel, dtype=torch.float64)
        slices = [
            weight_gradient(gi, xi, w, stride, kernel // 2)
            for gi, xi in zip(g.chunk(workers), x.chunk(workers), strict=True)
        ]
        torch.testing.assert_close(
            as_forward_convolution(g, x, kernel, stride, kernel // 2, workers), torch.cat(slices), rtol=1e-9, atol=1e-12
        )
    print("check: the forward convolution's weight gradients equal the per-worker ones (float64, strides 1 and 2)")


def as_forward_convolution(g, x, kernel: int, stride: int, padding: int, workers: int) -> torch.Tensor:
    """Every worker's weight gradient as one grouped *forward* convolution (session 21): the
    input channels play the batch, each worker's images the channels, and its output gradient
    the kernel (dilated by the stride). Returns (workers x cout, cin, k, k).

    1. x (N·B, cin, H, W) -> (cin, N·B, H, W): one "image" per input channel.
    2. g (N·B, cout, H', W') -> (N·cout, B, H', W'): worker n's output channels, its B images as channels.
    3. conv2d with groups N, padding p, dilation s, cropped to k x k; transposed to (N·cout, cin, k, k)."""
    cin, cout, size = x.shape[1], g.shape[1], x.shape[0] // workers
    images = x.transpose(0, 1).contiguous()
    kernels = g.transpose(0, 1).reshape(cout, workers, size, *g.shape[2:]).transpose(0, 1)
    kernels = kernels.reshape(workers * cout, size, *g.shape[2:]).contiguous()
    out = F.conv2d(images, kernels, None, 1, padding, stride, workers)[:, :, :kernel, :kernel]
    return out.transpose(0, 1).reshape(workers * cout, cin, kernel, kernel)


def weight_gradient_ways(x, g, w, xg, gg, wg, stride: int, padding: int, workers: int) -> dict:
    """The ways to time: one plain call, one plain call per worker's slice, one grouped call, one
    grouped forward convolution."""
    kernel = w.shape[-1]
    return {
        "plain, whole batch": lambda: weight_gradient(g, x, w, stride, padding),
        "per worker, slices": lambda: [
            weight_gradient(gi, xi, w, stride, padding)
            for gi, xi in zip(g.chunk(workers), x.chunk(workers), strict=True)
        ],
        "grouped": lambda: weight_gradient(gg, xg, wg, stride, padding, groups=workers),
        "forward convolution": lambda: as_forward_convolution(g, x, kernel, stride, padding, workers),
    }


def time_weight_gradients(workers: int, size: int, rounds: int) -> None:
    """ms per pass over WRN-10-1's convolutions: (cin, cout, pixels, stride, kernel)."""
    layers = [(3, 16, 32, 1, 3), (16, 16, 32, 1, 3), (16, 16, 32, 1, 3), (16, 32, 32, 2, 3), (32, 32, 16, 1, 3)]
    layers += [(16, 32, 32, 2, 1), (32, 64, 16, 2, 3), (64, 64, 8, 1, 3), (32, 64, 16, 2, 1)]
    names = ["plain, whole batch", "per worker, slices", "grouped", "forward convolution"]
    totals: dict[str, list[float]] = {name: [] for name in names}
    by_layer: dict[tuple, dict[str, list[float]]] = {layer: {name: [] for name in names} for layer in layers}
    for _ in range(rounds):
        spent = dict.fromkeys(totals, 0.0)
        for cin, cout, pixels, stride, kernel in layers:
            out = pixels // stride
            x = torch.randn(workers * size, cin, pixels, pixels).contiguous(memory_format=CHANNELS_LAST)
            g = torch.randn(workers * size, cout, out, out).contiguous(memory_format=CHANNELS_LAST)
            w = torch.randn(cout, cin, kernel, kernel).contiguous(memory_format=CHANNELS_LAST)
            xg = torch.randn(size, workers * cin, pixels, pixels).contiguous(memory_format=CHANNELS_LAST)
            gg = torch.randn(size, workers * cout, out, out).contiguous(memory_format=CHANNELS_LAST)
            wg = torch.randn(workers * cout, cin, kernel, kernel).contiguous(memory_format=CHANNELS_LAST)
            calls = weight_gradient_ways(x, g, w, xg, gg, wg, stride, kernel // 2, workers)
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                took = time.perf_counter() - start
                spent[name] += took
                by_layer[cin, cout, pixels, stride, kernel][name].append(took * 1e3)
        for name in totals:
            totals[name].append(spent[name] * 1e3)
    for name, values in totals.items():
        print(f"weight gradients, {name}: {statistics.median(values):.1f} ms a pass (median of {rounds})")
    print("per layer (cin, cout, pixels, stride, kernel), ms: " + " / ".join(names))
    for layer, spent_by in by_layer.items():
        print(f"  {layer}: " + " / ".join(f"{statistics.median(spent_by[name]):.2f}" for name in names))


def time_passes(workers: int, size: int, rounds: int) -> None:
    torch.manual_seed(0)
    model = wrn()
    spread = batch_layout(model, workers)
    models = [copy.deepcopy(model) for _ in range(workers)]
    stacked = StackedPass(models)
    images, labels = batch(workers * size)
    parts = [x.contiguous(memory_format=CHANNELS_LAST) for x in images.chunk(workers)]

    def lone():
        for p in model.parameters():
            p.grad = None
        F.cross_entropy(model(images), labels).backward()

    def along_the_batch():
        for p in spread.parameters():
            p.grad = None
        F.cross_entropy(spread(images), labels, reduction="sum").div(size).backward()

    def stacked_pass():
        for m in models:
            for p in m.parameters():
                p.grad = None
        stacked.run(parts, list(labels.chunk(workers)), F.cross_entropy)

    ways = {"lone worker": lone, "batch layout": along_the_batch, "stacked pass": stacked_pass}
    spent: dict[str, list[float]] = {name: [] for name in ways}
    for way in [*ways.values(), *ways.values()]:  # warm-up
        way()
    for _ in range(rounds):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            spent[name].append((time.perf_counter() - start) * 1e3)
    alone = spent["lone worker"]
    print(f"lone worker on {workers * size} images: {statistics.median(alone):.1f} ms a forward and backward")
    for name in ("batch layout", "stacked pass"):
        ratio = statistics.median(b / a for a, b in zip(alone, spent[name], strict=True))
        print(f"{name}: {statistics.median(spent[name]):.1f} ms, {ratio:.3f}x the lone worker (median per round)")


def time_two_cores(workers: int, size: int, rounds: int) -> None:
    """The lone worker on two threads against two halves of the workers side by side."""
    torch.manual_seed(0)
    model = wrn()
    images, labels = batch(workers * size)
    half = workers // 2
    halves = []
    for part, part_labels in zip(images.chunk(2), labels.chunk(2), strict=True):
        part = part.contiguous(memory_format=CHANNELS_LAST)
        stacked_models = [copy.deepcopy(model) for _ in range(half)]
        halves.append(
            {
                "images": part,
                "labels": part_labels,
                "spread": batch_layout(model, half),
                "stacked_models": stacked_models,
                "stacked": StackedPass(stacked_models),
                "plain": copy.deepcopy(model),
            }
        )

    def clear(modules) -> None:
        for module in modules:
            for p in module.parameters():
                p.grad = None

    def along_the_batch(h: dict) -> None:
        clear([h["spread"]])
        F.cross_entropy(h["spread"](h["images"]), h["labels"], reduction="sum").div(size).backward()

    def stacked_pass(h: dict) -> None:
        clear(h["stacked_models"])
        parts = [x.contiguous(memory_format=CHANNELS_LAST) for x in h["images"].chunk(half)]
        h["stacked"].run(parts, list(h["labels"].chunk(half)), F.cross_entropy)

    def plain_pass(h: dict) -> None:
        clear([h["plain"]])
        F.cross_entropy(h["plain"](h["images"]), h["labels"]).backward()

    def lone() -> None:
        clear([model])
        F.cross_entropy(model(images), labels).backward()

    pool = ThreadPoolExecutor(2)

    def side_by_side(way):
        return lambda: list(pool.map(way, halves))

    ways = {
        "lone worker, 2 threads": (2, lone),
        "halves side by side, batch layout": (1, side_by_side(along_the_batch)),
        "halves side by side, stacked pass": (1, side_by_side(stacked_pass)),
        "halves side by side, plain pass (the bound)": (1, side_by_side(plain_pass)),
    }

    def time_rounds(count: int) -> dict[str, list[float]]:
        spent: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(count):
            for name, (threads, way) in ways.items():
                torch.set_num_threads(threads)
                start = time.perf_counter()
                way()
                spent[name].append((time.perf_counter() - start) * 1e3)
        return spent

    time_rounds(2)  # warm-up
    spent = time_rounds(rounds)
    alone = spent["lone worker, 2 threads"]
    print(f"lone worker on {workers * size} images, 2 threads: {statistics.median(alone):.1f} ms")
    for name, values in list(spent.items())[1:]:
        ratio = statistics.median(b / a for a, b in zip(alone, values, strict=True))
        print(f"{name}: {statistics.median(values):.1f} ms, {ratio:.3f}x the lone worker (median per round)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=16, help="simulated workers")
    parser.add_argument("--batch-size", type=int, default=8, help="images per worker")
    parser.add_argument("--rounds", type=int, default=16, help="alternating rounds of every timing")
    parser.add_argument("--two-cores", action="store_true", help="time two halves side by side instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    if args.two_cores:
        time_two_cores(args.workers, args.batch_size, args.rounds)
        return
    check()
    time_weight_gradients(args.workers, args.batch_size, args.rounds)
    time_passes(args.workers, args.batch_size, args.rounds)


if __name__ == "__main__":
    main()
