"""The memory layout of image batches in forward and backward (``--memory-format``).

On CPU, oneDNN's convolutions run faster on channels-last (NHWC) inputs than on PyTorch's default
contiguous (NCHW) ones: one thread, forward and backward, channels-last took 0.77x the time of
contiguous for WRN-10-1 at batch 128, 0.82x for ResNet-20, 0.92x for WRN-16-4 and ResNet9, 0.94x
for AlexNet (docs/benchmarks.md, "Smaller measurements"). In contiguous layout oneDNN hands back
the input gradient of strided convolutions channels-last anyway and torch copies it back.

1. ``memory_format(name, device)``: ``auto`` is channels-last on CPU and contiguous elsewhere
   (channels-last pays on GPUs mostly with mixed precision); the other names choose.
2. ``in_layout(batch, fmt)``: every 4-D tensor of ``batch`` (a tensor, or tuples, lists and dicts
   of them) in that layout; other tensors and values are left as they are. Convolutions then run
   in the batch's layout and keep it, so the parameters stay contiguous.
3. ``layout_of(tensor)``: the layout a batch is in (``psgrad simulate``'s stacked pass stacks the
   workers' batches in it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..choices import MEMORY_FORMATS


def memory_format(name: str, device: torch.device) -> torch.memory_format:
    """The layout ``--memory-format name`` means on ``device``."""
    if name not in MEMORY_FORMATS:
        raise ValueError(f"memory format must be one of {', '.join(MEMORY_FORMATS)}, got {name!r}")
    if name == "channels-last" or (name == "auto" and device.type == "cpu"):
        return torch.channels_last
    return torch.contiguous_format


def layout_of(tensor: torch.Tensor) -> torch.memory_format:
    """Channels-last if ``tensor`` is a 4-D tensor laid out so (and not also contiguous), else
    contiguous."""
    if tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def map_tensors(batch, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``batch`` (a tensor, or tuples, lists and dicts of them: inputs need not be one tensor) with
    ``fn`` applied to every tensor, the structure kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {key: map_tensors(value, fn) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(value, fn) for value in batch)
    return batch


def in_layout(batch, fmt: torch.memory_format):
    """``batch`` with each 4-D tensor in layout ``fmt``."""
    return map_tensors(batch, lambda tensor: tensor.contiguous(memory_format=fmt) if tensor.dim() == 4 else tensor)
