"""docs/cli.md, generated from the click commands: ``python -m psgrad.clidoc > docs/cli.md``."""

from __future__ import annotations

import inspect

import click

ORDER = ("train", "server", "worker", "simulate", "bench", "codecs", "plot")


def _default(param: click.Parameter) -> str:
    default = param.default
    if repr(default).startswith("Sentinel."):  # click's "no default given": a flag is then off
        default = False if getattr(param, "is_flag", False) else None
    if isinstance(param, click.Argument) or default is None or default == "":
        return ""
    if isinstance(default, (tuple, list)):  # an option given more than once: its values, not a tuple's repr
        default = ", ".join(map(str, default))
    return str(default).replace("|", "\\|")


def markdown() -> str:
    """docs/cli.md: a title, then one section per command, in ORDER (then any other, by name)."""
    from .cli import main

    lines = [
        "# Command-line reference",
        "",
        "Every option of every `psgrad` command, generated from the commands themselves "
        "(`python -m psgrad.clidoc > docs/cli.md`; `tests/test_docs.py` fails when this file is stale).",
        "",
        main.epilog or "",
    ]
    for name in [*ORDER, *sorted(set(main.commands) - set(ORDER))]:  # a new command is never left out
        lines += command_lines(name, main.commands[name])
    return "\n".join(lines) + "\n"


def command_lines(name: str, cmd: click.Command) -> list[str]:
    """The section of command ``name``.

    1. Its heading and help text.
    2. One table row per parameter: flags, default, help (arguments are marked positional); a
       command with --help sections has one table per section, in the sections' order.
    """
    from .options import SECTIONS, SectionedCommand, section_of

    lines = [
        "",
        f"## psgrad {name}",
        "",
        inspect.cleandoc(cmd.help or ""),
        "",
        "| option | default | meaning |",
        "|---|---|---|",
    ]
    sectioned = isinstance(cmd, SectionedCommand)
    if sectioned:
        lines[-2:] = []
    for title in [*SECTIONS, "Options"] if sectioned else [None]:
        params = [p for p in cmd.params if title is None or section_of(p) == title]
        if not params:
            continue
        if title is not None:
            lines += [f"### {title}", "", "| option | default | meaning |", "|---|---|---|"]
        for param in params:
            if isinstance(param, click.Option):
                flags = " / ".join(param.opts + param.secondary_opts)
                text = (param.help or "").replace("|", "\\|")
                if isinstance(param.type, click.Choice):
                    text += " Choices: " + ", ".join(f"`{c}`" for c in param.type.choices) + "."
            else:
                flags, text = param.name.upper(), "positional"
            lines.append(f"| `{flags}` | {_default(param)} | {text} |")
        if title is not None:
            lines.append("")
    if sectioned:
        lines.pop()
    return lines


if __name__ == "__main__":
    print(markdown(), end="")
