"""Bit packing and index coding shared by the codecs.

Packing runs where the tensor lives: on the CPU it uses numpy's ``packbits`` (the byte-packing
edge, ~50x faster than the equivalent torch ops there); on a GPU it uses torch shifts so that only
the packed bytes are copied to the host. Sign bits take numpy's comparison on the CPU too: torch's
``x < 0`` into a bool tensor runs ~8x slower than numpy's there (measured, torch 2.13 CPU).
"""

from __future__ import annotations

import numpy as np
import torch

from . import _cpu

_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def packed_nbytes(count: int, width: int) -> int:
    """Bytes used by ``count`` codes of ``width`` bits packed as bit planes."""
    return width * ((count + 7) // 8)


def _pack_plane(bits: torch.Tensor) -> torch.Tensor:
    """Pack a flat tensor of 0/1 uint8 values, 8 to a byte, most significant bit first."""
    if bits.device.type == "cpu":
        return torch.from_numpy(np.packbits(bits.numpy()))
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8) << _SHIFTS.to(bits.device)).sum(1, dtype=torch.uint8)


def _unpack_plane(packed: torch.Tensor, count: int) -> torch.Tensor:
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=count))
    bits = (packed.view(-1, 1) >> _SHIFTS.to(packed.device)) & 1
    return bits.view(-1)[:count]


# the 256 x 8 decode tables of the CPU kernels, as tensors (shared memory, one definition)
_BIT_TABLE = torch.from_numpy(_cpu.BIT_ROWS)
_SIGN_TABLE = torch.from_numpy(_cpu.SIGN_ROWS)


def host_array(t: torch.Tensor):
    """``t`` as a numpy array sharing its memory on the CPU (where numpy's comparisons run ~8x
    faster than torch's), ``t`` itself elsewhere; both answer ``abs``, ``<``, ``&``, ``~``, ``max``."""
    return t.numpy() if t.device.type == "cpu" else t


def pack_negative(flat: torch.Tensor) -> torch.Tensor:
    """One bit per element of ``flat``, set where the element is < 0, packed 8 to a byte."""
    return pack_planes([host_array(flat) < 0])


def pack_planes(planes: list) -> torch.Tensor:
    """Boolean planes of equal length (numpy arrays or tensors, see :func:`host_array`), each
    packed 8 to a byte, most significant bit first, one after the other."""
    if all(isinstance(plane, np.ndarray) for plane in planes):
        return torch.from_numpy(np.concatenate([np.packbits(plane) for plane in planes]))
    return torch.cat([_pack_plane(plane.to(torch.uint8)) for plane in planes])


def _unpack_by_table(table: torch.Tensor, packed: torch.Tensor, count: int) -> torch.Tensor:
    """One table lookup per packed byte gives its 8 values at once (no per-bit arithmetic)."""
    if packed.numel() != packed_nbytes(count, 1):
        raise ValueError(f"expected {packed_nbytes(count, 1)} packed bytes for {count} bits, got {packed.numel()}")
    if packed.device.type == "cpu":
        values = torch.from_numpy(np.take(table.numpy(), packed.numpy(), axis=0))
    else:
        values = table.to(packed.device)[packed.long()]
    return values.view(-1)[:count]


def unpack_signs(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_negative` as float32 signs: -1.0 where the bit is set, else +1.0."""
    return _unpack_by_table(_SIGN_TABLE, packed, count)


def unpack_ones(packed: torch.Tensor, count: int) -> torch.Tensor:
    """One packed plane as float32: 1.0 where the bit is set, else 0.0."""
    return _unpack_by_table(_BIT_TABLE, packed, count)


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Pack unsigned integer codes of ``width`` bits into bytes.

    1. Split the codes into ``width`` bit planes (plane j holds bit j of every code).
    2. Pack each plane 8 codes to a byte and concatenate the planes.

    Bit planes make every width from 1 to 8 cost exactly ``width`` bits per code.
    """
    if not 1 <= width <= 8:
        raise ValueError(f"bit width must be in 1..8, got {width}")
    codes = codes.reshape(-1).to(torch.uint8)
    if width == 1:
        return _pack_plane(codes)
    if codes.device.type == "cpu":  # numpy's uint8 shifts: ~3x faster than torch's here
        array = codes.numpy()
        return torch.from_numpy(np.concatenate([np.packbits((array >> j) & 1) for j in range(width)]))
    return torch.cat([_pack_plane((codes >> j) & 1) for j in range(width)])


def unpack_bits(packed: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` codes as a uint8 tensor."""
    plane = (count + 7) // 8
    if packed.numel() != width * plane:
        raise ValueError(f"expected {width * plane} packed bytes for {count} codes, got {packed.numel()}")
    if width == 1:
        return _unpack_plane(packed, count)
    codes = torch.zeros(count, dtype=torch.uint8, device=packed.device)
    for j in range(width):
        codes |= _unpack_plane(packed[j * plane : (j + 1) * plane], count) << j
    return codes


def delta_encode(sorted_indices: torch.Tensor) -> torch.Tensor:
    """Sorted indices -> int32 gaps (first entry absolute); small gaps compress well with blosc."""
    idx = sorted_indices.to(torch.int64)
    if idx.numel() == 0:
        return torch.empty(0, dtype=torch.int32, device=idx.device)
    return torch.diff(idx, prepend=idx.new_zeros(1)).to(torch.int32)


def delta_decode(gaps: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`delta_encode`: int64 indices."""
    return torch.cumsum(gaps.to(torch.int64), 0)


def check_gaps(gaps: torch.Tensor, numel: int) -> None:
    """Raise ValueError unless ``gaps`` decode to strictly increasing indices in [0, numel)."""
    if gaps.numel() == 0:
        return
    if int(gaps[0]) < 0 or (gaps.numel() > 1 and int(gaps[1:].min()) <= 0):
        raise ValueError("index gaps must give strictly increasing indices")
    if int(gaps.to(torch.int64).sum()) >= numel:
        raise ValueError(f"index beyond the tensor's {numel} elements")


def to_uint8(values: torch.Tensor) -> torch.Tensor:
    """Non-negative floats below 256 (already whole) as uint8; numpy's cast is ~8x torch's on the CPU."""
    if values.device.type == "cpu":
        return torch.from_numpy(values.numpy().astype(np.uint8))
    return values.to(torch.uint8)


def uniform(count: int, seed: int, device: torch.device) -> torch.Tensor:
    """``count`` fp32 draws from U[0, 1) fixed by ``seed``: numpy's PCG64 on the CPU (~1.7x faster
    than ``torch.rand`` there), torch's generator elsewhere."""
    if device.type == "cpu":
        rng = np.random.Generator(np.random.PCG64(int(seed) & 0xFFFF_FFFF_FFFF_FFFF))
        return torch.from_numpy(rng.random(count, dtype=np.float32))
    return torch.rand(count, generator=generator(seed, device), device=device)


def generator(seed: int, device: torch.device) -> torch.Generator:
    """A private generator, so codecs never touch the global RNG."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen
