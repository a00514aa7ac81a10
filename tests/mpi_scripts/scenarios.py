"""Several runs in one mpiexec job: three ranks importing torch take about 5 s of a 2-core machine,
so the test scripts that compare runs take a list of them and pay that start-up once."""

from collections.abc import Iterator, Sequence


def split_runs(args: Sequence[str]) -> Iterator[list[str]]:
    """The argument lists of the runs in ``args``, which separates them by ``--`` (empty ones skipped)."""
    run: list[str] = []
    for arg in [*args, "--"]:
        if arg != "--":
            run.append(arg)
        elif run:
            yield run
            run = []
