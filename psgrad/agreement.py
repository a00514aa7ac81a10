"""What every rank agrees on before training: nobody has a usage error, and all run one config.

An MPMD launch (``psgrad server … : psgrad worker …``) or a typo in one rank's command line can
give ranks different settings; run on anyway, they would send each other messages of the wrong
codec or stop at different steps. And a usage error that every rank hits prints once per rank.
So the first thing every rank does under MPI is ``agree``:
1. One allreduce of a one-hot vector: which ranks have a usage error. If any, the lowest of them
   prints its error (once for the whole job) and every rank raises ``AgreementError``.
2. Rank 0 broadcasts its config; every rank compares it with its own, leaving out the settings
   that may differ per rank (``PER_RANK``).
3. One more one-hot allreduce: which ranks differ. The lowest of them prints one error naming
   each differing option with its value there and on rank 0; every rank raises ``AgreementError``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn, TypeVar

from .choices import option_flag

if TYPE_CHECKING:  # the interface loads numpy: not for --help
    from .comm.channel import Channel
    from .config import RunConfig

T = TypeVar("T")

PER_RANK = frozenset({"device", "threads", "progress"})
"""Settings a rank may have of its own (a GPU worker beside a CPU server, the bar on rank 0)."""


class AgreementError(ValueError):
    """The ranks do not agree; the message was printed once, by one rank. ``status`` is the exit
    status every rank ends with (runtime/exits.py): 2 for a usage error, unless the agreed error
    is of another kind (4 for a checkpoint that cannot be resumed from)."""

    def __init__(self, message: str, *, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def _first(transport: Channel, mine: bool) -> int | None:
    """The lowest rank for which ``mine`` is true (one allreduce), or None."""
    flags = [0.0] * transport.size
    flags[transport.rank] = 1.0 if mine else 0.0
    total = transport.allreduce_sum(flags)
    return next((rank for rank, flag in enumerate(total) if flag), None)


def config_difference(mine: dict, theirs: dict) -> list[str]:
    """One ``--option: value here, value on rank 0`` entry per differing run setting."""
    return [
        f"{option_flag(key)} {mine.get(key)!r} here, {theirs.get(key)!r} on rank 0"
        for key in sorted(set(mine) | set(theirs))
        if key not in PER_RANK and mine.get(key) != theirs.get(key)
    ]


def fail_together(error: str, *, says: bool, kind: str, status: int = 2) -> NoReturn:
    """End every rank with ``error``, which each found alike from one collective's result (no
    collective more is needed to agree on it): the rank that ``says`` prints it, once for the job,
    and every rank raises ``AgreementError`` with ``status``."""
    if says:
        print(f"[psgrad] {kind}: {error}", file=sys.stderr, flush=True)
    raise AgreementError(error, status=status)


def agree_on_errors(transport: Channel, error: str | None, kind: str = "usage error") -> None:
    """Return when no rank has an error (step 1 of the module doc; collective): a rank passes its
    message or None; when any rank has one, the lowest such rank prints it and every rank raises
    ``AgreementError``. ``kind`` names the error where it is printed."""
    if transport.size == 1:
        if error is not None:
            fail_together(error, says=True, kind=kind)
        return
    first = _first(transport, error is not None)
    if first is not None:
        if first == transport.rank:
            print(f"[psgrad rank {first}] {kind}: {error}", file=sys.stderr, flush=True)
        raise AgreementError(f"rank {first} has a {kind}")


def agree(transport: Channel, cfg: RunConfig | None, usage_error: str | None = None, kind: str = "usage error") -> None:
    """Return when every rank is free of usage errors and runs rank 0's config (see module doc).

    A rank with a usage error passes its message (and ``cfg=None`` if it has none); it raises.
    ``kind`` names the error where it is printed (a "data error": an unreadable dataset)."""
    agree_on_errors(transport, usage_error, kind)
    if transport.size == 1:
        return
    mine = json.loads(cfg.to_json())
    theirs = json.loads(transport.broadcast_bytes(cfg.to_json().encode() if transport.rank == 0 else None))
    differences = config_difference(mine, theirs)
    first = _first(transport, bool(differences))
    if first is not None:
        if first == transport.rank:
            print(
                f"[psgrad rank {first}] the ranks run different configurations; give every rank the same options: "
                + "; ".join(differences),
                file=sys.stderr,
                flush=True,
            )
        raise AgreementError(f"rank {first} runs another configuration than rank 0")


def read_agreed(
    transport: Channel,
    read: Callable[[], T],
    *,
    problems: tuple[type[Exception], ...],
    cfg: RunConfig | None = None,
) -> T | None:
    """``read()`` on every rank, then agree (collective): a read that fails with one of
    ``problems`` (a dataset that cannot serve the run, a missing file) is one error for the job,
    said once by the lowest rank that has it, and ``AgreementError`` on every rank; not a
    traceback per rank. With ``cfg`` the ranks also agree on it (a job whose settings nothing
    agreed on yet); without, only on the read (a run's settings are agreed at its start)."""
    try:
        result, problem = read(), None
    except problems as err:
        result, problem = None, str(err)
    if cfg is None:
        agree_on_errors(transport, problem, "data error")
    else:
        agree(transport, None if problem else cfg, problem, "data error")
    return result
