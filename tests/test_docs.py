from pathlib import Path

import click

from psgrad.cli import main

DOCS = Path(__file__).parent.parent / "docs"


def test_every_cli_option_has_help_and_a_line_in_docs():
    text = (DOCS / "cli.md").read_text()
    for name, cmd in main.commands.items():
        assert cmd.help, name
        for param in cmd.params:
            if isinstance(param, click.Option):
                assert param.help, f"{name} {param.opts}"
                assert f"`{' / '.join(param.opts + param.secondary_opts)}`" in text, (
                    f"{name} {param.opts} missing from docs/cli.md"
                )


def test_cli_reference_is_current():
    from psgrad.clidoc import markdown

    assert (DOCS / "cli.md").read_text() == markdown(), "docs/cli.md is stale: python -m psgrad.clidoc > docs/cli.md"


def test_every_codec_has_a_budget_line():
    from psgrad.codecs import available_codecs

    text = (DOCS / "codecs.md").read_text()
    for name in available_codecs():
        assert f"`{name}" in text, name
