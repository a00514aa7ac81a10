"""Message <-> bytes: one msgpack map per message, blosc on the arrays where it pays.

docs/protocol.md is the byte-level specification. ``loads`` trusts nothing: every field is type-
and range-checked, array lengths must equal shape x itemsize, blosc headers are validated before
anything is decompressed, the arrays' declared sizes are summed against ``max_bytes`` first, and
the codec checks its own arrays (index ranges, counts). Any malformed input raises ``WireError``.
Memory use is bounded by ``max_bytes`` for the arrays and, when the receiver passes the layer's
``shape``, by the layer for the decoded tensor. Never pickle.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import blosc
import msgpack
import numpy as np
import torch

from ..codecs import Codec, Message, make_codec
from ..codecs.base import GRAD_DTYPES

FORMAT_VERSION = 1
KINDS = ("grad", "params", "delta", "code", "mean", "control", "buffers")
ARRAY_DTYPES: dict[str, tuple[np.dtype, torch.dtype]] = {
    "uint8": (np.dtype("<u1"), torch.uint8),
    "int32": (np.dtype("<i4"), torch.int32),
    "int64": (np.dtype("<i8"), torch.int64),
    "float16": (np.dtype("<f2"), torch.float16),
    "float32": (np.dtype("<f4"), torch.float32),
}
_TORCH_TO_NAME = {tdt: name for name, (_, tdt) in ARRAY_DTYPES.items()}
MAX_MESSAGE_BYTES = 1 << 31
MAX_NDIM = 8
MAX_ELEMENTS = 1 << 31
BLOSC_MIN_BYTES = 256  # below this blosc's 16-byte header eats the gain
BLOSC_MIN_SAVING = 0.9  # keep the compressed form only if it is at most 90 % of the raw bytes
_HEADER_KEYS = {"v", "kind", "step", "layer", "sender", "codec", "params", "shape", "dtype", "seed", "meta", "arrays"}
_ARRAY_KEYS = {"d", "s", "z", "b"}

# Ranks already share two cores; blosc's own thread pool would fight them.
blosc.set_nthreads(1)


@functools.lru_cache(maxsize=256)
def _codec(name: str, params: tuple[tuple[str, Any], ...]) -> Codec:
    """Codecs are immutable once built: one instance per (name, params) serves every message."""
    return make_codec(name, **dict(params))


def codec_of(msg: Message) -> Codec:
    """The codec that decodes ``msg``: the one instance of its name and parameters."""
    return _codec(msg.codec, tuple(sorted(msg.params.items())))


class WireError(ValueError):
    """A buffer that is not a valid psgrad message; the text says what was wrong."""


# ---------------------------------------------------------------------------- dumps
def _pack_array(arr: torch.Tensor, compress: bool) -> dict[str, Any]:
    if arr.dtype not in _TORCH_TO_NAME:
        raise TypeError(f"array dtype {arr.dtype} cannot go on the wire")
    # a view, not a copy: msgpack and blosc read the tensor's memory directly (one copy, not three)
    raw = memoryview(arr.detach().contiguous().cpu().numpy().reshape(-1)).cast("B")
    packed, zipped = raw, 0
    if compress and len(raw) >= BLOSC_MIN_BYTES:
        candidate = blosc.compress(raw, typesize=arr.element_size(), cname="lz4", shuffle=blosc.SHUFFLE)
        if len(candidate) <= BLOSC_MIN_SAVING * len(raw):
            packed, zipped = candidate, 1
    return {"d": _TORCH_TO_NAME[arr.dtype], "s": list(arr.shape), "z": zipped, "b": packed}


def dumps(msg: Message, compress: str = "auto") -> bytes:
    """Serialize ``msg``. ``compress``: ``auto`` (blosc on the codec's compressible arrays when it
    saves >= 10 %), ``always`` (try every array) or ``never``."""
    if compress not in ("auto", "always", "never"):
        raise ValueError(f"compress must be auto, always or never, got {compress!r}")
    if msg.kind not in KINDS:
        raise ValueError(f"message kind must be one of {KINDS}, got {msg.kind!r}")
    zippable: frozenset[str] | None = None
    if compress == "auto" and msg.arrays:
        zippable = _codec(msg.codec, tuple(sorted(msg.params.items()))).compressible
    header = {
        "v": FORMAT_VERSION,
        "kind": msg.kind,
        "step": int(msg.step),
        "layer": msg.layer,
        "sender": int(msg.sender),
        "codec": msg.codec,
        "params": dict(msg.params),
        "shape": [int(d) for d in msg.shape],
        "dtype": msg.dtype,
        "seed": int(msg.seed),
        "meta": dict(msg.meta),
        "arrays": {
            name: _pack_array(arr, compress == "always" or (zippable is not None and name in zippable))
            for name, arr in msg.arrays.items()
        },
    }
    return _packb(header)


def _bin_header(size: int) -> bytes:
    """msgpack's bin 8 / bin 16 / bin 32 header, the smallest that holds ``size``."""
    if size < 1 << 8:
        return b"\xc4" + size.to_bytes(1, "big")
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


