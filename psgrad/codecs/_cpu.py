"""The codecs' CPU kernels: numpy over cache-sized blocks.

A layer of 4 M fp32 elements is 16 MB, larger than any cache here, and every full-size
temporary (``abs(x)``, a bool mask, a tensor of uniforms) is another trip through memory and,
above glibc's mmap threshold, thousands of fresh page faults per call. These kernels walk the
tensor in blocks of ``BLOCK`` elements instead: each block's temporaries live in small buffers
that stay in L2, and only the outputs are full-size. numpy because its comparisons, ``abs``,
``packbits`` and casts run several times faster than torch's on this CPU build (measured,
torch 2.13 CPU, one thread). Codecs call these for CPU tensors and keep torch code for others.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import warnings
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import torch

from ._buckets import per_bucket_cpu

BLOCK = 1 << 16
"""Elements per block: 256 KB of fp32, so a block and its temporaries fit in L2."""

# row b = the 8 bits (0.0 / 1.0) that packed byte b stands for, most significant first
BIT_ROWS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32)
# row b = the 8 signs (+1.0 / -1.0): a set bit means negative
SIGN_ROWS = 1.0 - 2.0 * BIT_ROWS
_ONE = np.uint32(0x3F80_0000)  # the bits of 1.0f: OR-ed under 23 random mantissa bits gives [1, 2)


_F = TypeVar("_F", bound=Callable)


def _load_compiled():
    """The compiled kernels, or None: ``PSGRAD_KERNELS=numpy``, or the install had no compiler."""
    choice = os.environ.get("PSGRAD_KERNELS", "compiled")
    if choice not in ("compiled", "numpy"):
        warnings.warn(f"PSGRAD_KERNELS={choice!r} is neither 'compiled' nor 'numpy'; using compiled", stacklevel=2)
    if choice == "numpy":
        return None
    try:  # by name: an extension module, which the import-graph checks do not see as a file
        return importlib.import_module(f"{__package__}._kernels")
    except ImportError:
        return None


compiled = _load_compiled()
"""The compiled kernels' module when they run, else None (tests set it to None for numpy's)."""


def kernels_name() -> str:
    """Which kernels run, for reports: "compiled" or "numpy"."""
    return "compiled" if compiled is not None else "numpy"


def native(*arrays: np.ndarray) -> bool:
    """Whether the compiled kernels can take these arrays: they run, every array is C-contiguous
    (the kernels read raw memory) and every floating-point one is float32 (the C type they read)."""
    return compiled is not None and all(
        a.flags.c_contiguous and (a.dtype.kind != "f" or a.dtype == np.float32) for a in arrays
    )


def quiet(fn: _F) -> _F:
    """Run ``fn`` with numpy's floating-point warnings off: a non-finite gradient is the training
    loop's business (``--on-nonfinite``), and torch, which these kernels replace, never warned."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def host(t: torch.Tensor) -> np.ndarray:
    """A tensor's memory as numpy, shared when it is on the CPU. Detached: decode_add also writes
    into parameters that require grad (under no_grad), and ``numpy()`` refuses those."""
    return t.detach().cpu().numpy()


