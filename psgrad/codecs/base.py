"""The codec contract: ``Message``, the ``Codec`` base class and the registry decorator."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

GRAD_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
Scalar = int | float | str | bool

_REGISTRY: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` available to ``make_codec`` under ``cls.name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"codec {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


@dataclass
class Message:
    """Everything one encoded tensor needs on the wire, and nothing kept on the side.

    ``arrays`` holds the codec's named payload tensors (never views of the encoded gradient). ``kind``/``step``/``layer``/``sender`` route the message;
    ``meta`` carries small scalars (control operations, counts).
    """

    codec: str
    params: dict[str, Scalar]
    shape: tuple[int, ...]
    dtype: str
    arrays: dict[str, torch.Tensor]
    seed: int = 0
    kind: str = "grad"
    step: int = 0
    layer: str = ""
    sender: int = 0
    meta: dict[str, Scalar] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Codec:
    """Base class. Subclasses set ``name``, ``defaults`` (typed by their values) and implement
    ``_encode(flat, shape, seed) -> arrays``, ``_decode(msg, device) -> flat float32`` and
    ``_expected(msg) -> {array name: (dtype, shape)}``.
    """

    name: ClassVar[str]
    defaults: ClassVar[dict[str, Scalar]] = {}
    choices: ClassVar[dict[str, tuple[str, ...]]] = {}
    compressible: ClassVar[frozenset[str]] = frozenset()
    """Array names on which blosc pays (see docs/codecs.md); others are sent raw."""

    def __init__(self, **params: Any) -> None:
        self.params: dict[str, Scalar] = self._check_params(params)

    # ---------------------------------------------------------------- parameters
    def _check_params(self, params: dict[str, Any]) -> dict[str, Scalar]:
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            allowed = ", ".join(self.defaults) or "none"
            raise ValueError(f"codec {self.name!r} has no parameter {unknown[0]!r} (allowed: {allowed})")
        out: dict[str, Scalar] = {}
        for key, default in self.defaults.items():
            value = params.get(key, default)
            try:
                value = type(default)(value) if not isinstance(default, bool) else bool(int(value))
            except (TypeError, ValueError):
                kind = {int: "an integer", float: "a number", bool: "0 or 1"}.get(type(default), type(default).__name__)
                raise ValueError(f"codec {self.name!r}: {key}={value!r} is not {kind}") from None
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"codec {self.name!r}: {key} must be finite")
            if key in self.choices and value not in self.choices[key]:
                raise ValueError(f"codec {self.name!r}: {key} must be one of {self.choices[key]}, got {value!r}")
            out[key] = value
        self._validate(out)
        return out

    def _validate(self, params: dict[str, Scalar]) -> None:
        """Range checks of a codec's parameters; raise ValueError."""

    @property
    def spec(self) -> str:
        """The spec string that ``make_codec`` turns back into this codec."""
        args = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.params.items())
        return f"{self.name}:{args}" if args else self.name

    def __repr__(self) -> str:
        return f"make_codec({self.spec!r})"

    @property
    def feedback_safe(self) -> bool:
        """Whether error feedback around this codec stays bounded.

        Error feedback keeps x - D(C(x)) for the next step; that shrinks only when the codec is
        contractive (||x - D(C(x))|| < ||x||). Codecs that rescale a few coordinates to stay
        unbiased (random-k multiplies by n/k) make the memory grow every step instead.
        """
        return True

    @property
    def unbiased(self) -> bool:
        """True when E[decode(encode(g))] == g."""
        return False

    @property
    def shares_randomness(self) -> bool:
        """True when every worker must encode a layer with the same randomness in a step (the
        workers' messages then line up coordinate by coordinate: shared random-k). Senders seed it
        with ``protocol.SHARED_STREAM`` instead of their own stream."""
        return False

    def rounds(self, shape: tuple[int, ...]) -> int:
        """Messages per layer and step through a server. 1: the server decodes and sums each one.
        More (PowerSGD): the server sums the round's messages in code space, replies with
        ``reduce``, and the workers answer with the next round (docs/protocol.md); the codec then
        also has ``first_round``, ``next_round``, ``finish``, ``reduce`` and ``gradient``."""
        return 1

    @property
    def multi_round(self) -> bool:
        """True when some layer shapes take more than one round (``rounds``)."""
        return False

    @property
    def sums_in_code_space(self) -> bool:
        """True when several senders' messages (each encoded with the same seed) can be summed
        array by array and the sum decoded, instead of decoding each: fp32 dense values, shared
        random-k, and a multi-round codec's rounds. DDP's hook all-reduces such messages and
        all-gathers the others (``psgrad.ddpcomm``)."""
        return self.multi_round

    # ---------------------------------------------------------------- contract
    def encode(self, grad: torch.Tensor, seed: int = 0) -> Message:
        """Encode ``grad`` (any shape, a floating dtype) into a Message; ``seed`` fixes all randomness."""
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"encode expects a torch.Tensor, got {type(grad).__name__}")
        dtype = str(grad.dtype).removeprefix("torch.")
        if dtype not in GRAD_DTYPES:
            raise TypeError(f"encode expects a floating tensor ({', '.join(GRAD_DTYPES)}), got {dtype}")
        flat = grad.detach().reshape(-1).float()
        shape = tuple(grad.shape)
        arrays = self._encode(flat, shape, int(seed))
        return Message(self.name, dict(self.params), shape, dtype, arrays, seed=int(seed))

    def decode(self, msg: Message, device: torch.device | str | None = None) -> torch.Tensor:
        """The tensor ``msg`` stands for, with the original shape and dtype."""
        flat = self._decode(msg, torch.device(device) if device is not None else self._device(msg))
        return flat.view(msg.shape).to(GRAD_DTYPES[msg.dtype])

    def decode_add(self, msg: Message, out: torch.Tensor, alpha: float = 1.0) -> None:
        """``out += alpha * decode(msg)`` (the server's hot loop); sparse codecs avoid the dense temporary."""
        out.view(-1).add_(self._decode(msg, out.device), alpha=alpha)

    def encode_residual(self, x: torch.Tensor, seed: int = 0) -> Message:
        """Encode fp32 ``x`` and leave in ``x`` what the message lost: ``x -= decode(msg)``.

        Error feedback needs exactly this; a codec may fuse the two halves. (The blocked CPU
        kernels made the plain pair as fast as sign's fused version was: decode_add adds into
        ``x`` without a dense temporary.)
        """
        msg = self.encode(x, seed=seed)
        self.decode_add(msg, x, alpha=-1.0)
        return msg

    def check(self, msg: Message) -> None:
        """Raise ValueError unless ``msg`` is a well-formed message of this codec."""
        expected = self._expected(msg)
        if set(expected) != set(msg.arrays):
            raise ValueError(f"{self.name}: arrays {sorted(msg.arrays)} != expected {sorted(expected)}")
        for key, (dtype, shape) in expected.items():
            arr = msg.arrays[key]
            if arr.dtype != dtype or tuple(arr.shape) != tuple(shape):
                raise ValueError(
                    f"{self.name}: array {key!r} is {arr.dtype}{tuple(arr.shape)}, expected {dtype}{tuple(shape)}"
                )
        self._check_values(msg)

    def _check_values(self, msg: Message) -> None:
        """Codec-specific content checks (index ranges); raise ValueError."""

    def max_payload_bytes(self, shape: tuple[int, ...]) -> int:
        """Upper bound of the raw array bytes for a tensor of ``shape`` (sizes receive buffers)."""
        return 4 * math.prod(shape)

    def budget_bits(self, shape: tuple[int, ...]) -> float:
        """Expected raw payload bits per element (the documented byte budget)."""
        return 8 * self.max_payload_bytes(shape) / max(1, math.prod(shape))

    @staticmethod
    def _device(msg: Message) -> torch.device:
        for arr in msg.arrays.values():
            return arr.device
        return torch.device("cpu")

    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _decode(self, msg: Message, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def _expected(self, msg: Message) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        raise NotImplementedError
