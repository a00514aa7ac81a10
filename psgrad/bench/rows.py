"""What a ``psgrad bench`` row is: a codec spec or baseline name, optionally followed by train
options that hold for that row only, and ``--api optimizer`` to train it through your own loop.

1. ``item_api`` takes ``--api X`` off the row.
2. ``item_config`` gives the row's codec (or baseline) and its validated run: the bench's settings
   with the row's options over them, refused when an option is not a row's to set (the run's
   length and logs are the bench's) or would mean nothing to that run.
3. ``ranks_for`` is the number of ranks the row's job takes.
4. ``measured_accuracy`` is what psgrad measured of the row's accuracy, for its speed to be read
   beside it.
"""

from __future__ import annotations

import shlex
from dataclasses import replace

from ..accuracy import is_dense, measured
from ..config import RunConfig
from ..config.refusals import refuse_unused
from ..options import option_overrides
from ..roles import topology_of
from .baselines import BASELINES
from .jobs import BenchError

API_CHOICES = ("train", "optimizer")
"""How a codec row trains: ``train`` (psgrad's loop, the default) or ``optimizer`` (a plain torch
loop with ``psgrad.DistributedOptimizer``, psgrad/bench/ownloop.py)."""


def item_api(item: str) -> tuple[str, str]:
    """The item without its ``--api X`` option, and X (``train`` when not given)."""
    words = shlex.split(item)
    if "--api" not in words:
        return item, "train"
    at = words.index("--api")
    if at + 1 >= len(words) or words[at + 1] not in API_CHOICES:
        raise BenchError(f"{item!r}: --api must be one of {', '.join(API_CHOICES)}")
    if words[0] in BASELINES:
        raise BenchError(f"{item!r}: --api is a codec row's option; {words[0]} is a baseline")
    return shlex.join(words[:at] + words[at + 2 :]), words[at + 1]


_BENCH_SETS = {
    "steps": "every row runs the bench's --steps after its --warmup-steps",
    "epochs": "every row runs the bench's --steps after its --warmup-steps",
    "eval_every_epochs": "a row evaluates only with --target-accuracy, every --eval-every-steps",
    "eval_background": "a row evaluates in the foreground, its time taken out of the clock",
    "log_dir": "the bench's --log-dir keeps each row's logs in a folder of its own",
    "resume": "every run of a row starts afresh",
}
"""The run settings the bench sets for every row, which a row's own options cannot change."""


def item_config(item: str, cfg: RunConfig) -> tuple[str, RunConfig]:
    """Split an item into its codec spec (or baseline name) and the run it needs.

    An item is a codec spec or baseline name, optionally followed by train options that hold for
    that row only: ``topk:ratio=0.01 --feedback ef --down-codec topk:ratio=0.01``; ``--api
    optimizer`` trains the row through your own loop instead (``item_api``).
    """
    head, *rest = shlex.split(item_api(item)[0]) or [""]
    overrides = option_overrides(rest) if rest else {}
    if taken := sorted(overrides.keys() & _BENCH_SETS.keys()):
        raise ValueError(f"{item!r}: --{taken[0].replace('_', '-')} is not a row's to set: {_BENCH_SETS[taken[0]]}")
    if head not in BASELINES:
        overrides["codec"] = head
    run = replace(cfg, **overrides).validate()
    refuse_unused([name for name in overrides if name != "codec"], run)
    return head, run


def ranks_for(item: str, cfg: RunConfig, workers: int) -> int:
    head, cfg = item_config(item, cfg)
    if head in BASELINES:
        return workers
    return topology_of(cfg.topology).ranks_needed(workers=workers, servers=cfg.servers)


def measured_accuracy(item: str, cfg: RunConfig, *, powersgd_rank: int) -> dict:
    """What psgrad measured of the row's test accuracy at equal epochs (psgrad/accuracy.py), as
    ``BenchRow``'s fields: ``of_dense``, the lowest of its fractions of dense over the datasets
    it was measured on, and ``trails``. Dense training (DDP's too) is 1 by definition; DDP's
    PowerSGD hook is judged by psgrad's PowerSGD of its rank (the two matched where both were
    measured); compute-only learns nothing and a combination never measured has no figure, as
    your loop's local steps with a coded down-link have none (psgrad train codes another thing)."""
    from ..userloop.local import coded_change_note  # your loop's, loaded only here

    head, run = item_config(item, cfg)
    if head == "compute" or (item_api(item)[1] == "optimizer" and coded_change_note(run) is not None):
        return {}
    if head == "ddp-powersgd":
        run = RunConfig(codec=f"powersgd:rank={powersgd_rank}", topology="colocated")
    if head == "ddp" or is_dense(run):
        return {"of_dense": 1.0}
    found = measured(run)
    if found is None:
        return {}
    return {"of_dense": found.lowest, "trails": found.trails}
