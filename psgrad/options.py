"""The run options every training command shares (train, server, worker, bench): one table,
attached to click commands by ``run_options``, and the parsing of a bench row's own options."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, KeysView
from dataclasses import asdict
from pathlib import Path

import click

from . import checkpoint
from .choices import option_flag
from .config import RunConfig
from .config.refusals import refuse_unused
from .settings import OUTPUT, SECTIONS, Setting, settings_of


class LiveChoice(click.Choice):
    """A choice among a registry's names as they are when the command line is read (click's own
    Choice copies them when the command is built)."""

    def __init__(self, names: KeysView) -> None:
        self._names = names
        super().__init__(names)

    @property
    def choices(self) -> tuple:
        return tuple(self._names)

    @choices.setter
    def choices(self, value: tuple) -> None:
        """click sets its copy here; the registry's view stays the source."""


def _click_type(f: dataclasses.Field, meta: Setting) -> click.ParamType | type | None:
    """The click type of a declared setting: its choices, range or path; None for a bool flag."""
    kind = str(f.type)
    if kind == "bool":
        return None
    if meta.choices is not None:
        if isinstance(meta.choices, KeysView):  # a registry's names: one registered later is a choice too
            return LiveChoice(meta.choices)
        return click.Choice([str(choice) for choice in meta.choices])
    if meta.path is not None:
        return click.Path(exists=meta.path == "existing-dir", file_okay=False)
    if meta.low is not None or meta.high is not None:
        limits = {"min": meta.low, "max": meta.high, "min_open": meta.low_open, "max_open": meta.high_open}
        return click.IntRange(**limits) if kind.startswith("int") else click.FloatRange(**limits)
    return {"int": int, "int | None": int, "float": float, "float | None": float}.get(kind, str)


def _integers(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers like 60,120,160, got {value!r}") from None


def _as_int(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    return None if value is None else int(value)


class SettingOption(click.Option):
    """The click option of a declared setting; it knows its --help section."""

    def __init__(self, *args, section: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


def setting_option(name: str, f: dataclasses.Field, meta: Setting, *, default: object) -> Callable:
    """The click option of the declared setting ``name`` (field ``f``), defaulting to ``default``."""
    flag = option_flag(name)
    kwargs: dict = {"help": meta.help, "default": default, "cls": SettingOption, "section": meta.section}
    kind = str(f.type)
    if kind == "bool":
        flag = f"{flag}/--no-{flag[2:]}"
    elif kind.startswith("tuple[int"):  # a comma-separated list
        kwargs.update(default=",".join(map(str, default)), callback=_integers)
    else:
        kwargs["type"] = _click_type(f, meta)
        if kind.startswith("int") and meta.choices is not None:  # offered as words, held as numbers
            kwargs.update(default=None if default is None else str(default), callback=_as_int)
    return click.option(flag, name, **kwargs)


def run_options(fn: Callable, *, config_class: type = RunConfig) -> Callable:
    """Attach an option for every setting ``config_class`` declares (``psgrad.settings``)."""
    defaults = config_class()
    for name, (f, meta) in reversed(settings_of(config_class).items()):
        fn = setting_option(name, f, meta, default=getattr(defaults, name))(fn)
    return fn


COMMAND_SECTIONS = {"config_path": OUTPUT}
"""The --help sections of options a training command adds beside the settings (``--config``)."""


def section_of(param: click.Parameter) -> str:
    """The --help section of ``param``: its setting's, else 'Options' (a command's own, such as bench's)."""
    if isinstance(param, SettingOption):
        return param.section
    return COMMAND_SECTIONS.get(param.name or "", "Options")


class SectionedCommand(click.Command):
    """A command whose --help lists its options in SECTIONS, in that order, then the rest."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        grouped: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                grouped.setdefault(section_of(param), []).append(record)
        for title in [*SECTIONS, "Options"]:
            if grouped.get(title):
                with formatter.section(title):
                    formatter.write_dl(grouped[title])


_INVOCATION_ONLY = ("resume", "overwrite")  # how that run was started, not what it was


def config_option(fn):
    """``--config``: start from a logged run's settings; options on the command line win."""
    return click.option(
        "--config",
        "config_path",
        type=click.Path(exists=True),
        default=None,
        help="Rerun a logged run: its config.json (or the log dir holding it) gives every setting, "
        "and options given on the command line override them. --resume and --overwrite are not taken from it.",
    )(fn)


def with_config(options: dict, config_path: str | None) -> dict:
    """``options`` with every value the command line did not set taken from ``config_path``
    (a config.json or a log dir); a file psgrad cannot read is a usage error naming it."""
    if config_path is None:
        return options
    path = Path(config_path)
    path = path / "config.json" if path.is_dir() else path
    try:
        saved = asdict(RunConfig.from_json(path.read_text()))
    except (OSError, ValueError, TypeError) as err:
        raise click.UsageError(f"--config {config_path}: not a psgrad config.json ({err})") from None
    for key in _INVOCATION_ONLY:
        saved.pop(key, None)
    merged = dict(options)
    for key, value in saved.items():
        if key in merged and not on_command_line(key):
            merged[key] = value
    return merged


def on_command_line(name: str) -> bool:
    """Whether the current command's command line gave the option of parameter ``name``."""
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(name) == ParameterSource.COMMANDLINE


def set_off_default(name: str) -> bool:
    """Whether the current command's command line set the option of parameter ``name`` to a value
    other than its default (what ``refuse_unused`` refuses when the run ignores it)."""
    ctx = click.get_current_context()
    if not on_command_line(name):
        return False
    param = next(p for p in ctx.command.params if p.name == name)
    # process_value: the default as the command sees it, through the option's type and callback
    return ctx.params[name] != param.process_value(ctx, param.get_default(ctx))


def run_settings(options: dict) -> RunConfig:
    """A training command's settings, validated (a bad one is a usage error naming it).

    1. ``--config C``: C's settings for every option the command line did not give.
    2. Else ``--resume D`` (or ``D/ckpt-stepN``): the settings of the run in D (its config.json),
       so that ``--resume D --steps 40`` continues that run as it was, for longer.
    3. A resumed run logs on into D unless ``--log-dir`` says otherwise.
    4. An option the command line gave that means nothing to the run is refused (``refuse_unused``).
    """
    options = dict(options)
    config_path = options.pop("config_path", None)
    resumed = checkpoint.run_dir(options.get("resume"))
    merged = with_config(options, config_path or resumed)
    if resumed is not None and not on_command_line("log_dir"):
        merged["log_dir"] = str(resumed)
    cfg = config_from(merged)
    try:
        refuse_unused([name for name in merged if on_command_line(name)], cfg)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    return cfg


def config_from(options: dict) -> RunConfig:
    try:
        return RunConfig(**options).validate()
    except ValueError as err:
        raise click.UsageError(str(err)) from None


@click.command()
@run_options
def _row_options(**options) -> None:
    """Parses the train options of one bench row."""


def option_overrides(args: list[str]) -> dict:
    """The RunConfig fields that train options ``args`` set (only those given), validated by click."""
    from click.core import ParameterSource

    from .choices import current_flags

    try:
        ctx = _row_options.make_context("psgrad bench item", current_flags(list(args))[0])
    except click.ClickException as err:
        raise ValueError(f"{' '.join(args)!r}: {err.format_message()}") from None
    return {k: v for k, v in ctx.params.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
