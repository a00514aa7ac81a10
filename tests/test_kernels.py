"""The compiled codec kernels (psgrad/codecs/_kernels.c) against the numpy kernels they replace.

The compiled kernels must send the same bits and add the same values as the numpy code, which
stays as the fallback (``PSGRAD_KERNELS=numpy``, or an install without a C compiler); sums over
many elements (sign's scales) are rounded in another order and agree to float precision.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from psgrad.codecs import _cpu, make_codec
from psgrad.comm import wire

COMPILED = _cpu.compiled
needs_compiled = pytest.mark.skipif(COMPILED is None, reason="the compiled kernels are not built here")

SPECS = [
    "sign",
    "sign:bucket=32",
    "sign:bucket=7",
    "qsgd:levels=16",
    "qsgd:levels=4,bucket=100",
    "qsgd:levels=255,bucket=3",
    "qsgd:levels=16,bucket=12",
    "qsgd:levels=1",
    "threshold:v=2.5",
    "threshold:v=2.5,values=fp16",
    "topk:ratio=0.01",
    "terngrad",
    "terngrad:clip=1",
]
SUMS = {"scale"}  # arrays that sum many elements: equal to float precision, not bit for bit
# around the compiled kernels' 8,192-element blocks, and odd sizes that leave a short last byte
SIZES = [1, 7, 13, 1000, 8191, 8192, 8193, 70001]


def test_the_install_built_the_compiled_kernels():
    """launch/setup.sh builds them (setup.py): an install that silently lost them would run
    every codec at numpy's speed."""
    if os.environ.get("PSGRAD_KERNELS") == "numpy":
        pytest.skip("PSGRAD_KERNELS=numpy chooses the numpy kernels")
    assert COMPILED is not None
    assert _cpu.kernels_name() == "compiled"


def _gradient(n: int, special: bool) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    if special and n > 20:
        x[5], x[6], x[11], x[12], x[13] = 0.0, -0.0, float("nan"), float("inf"), -float("inf")
    return x


def _round_trip(spec: str, x: torch.Tensor) -> tuple[dict, np.ndarray]:
    codec = make_codec(spec)
    msg = codec.encode(x.clone(), seed=3)
    acc = torch.randn(x.numel(), generator=torch.Generator().manual_seed(1))
    codec.decode_add(wire.loads(wire.dumps(msg)), acc, alpha=0.7)
    return {name: array.numpy() for name, array in msg.arrays.items()}, acc.numpy()


@needs_compiled
@pytest.mark.parametrize("special", [False, True], ids=["finite", "with 0, -0, nan, inf"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("spec", SPECS)
def test_compiled_and_numpy_kernels_agree(spec, n, special, monkeypatch):
    """Same message arrays (bits, codes, indices, values) and the same accumulator after
    decode_add, whichever kernels run."""
    x = _gradient(n, special)
    compiled_arrays, compiled_sum = _round_trip(spec, x)
    monkeypatch.setattr(_cpu, "compiled", None)
    numpy_arrays, numpy_sum = _round_trip(spec, x)
    assert compiled_arrays.keys() == numpy_arrays.keys()
    for name, array in numpy_arrays.items():
        if name in SUMS:
            np.testing.assert_allclose(compiled_arrays[name], array, rtol=1e-5)
        else:
            np.testing.assert_array_equal(compiled_arrays[name], array, err_msg=name)
    if spec.startswith("sign"):  # the accumulator carries the scales' rounding
        np.testing.assert_allclose(compiled_sum, numpy_sum, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(compiled_sum, numpy_sum)


@needs_compiled
def test_every_byte_pattern_packs_and_unpacks():
    """Each of the 256 sign patterns of 8 elements packs to numpy's byte and adds back."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).reshape(-1)
    x = np.where(bits == 1, -1.5, 2.5).astype(np.float32)
    packed = np.empty(256, dtype=np.uint8)
    l1 = COMPILED.negative_bits(x, packed)
    np.testing.assert_array_equal(packed, np.arange(256, dtype=np.uint8))
    assert l1 == pytest.approx(float(np.abs(x).sum()))
    out = np.zeros(x.size, dtype=np.float32)
    COMPILED.add_bits(packed, -1.5, 2.5, out)
    np.testing.assert_array_equal(out, x)


@needs_compiled
def test_short_buffers_raise_instead_of_overrunning():
    """The kernels check every buffer's length in bytes: a wrong call is a ValueError."""
    x = np.ones(100, dtype=np.float32)
    with pytest.raises(ValueError, match="packed"):
        COMPILED.negative_bits(x, np.empty(12, dtype=np.uint8))
    with pytest.raises(ValueError, match="indices"):
        COMPILED.entries_at_least(x, 0.5, np.empty(99, dtype=np.int64), np.empty(100, dtype=np.float32))
    with pytest.raises(ValueError, match="levels"):
        COMPILED.qsgd_decode_add(
            np.empty(13 * 4, dtype=np.uint8), np.empty(13, dtype=np.uint8), np.ones(1, dtype=np.float32), 512, 5, x
        )
    with pytest.raises(ValueError, match="bucket"):
        COMPILED.add_signs_per_bucket(np.empty(13, dtype=np.uint8), np.ones(1, dtype=np.float32), 0, x)


@pytest.mark.parametrize(
    ("value", "expected", "warns"),
    [("numpy", "numpy", False), ("compiled", None, False), ("fastest", None, True)],
)
def test_psgrad_kernels_chooses_and_a_misspelling_warns(value, expected, warns):
    code = (
        "import warnings; warnings.simplefilter('always'); from psgrad.codecs import _cpu; print(_cpu.kernels_name())"
    )
    env = {**os.environ, "PSGRAD_KERNELS": value}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == (expected or _cpu.kernels_name())
    assert ("PSGRAD_KERNELS" in done.stderr) == warns
