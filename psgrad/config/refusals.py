"""Refusing a run setting that would mean nothing: to the run (the command line's rule, also
``psgrad bench``'s rows), or to a user's own training loop (``psgrad.init``, ``psgrad.ddp_hook``).
Pure Python: no click, no torch."""

from __future__ import annotations

from ..roles import topology_of
from ..settings import named_with_guesses, settings_of, unused_reason
from . import RunConfig


def unused_option(name: str, cfg: RunConfig) -> str | None:
    """Why the run option of field ``name`` has no effect on the run ``cfg``, or None when it has
    one: the run's topology ignores it (``Topology.ignores``), or a rule of its own declaration
    (``Setting.unused``) says why."""
    ignored = topology_of(cfg.topology).ignores.get(name)
    if ignored is not None:
        return ignored
    return unused_reason(settings_of(type(cfg))[name][1], cfg)


def refuse_unused(given: list[str], cfg: RunConfig) -> None:
    """Raise ValueError naming the first of the run options ``given`` (field names) that sets a
    value other than its default and has no effect on ``cfg``: silently ignored, it would leave the
    user believing the run used it. An option left at its default stays quiet (a script may pass
    every option every time)."""
    defaults = type(cfg)()
    for name in given:
        if getattr(cfg, name) != getattr(defaults, name) and (why := unused_option(name, cfg)) is not None:
            raise ValueError(why)


def your_loop_config(settings: dict, *, caller: str, takes: list[str]) -> RunConfig:
    """The settings given to a door into a user's own loop (``psgrad.init``, ``psgrad.ddp_hook``)
    as a validated ``RunConfig``; else ValueError naming the setting:

    1. A name that is no setting, or a setting ``caller`` does not take (``takes``): psgrad's own
       loop's (model, data, optimizer, logging, ...), which would silently mean nothing.
    2. ``nesterov`` is DGC's momentum correction there: it needs ``feedback="dgc"``.
    3. The command line's checks, with no server momentum of psgrad's (the servers only sum, or
       there are none: DGC's momentum, on the workers, has nothing to clash with).
    4. The command line's refusals of settings the run ignores (DGC's without DGC, ...).
    """
    unknown = sorted(set(settings) - set(settings_of(RunConfig)))
    if unknown:
        raise ValueError(
            f"{caller}: unknown setting(s) {named_with_guesses(unknown, known=takes)}: the names are RunConfig's "
            "(docs/cli.md)"
        )
    theirs = [name for name in settings if name not in takes]
    if theirs:
        raise ValueError(
            f"{caller}: {', '.join(theirs)} {'is a setting' if len(theirs) == 1 else 'are settings'} of psgrad's "
            "own loop (psgrad train, or psgrad.train.run with your model, data and optimizer) and would mean "
            "nothing to yours, which has its own model, data, optimizer, schedule, precision and checkpoints. "
            f"{caller} takes: {', '.join(takes)}"
        )
    if settings.get("nesterov") and settings.get("feedback") != "dgc":
        raise ValueError(f"{caller}: nesterov is DGC's momentum correction here: it needs feedback='dgc'")
    try:
        cfg = RunConfig(**{"progress": False, "momentum": 0.0, **settings}).validate()
        refuse_unused(list(settings), cfg)
    except ValueError as err:
        raise ValueError(f"{caller}: {err}") from None
    return cfg
