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


def wrn_depth_problem(depth: int) -> str | None:
    """Why ``depth`` is not a WideResNet depth (6n+4, n >= 1: 10, 16, 22, 28, 40, ...), or None."""
    if depth >= 10 and (depth - 4) % 6 == 0:
        return None
    return f"WideResNet depth must be 6n+4 with n >= 1 (10, 16, 22, 28, 40, ...), got {depth}"