def _block_size(multiple: int) -> int:
    """The largest multiple of ``multiple`` not above BLOCK (at least ``multiple``)."""
    return max(multiple, BLOCK // multiple * multiple)


def blocks(n: int, multiple: int = 8) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive blocks covering ``range(n)``; every block but the last
    holds a multiple of ``multiple`` elements (8 keeps packed bits byte-aligned)."""
    step = _block_size(multiple)
    for start in range(0, n, step):
        yield start, min(n, start + step)


def block_buffer(n: int, dtype, multiple: int = 8) -> np.ndarray:
    """A scratch buffer for one block of a tensor of ``n`` elements."""
    return np.empty(min(n, _block_size(multiple)), dtype=dtype)


@quiet
def negative_bits(x: np.ndarray, with_l1: bool = False) -> tuple[np.ndarray, float]:
    """One bit per element, set where ``x < 0``, packed 8 to a byte (most significant first);
    with ``with_l1`` also the sum of ``|x|`` (float64 across blocks), in the same pass."""
    n = x.size
    packed = np.empty((n + 7) // 8, dtype=np.uint8)
    if native(x):
        l1 = compiled.negative_bits(x, packed)
        return packed, l1 if with_l1 else 0.0
    negative = block_buffer(n, np.bool_)
    magnitude = block_buffer(n, np.float32) if with_l1 else None
    ones = np.ones_like(magnitude) if with_l1 else None
    l1 = 0.0
    for start, stop in blocks(n):
        block, count = x[start:stop], stop - start
        np.less(block, 0, out=negative[:count])
        packed[start // 8 : (stop + 7) // 8] = np.packbits(negative[:count])
        if magnitude is not None:  # a BLAS dot with ones sums twice as fast as numpy's sum here
            l1 += float(np.dot(np.abs(block, out=magnitude[:count]), ones[:count]))
    return packed, l1


@quiet
def add_bits(packed: np.ndarray, out: np.ndarray, if_set: float, if_clear: float) -> None:
    """``out[i] += if_set`` where bit i of ``packed`` is set, else ``if_clear`` (sign: -s / +s; a
    TernGrad plane: +-s / 0). In numpy a 256 x 8 table turns each packed byte into its 8 values
    at once, one block at a time (no full-size temporary)."""
    n = out.size
    if native(packed, out):
        compiled.add_bits(packed, if_set, if_clear, out)
        return
    rows = np.where(BIT_ROWS > 0, np.float32(if_set), np.float32(if_clear))  # 2,048 values, not n
    values = np.empty((min(n, BLOCK) + 7) // 8 * 8, dtype=np.float32)
    for start, stop in blocks(n):
        count, nbytes = stop - start, (stop - start + 7) // 8
        # mode="wrap" skips numpy's per-index bounds check (a byte cannot leave a 256-row table)
        block = np.take(
            rows, packed[start // 8 : start // 8 + nbytes], axis=0, out=values[: 8 * nbytes].reshape(-1, 8), mode="wrap"
        )
        target = out[start:stop]
        np.add(target, block.reshape(-1)[:count], out=target)


@quiet
def negative_bits_and_means(x: np.ndarray, bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`negative_bits`, and the mean ``|x|`` of every bucket of ``bucket`` elements (the last
    may be short) from the same block while it is in cache: a BLAS product with a 1/bucket column."""
    n, multiple = x.size, math.lcm(bucket, 8)
    packed, means = np.empty((n + 7) // 8, dtype=np.uint8), np.empty(-(-n // bucket), dtype=np.float32)
    if native(x):
        compiled.negative_bits_means(x, bucket, packed, means)
        return packed, means
    negative, magnitude = block_buffer(n, np.bool_, multiple), block_buffer(n, np.float32, multiple)
    column = np.full(bucket, 1.0 / bucket, dtype=np.float32)
    for start, stop in blocks(n, multiple):
        block, count, first = x[start:stop], stop - start, start // bucket
        packed[start // 8 : (stop + 7) // 8] = np.packbits(np.less(block, 0, out=negative[:count]))
        magnitude_block = np.abs(block, out=magnitude[:count])
        full = count // bucket * bucket
        if full:
            np.dot(magnitude_block[:full].reshape(-1, bucket), column, out=means[first : first + full // bucket])
        if full < count:
            means[first + full // bucket] = magnitude_block[full:].mean()
    return packed, means


@quiet
def add_signs_per_bucket(packed: np.ndarray, out: np.ndarray, factors: np.ndarray, bucket: int) -> None:
    """``out[i] += factors[i // bucket] * (-1 if bit i is set else +1)``, block by block through the
    256 x 8 sign table (as :func:`add_bits`), each block's signs scaled by its buckets' factors."""
    n, multiple = out.size, math.lcm(bucket, 8)
    if native(packed, out, factors):
        compiled.add_signs_per_bucket(packed, factors, bucket, out)
        return
    values = np.empty((min(n, _block_size(multiple)) + 7) // 8 * 8, dtype=np.float32)
    for start, stop in blocks(n, multiple):
        count, nbytes = stop - start, (stop - start + 7) // 8
        rows = values[: 8 * nbytes].reshape(-1, 8)
        block = np.take(SIGN_ROWS, packed[start // 8 : start // 8 + nbytes], axis=0, out=rows, mode="wrap")
        signs = per_bucket_cpu(block.reshape(-1)[:count], bucket, factors[start // bucket :])
        target = out[start:stop]
        np.add(target, signs, out=target)


@quiet
def entries_at_least(x: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """The sorted int64 indices of the entries with ``|x| >= threshold``, and their values
    (gathered from each block while it is still in cache)."""
    n = x.size
    if native(x):
        # capacity for every entry; pages that no entry reaches are never touched
        indices, values = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.float32)
        found = compiled.entries_at_least(x, threshold, indices, values)
        return indices[:found].copy(), values[:found].copy()
    magnitude, keep = block_buffer(n, np.float32), block_buffer(n, np.bool_)
    indices, values = [], []
    for start, stop in blocks(n):
        count, block = stop - start, x[start:stop]
        np.abs(block, out=magnitude[:count])
        found = np.flatnonzero(np.greater_equal(magnitude[:count], threshold, out=keep[:count]))
        if found.size:
            values.append(block[found])
            indices.append(found + start)
    if not indices:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=x.dtype)
    return np.concatenate(indices), np.concatenate(values)


_GOLDEN = np.uint32(0x9E37_79B9)  # 2^32 / golden ratio: consecutive indices land far apart
_MANTISSA = np.uint32(0x007F_FFFF)


class Uniforms:
    """Counter-based U[1, 2) float32 draws: element i's draw depends only on the seed and i.

    1. key = 32 bits of the seed, mixed by numpy's SeedSequence.
    2. x = i * 0x9E3779B9 + key (mod 2^32): for any fixed i, uniform over 2^32 values as the
       key is.
    3. x = murmur3's finalizer fmix32(x) (xor-shift 16, * 0x85EBCA6B, xor-shift 13,
       * 0xC2B2AE35, xor-shift 16), a bijection that scrambles neighbouring counters.
    4. Keep 23 bits as the mantissa under 1.0's exponent: a float in [1, 2).
    Eleven vectorized uint32 operations per block: half the cost of drawing from PCG64
    (``random_raw``) here, and the draws do not depend on how the tensor is blocked. Callers
    subtract 1, or fold the 1 into what they compare against.
    """

    def __init__(self, seed: int, capacity: int) -> None:
        self._key = self.key(seed)
        self._base = np.arange(capacity, dtype=np.uint32) * _GOLDEN
        self._words, self._shifted = np.empty(capacity, dtype=np.uint32), np.empty(capacity, dtype=np.uint32)

    @staticmethod
    def key(seed: int) -> int:
        """Step 1: the 32-bit key of ``seed`` (the compiled QSGD and TernGrad kernels draw from it too)."""
        return int(np.random.SeedSequence(int(seed) & 0xFFFF_FFFF_FFFF_FFFF).generate_state(1, np.uint32)[0])

    def at(self, start: int, count: int) -> np.ndarray:
        """The draws of elements ``start .. start + count - 1`` (a view of a reused buffer)."""
        words, shifted = self._words[:count], self._shifted[:count]
        np.add(self._base[:count], np.uint32((start * int(_GOLDEN) + self._key) & 0xFFFF_FFFF), out=words)
        for shift, factor in ((16, 0x85EB_CA6B), (13, 0xC2B2_AE35), (16, None)):
            np.bitwise_xor(words, np.right_shift(words, np.uint32(shift), out=shifted), out=words)
            if factor is not None:
                np.multiply(words, np.uint32(factor), out=words)
        np.bitwise_and(words, _MANTISSA, out=words)
        np.bitwise_or(words, _ONE, out=words)
        return words.view(np.float32)