def _packb(header: dict[str, Any]) -> bytes:
    """Exactly ``msgpack.packb(header, use_bin_type=True)``, with one copy of the array bytes
    instead of three.

    1. msgpack packs the header's fields; the ``arrays`` map (the last key) is written entry by
       entry, each array's data as a bin header followed by a view of its bytes.
    2. One ``join`` copies the pieces into the message. (msgpack's own packer grows its buffer
       by doubling and copies it once more into the bytes it returns: for a dense 4 M-element
       layer that was 3 copies of 16 MB and thousands of fresh pages per message.)
    """
    packer = msgpack.Packer(use_bin_type=True)
    pieces: list[bytes | memoryview] = [packer.pack_map_header(len(header))]
    for key, value in header.items():
        pieces.append(packer.pack(key))
        if key != "arrays":
            pieces.append(packer.pack(value))
            continue
        pieces.append(packer.pack_map_header(len(value)))
        for name, entry in value.items():
            pieces.append(packer.pack(name))
            pieces.append(packer.pack_map_header(len(entry)))
            for field, item in entry.items():
                pieces.append(packer.pack(field))
                if field == "b":
                    pieces += [_bin_header(len(item)), item]
                else:
                    pieces.append(packer.pack(item))
    return b"".join(pieces)


# ---------------------------------------------------------------------------- loads
def _fail(what: str) -> None:
    raise WireError(what)


