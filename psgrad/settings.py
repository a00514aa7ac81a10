"""How a run setting is declared: once, as a ``RunConfig`` field with its metadata.

``setting(default, section=..., help=..., ...)`` is a dataclass field whose metadata says
everything the rest of psgrad needs to know of it:

1. its flag (``--`` and the field name with dashes; ``--x/--no-x`` for a bool) and help text,
   from which ``psgrad.options`` builds the click option, its --help section and docs/cli.md;
2. its allowed values (``choices``, or a range ``low``/``high``), from which come both the click
   type and the check ``value_problem`` that ``RunConfig.validate`` runs on every setting, so a
   config built in Python or read from config.json is held to what the command line allows;
3. when it means nothing (``unused``: rules ``cfg -> why or None``), from which comes the refusal
   of an option the command line set for a run that would ignore it;
4. whether it acts in your own training loop (``your_loop``): ``psgrad.init`` takes only those,
   and refuses the settings of psgrad's loop (model, data, optimizer, logging, ...), which yours
   would silently ignore.

Rules that link settings to each other stay in ``RunConfig.validate`` or in the topology that
owns them. Pure Python: no click, no torch.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Collection, KeysView, Sequence
from dataclasses import dataclass
from typing import Any

from .choices import option_flag

# The --help sections, in the order they are shown.
MODEL_AND_DATA = "Model and data"
CODEC = "Codec"
TOPOLOGY = "Topology"
TRAINING = "Optimizer and training"
OUTPUT = "Logging, evaluation and checkpoints"
SYSTEM = "Launch and system"
SECTIONS = (MODEL_AND_DATA, CODEC, TOPOLOGY, TRAINING, OUTPUT, SYSTEM)

UnusedRule = Callable[[Any], "str | None"]


@dataclass(frozen=True)
class Setting:
    """What psgrad knows of one run setting besides its name, type and default (see the module)."""

    section: str
    help: str
    choices: Collection | None = None  # a tuple, or a registry's live keys
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    path: str | None = None  # "dir": a directory made if missing; "existing-dir": one that must exist
    unused: tuple[UnusedRule, ...] = ()
    your_loop: bool = False  # psgrad.init takes it (psgrad.userloop)


def setting(
    default: Any,
    *,
    section: str,
    help: str,
    choices: Collection | None = None,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    path: str | None = None,
    unused: Sequence[UnusedRule] = (),
    your_loop: bool = False,
) -> Any:
    """A dataclass field of default ``default`` that carries its ``Setting`` (see the module)."""
    if section not in SECTIONS:
        raise ValueError(f"section must be one of {', '.join(SECTIONS)}, got {section!r}")
    meta = Setting(
        section=section,
        help=help,
        choices=choices if isinstance(choices, KeysView) or choices is None else tuple(choices),
        low=low,
        high=high,
        low_open=low_open,
        high_open=high_open,
        path=path,
        unused=tuple(unused),
        your_loop=your_loop,
    )
    return dataclasses.field(default=default, metadata={"setting": meta})


def settings_of(cls: type) -> dict[str, tuple[dataclasses.Field, Setting]]:
    """The declared settings of dataclass ``cls``, by field name, in declaration order."""
    return {f.name: (f, f.metadata["setting"]) for f in dataclasses.fields(cls) if "setting" in f.metadata}


def _range_text(meta: Setting) -> str:
    if meta.low is not None and meta.high is not None:
        return f"in {'(' if meta.low_open else '['}{meta.low:g}, {meta.high:g}{')' if meta.high_open else ']'}"
    if meta.low is not None:
        return f"{'>' if meta.low_open else '>='} {meta.low:g}"
    return f"{'<' if meta.high_open else '<='} {meta.high:g}"


def type_problem(name: str, hint: Any, value: Any) -> str | None:
    """Why ``value`` is not of the setting's declared type ``hint`` (bool, int, float, str,
    ``tuple[int, ...]``, or one of them ``| None``), or None: what a config.json or a Python
    caller gives is checked before any comparison with it can fail obscurely.

    1. None: allowed where the type is optional.
    2. An int is a number (``--lr 1`` is 1.0); a bool is not a number (JSON's ``true`` is no
       step count), but 0 and 1 are a bool.
    3. A tuple of ints may be a list of them (JSON has no tuples)."""
    args = typing.get_args(hint)
    optional = type(None) in args
    if value is None:
        return None if optional else f"{option_flag(name)} must be set, got None"
    base = next(a for a in args if a is not type(None)) if optional else hint
    if typing.get_origin(base) is tuple:
        ok, what = isinstance(value, (tuple, list)) and all(_is_int(v) for v in value), "a list of integers"
    elif base is float:
        ok, what = _is_int(value) or isinstance(value, float), "a number"
    elif base is bool:  # 0 and 1 say it too (a Python caller's overlap_exchange=1)
        ok, what = isinstance(value, bool) or (_is_int(value) and value in (0, 1)), "true or false"
    elif base is int:
        ok, what = _is_int(value), "an integer"
    elif base is str:
        ok, what = isinstance(value, str), "a string"
    else:
        return None
    return None if ok else f"{option_flag(name)} must be {what}, got {value!r}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def value_problem(name: str, meta: Setting, value: Any) -> str | None:
    """Why ``value`` is not allowed for the setting ``name`` (its choices or its range), or None.
    None stands for "not set" in an optional setting and is always allowed."""
    if value is None:
        return None
    if meta.choices is not None and value not in meta.choices:
        return f"{option_flag(name)} must be one of {', '.join(map(str, meta.choices))}, got {value!r}"
    if meta.low is None and meta.high is None:
        return None
    below = meta.low is not None and (value <= meta.low if meta.low_open else value < meta.low)
    above = meta.high is not None and (value >= meta.high if meta.high_open else value > meta.high)
    if below or above:
        return f"{option_flag(name)} must be {_range_text(meta)}, got {value}"
    return None


def unused_reason(meta: Setting, cfg: Any) -> str | None:
    """Why the setting of ``meta`` has no effect on the run ``cfg`` (its first rule that fires), or None."""
    return next((why for rule in meta.unused if (why := rule(cfg)) is not None), None)


def unless(applies: Callable[[Any], bool], why: str) -> UnusedRule:
    """A rule: the setting means nothing when ``applies(cfg)`` is false, because ``why``
    (formatted with ``cfg``, e.g. ``"... it means nothing to --model {cfg.model}"``)."""
    return lambda cfg: None if applies(cfg) else why.format(cfg=cfg)


def named_with_guesses(unknown: Sequence[str], *, known: Collection[str]) -> str:
    """The unknown setting names, each followed by the known one it most likely misspells, if
    one is close: ``epoch (did you mean epochs?)``, as click does for a mistyped flag."""
    import difflib

    def one(name: str) -> str:
        near = difflib.get_close_matches(name, list(known), n=1)
        return f"{name} (did you mean {near[0]}?)" if near else name

    return ", ".join(one(name) for name in unknown)
