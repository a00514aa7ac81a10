"""The ``psgrad`` command group: its exit statuses, its help, and how a command's end reaches the
other ranks of a launch (``runtime.job.run_command``)."""

from __future__ import annotations

import click

TRAINING_COMMANDS = frozenset({"train", "server", "worker"})


class _Commands(click.Group):
    """Under a multi-rank launch, a training command's usage error is printed once for the job
    (by the lowest rank that has it, after every rank agreed; psgrad/startup.py), and every rank
    exits with status 2 — not once per rank, interleaved. A rank that stops or fails outside
    ``train.run`` ends the job (``runtime.job``)."""

    def invoke(self, ctx: click.Context):
        from ..runtime.job import run_command
        from ..runtime.signals import launched_ranks

        return run_command(
            lambda: super(_Commands, self).invoke(ctx),
            ctx=ctx,
            ranks=launched_ranks(),
            agrees_on_usage=lambda: ctx.invoked_subcommand in TRAINING_COMMANDS,
        )

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Renamed flags in their new spelling (``choices.RENAMED_FLAGS``), each with a note,
        said by one rank of a launch."""
        from ..choices import current_flags
        from ..runtime.signals import launched_rank

        args, notes = current_flags(args)
        if notes and not launched_rank():  # rank 0, or no launcher
            for note in dict.fromkeys(notes):
                click.echo(f"[psgrad] {note}", err=True)
        return super().parse_args(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command's whole first paragraph, wrapped, not cut at 45 characters."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, " ".join((command.help or "").split("\n\n")[0].split())))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


EXIT_STATUS = (
    "Exit status: 0 when the command did its work; 1 when it failed (the failing rank printed its error); 3 when a "
    "gradient was not finite and 4 when a checkpoint could not be written or resumed from or the disk was full (each would fail again "
    "if started again: launch/mpirun.sh --max-restarts does not restart them); 2 for a "
    "usage error (an option set to a value of its own where the run would not use it is one: --depth with --model "
    "mlp, --staleness without --mode async), settings the ranks do not agree on or unreadable data (said once, "
    "before the first step); 130 "
    "after Ctrl-C and 143 after SIGTERM (each rank said where it stopped, one rank which checkpoint resumes the run; "
    "after SIGTERM a run that writes checkpoints first saves one, after a step every rank agrees on). "
    "A rank killed outright (SIGKILL, a crash), or one that failed before MPI started (it prints its error, then ends "
    "itself by SIGTERM so that the job ends), ends mpiexec with a status of its own."
)


@click.group(
    cls=_Commands, epilog=EXIT_STATUS, context_settings={"help_option_names": ["-h", "--help"], "show_default": True}
)
@click.version_option(package_name="psgrad")
def main() -> None:
    """psgrad: data-parallel training through a parameter server whose every gradient is encoded."""
