"""Gradient codecs: the registry, ``make_codec`` and ``available_codecs``."""

from __future__ import annotations

from typing import Any

from . import dense, powersgd, qsgd, randomk, sign, svd, terngrad, threshold, topk  # noqa: F401  (register)
from ._cpu import kernels_name
from .base import _REGISTRY, Codec, Message, register

__all__ = ["Codec", "Message", "available_codecs", "kernels_name", "make_codec", "parse_spec", "register"]


def available_codecs() -> list[str]:
    """Names of the registered codecs, sorted."""
    return sorted(_REGISTRY)


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"qsgd:levels=16,bucket=512"`` -> ``("qsgd", {"levels": "16", "bucket": "512"})``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"codec spec must be a non-empty string, got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    params: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"codec spec {spec!r}: expected key=value, got {item!r}")
        if key.strip() in params:
            raise ValueError(f"codec spec {spec!r}: {key.strip()!r} given twice")
        params[key.strip()] = value.strip()
    return name.strip(), params


def make_codec(spec: str, **params: Any) -> Codec:
    """Build a codec from a spec string (``"topk:ratio=0.01"``) and/or keyword parameters."""
    name, parsed = parse_spec(spec)
    if name not in _REGISTRY:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(available_codecs())}")
    overlap = set(parsed) & set(params)
    if overlap:
        raise ValueError(f"codec parameter {sorted(overlap)[0]!r} given in both the spec and keywords")
    return _REGISTRY[name](**parsed, **params)