def _check_int(value: Any, name: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        _fail(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _check_str(value: Any, name: str, limit: int = 256) -> str:
    if type(value) is not str or len(value) > limit:
        _fail(f"{name} must be a string of at most {limit} characters, got {type(value).__name__}")
    return value


def _check_scalars(value: Any, name: str) -> dict[str, Any]:
    if type(value) is not dict or len(value) > 64:
        _fail(f"{name} must be a map of at most 64 entries")
    for key, item in value.items():
        _check_str(key, f"{name} key", 64)
        if type(item) not in (int, float, str, bool):
            _fail(f"{name}[{key!r}] must be a number, string or bool, got {type(item).__name__}")
        if type(item) is str:
            _check_str(item, f"{name}[{key!r}]")
    return value


def _check_shape(value: Any, name: str) -> tuple[int, ...]:
    if type(value) is not list or len(value) > MAX_NDIM:
        _fail(f"{name} must be a list of at most {MAX_NDIM} dimensions")
    shape = tuple(_check_int(d, f"{name} dimension", 0, MAX_ELEMENTS) for d in value)
    if math.prod(shape) > MAX_ELEMENTS:
        _fail(f"{name} {shape} has more than {MAX_ELEMENTS} elements")
    return shape


def _declared_array(name: Any, entry: Any) -> tuple[np.dtype, tuple[int, ...], int]:
    """Check an array entry's fields; return its dtype, shape and decoded byte size (nothing
    is decompressed or allocated yet)."""
    _check_str(name, "array name", 32)
    if type(entry) is not dict or set(entry) != _ARRAY_KEYS:
        _fail(f"array {name!r} must be a map with keys {sorted(_ARRAY_KEYS)}")
    if type(entry["d"]) is not str or entry["d"] not in ARRAY_DTYPES:
        _fail(f"array {name!r} has dtype {entry['d']!r}; allowed: {', '.join(ARRAY_DTYPES)}")
    np_dtype, _ = ARRAY_DTYPES[entry["d"]]
    shape = _check_shape(entry["s"], f"array {name!r} shape")
    _check_int(entry["z"], f"array {name!r} z", 0, 1)
    if type(entry["b"]) is not bytes:
        _fail(f"array {name!r} data must be binary")
    return np_dtype, shape, math.prod(shape) * np_dtype.itemsize


def _unpack_array(name: str, entry: dict[str, Any], declared: tuple[np.dtype, tuple[int, ...], int]) -> torch.Tensor:
    np_dtype, shape, expected = declared
    data = entry["b"]
    if entry["z"]:
        # Validate blosc's header before it allocates or decompresses anything. These are the checks
        # of blosc_cbuffer_validate, done here: python-blosc 1.11's cbuffer_validate keeps a
        # reference to every buffer it is given (a message's arrays were never freed).
        if len(data) < 16:
            _fail(f"array {name!r}: invalid blosc buffer")
        nbytes, cbytes, _ = blosc.get_cbuffer_sizes(data)
        if nbytes != expected or cbytes != len(data):
            _fail(f"array {name!r}: blosc holds {nbytes} bytes, shape {shape} needs {expected}")
        array = np.empty(shape, dtype=np_dtype)
        try:  # straight into the array: one copy, not two (bytes, then a writable copy)
            written = blosc.decompress_ptr(data, array.ctypes.data)
        except Exception as err:  # blosc raises RuntimeError/ValueError on corrupt blocks
            raise WireError(f"array {name!r}: blosc could not decompress: {err}") from None
        if written != expected:
            _fail(f"array {name!r}: blosc wrote {written} bytes, shape {shape} needs {expected}")
        return torch.from_numpy(array)
    if len(data) != expected:
        _fail(f"array {name!r}: {len(data)} bytes, shape {shape} x {np_dtype.itemsize} needs {expected}")
    array = np.frombuffer(bytearray(data), dtype=np_dtype).reshape(shape)
    return torch.from_numpy(array)


def _header(buf: bytes | bytearray | memoryview, max_bytes: int) -> dict:
    """The message's msgpack map, every length capped by ``max_bytes``, with its keys, format
    version, kind, dtype and array count checked (``loads``'s steps 1 and 2)."""
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        _fail(f"expected bytes, got {type(buf).__name__}")
    if len(buf) > max_bytes:
        _fail(f"message of {len(buf)} bytes exceeds the limit of {max_bytes}")
    try:
        header = msgpack.unpackb(
            buf,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=max_bytes,
            max_str_len=1 << 16,
            max_array_len=1 << 12,
            max_map_len=1 << 10,
            max_ext_len=0,
        )
    except Exception as err:  # msgpack raises several unrelated types on bad input
        raise WireError(f"not a msgpack message: {type(err).__name__}: {err}") from None
    if type(header) is not dict:
        _fail(f"message must be a map, got {type(header).__name__}")
    if set(header) != _HEADER_KEYS:
        missing, extra = sorted(_HEADER_KEYS - set(header)), sorted(set(header) - _HEADER_KEYS, key=str)
        _fail(f"message keys wrong (missing {missing}, unexpected {extra})")
    if header["v"] != FORMAT_VERSION:
        _fail(f"format version {header['v']!r} is not {FORMAT_VERSION}")
    if type(header["kind"]) is not str or header["kind"] not in KINDS:
        _fail(f"kind {header['kind']!r} is not one of {KINDS}")
    if type(header["dtype"]) is not str or header["dtype"] not in GRAD_DTYPES:
        _fail(f"dtype {header['dtype']!r} is not one of {tuple(GRAD_DTYPES)}")
    if type(header["arrays"]) is not dict or len(header["arrays"]) > 16:
        _fail("arrays must be a map of at most 16 entries")
    return header


def loads(
    buf: bytes | bytearray | memoryview, max_bytes: int = MAX_MESSAGE_BYTES, shape: tuple[int, ...] | None = None
) -> Message:
    """Parse and validate one message; raise ``WireError`` on anything malformed.

    1. The buffer must be at most ``max_bytes`` long; msgpack parses it with every length capped.
    2. The header's fields are type- and range-checked; with ``shape`` given (the receiver knows
       the layer) the message's shape must equal it, so decoding never allocates more than the layer.
    3. Every array's declared size is checked, and their sum must be at most ``max_bytes``, before
       any array is decompressed: a small blosc frame cannot claim gigabytes. Receivers pass their
       receive-buffer bound (``max_message_bytes``), which covers every honest payload.
    4. Arrays are decompressed (blosc header validated first) and checked against their shapes.
    5. The codec checks its own arrays (index ranges, counts)."""
    header = _header(buf, max_bytes)
    msg_shape = _check_shape(header["shape"], "shape")
    if shape is not None and msg_shape != tuple(shape):
        _fail(f"shape {msg_shape} is not the layer's {tuple(shape)}")
    declared = {k: _declared_array(k, v) for k, v in header["arrays"].items()}
    total = sum(nbytes for _, _, nbytes in declared.values())
    if total > max_bytes:
        _fail(f"arrays declare {total} decoded bytes, more than the limit of {max_bytes}")
    msg = Message(
        codec=_check_str(header["codec"], "codec", 32),
        params=_check_scalars(header["params"], "params"),
        shape=msg_shape,
        dtype=header["dtype"],
        arrays={k: _unpack_array(k, v, declared[k]) for k, v in header["arrays"].items()},
        seed=_check_int(header["seed"], "seed", 0, 2**64 - 1),
        kind=header["kind"],
        step=_check_int(header["step"], "step", 0, 2**63 - 1),
        layer=_check_str(header["layer"], "layer"),
        sender=_check_int(header["sender"], "sender", 0, 2**31 - 1),
        meta=_check_scalars(header["meta"], "meta"),
    )
    if msg.kind != "control" or msg.arrays:
        try:
            _codec(msg.codec, tuple(sorted(msg.params.items()))).check(msg)
        except ValueError as err:
            raise WireError(f"{msg.kind} message for layer {msg.layer!r}: {err}") from None
    return msg


def max_message_bytes(codec_spec: str, shape: tuple[int, ...], layer: str = "") -> int:
    """A bound on ``len(dumps(msg))`` for any message of this codec and shape (receive buffers)."""
    codec = make_codec(codec_spec)
    payload = codec.max_payload_bytes(tuple(shape))
    # blosc can grow an incompressible buffer by its 16-byte header plus a little per block,
    # but dumps keeps the raw form then; the rest is header fields and per-array framing.
    return payload + 1024 + 4 * len(layer) + 64 * len(shape)
