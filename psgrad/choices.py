"""The names a user chooses among on the command line (models, datasets, feedback memories,
memory formats, non-finite policies), without importing torch: ``psgrad --help`` and its usage errors stay
quick. The modules that implement each choice import its names from here; ``psgrad.models``
checks that it builds exactly ``MODEL_NAMES``.
"""

from __future__ import annotations

MODEL_NAMES = ("alexnet", "convnet", "mlp", "resnet20", "resnet9", "wrn")
DATASETS = ("synthetic", "proxy", "digits", "cifar10", "cifar100")
FEEDBACKS = ("none", "ef", "dgc")
MEMORY_FORMATS = ("auto", "channels-last", "contiguous")
NONFINITE_POLICIES = ("abort", "skip")


def option_flag(name: str) -> str:
    """The command-line flag of the setting ``name`` (a RunConfig field or parameter): ``--widen-factor``."""
    return "--" + name.replace("_", "-")


RENAMED = {
    "eval_every": "eval_every_epochs",
    "eval_steps": "eval_every_steps",
    "checkpoint_every": "checkpoint_every_steps",
    "consensus_every": "consensus_every_steps",
}
"""Settings renamed so that their names say their unit, old name -> new. The old flags, and the
old keys of an older run's config.json, are still taken (with a note) for one release."""

RENAMED_FLAGS = {option_flag(old): option_flag(new) for old, new in RENAMED.items()} | {"--warmup": "--warmup-steps"}
"""The old flags -> the new (``psgrad bench``'s ``--warmup`` counts steps)."""


def current_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """``args`` with each renamed flag in its new spelling (``--eval-every 2`` and ``--eval-every=2``
    alike), and one note per renamed flag met; what follows a lone ``--`` is left alone."""
    out: list[str] = []
    notes: list[str] = []
    for i, word in enumerate(args):
        if word == "--":
            return out + list(args[i:]), notes
        flag, equals, value = word.partition("=")
        if flag in RENAMED_FLAGS:
            new = RENAMED_FLAGS[flag]
            notes.append(f"note: {flag} is now {new} (it says its unit); the old name goes in the next release")
            word = new + equals + value
        out.append(word)
    return out, notes


def wrn_depth_problem(depth: int) -> str | None:
    """Why ``depth`` is not a WideResNet depth (6n+4, n >= 1: 10, 16, 22, 28, 40, ...), or None."""
    if depth >= 10 and (depth - 4) % 6 == 0:
        return None
    return f"WideResNet depth must be 6n+4 with n >= 1 (10, 16, 22, 28, 40, ...), got {depth}"
