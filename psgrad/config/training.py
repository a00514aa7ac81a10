"""The optimizer and training settings of a run."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import (
    TRAINING,
    UnusedRule,
    setting,
    unless,
)


def _multistep_only(flag: str) -> UnusedRule:
    return unless(
        lambda cfg: cfg.schedule == "multistep",
        flag + " shapes --schedule multistep: it means nothing to --schedule {cfg.schedule}",
    )


def _local_steps_only(flag: str) -> UnusedRule:
    return unless(lambda cfg: cfg.local_steps > 0, flag + " shapes --local-steps: give --local-steps H")


@dataclass
class TrainingSettings:
    """The optimizer, its schedule, the batch and the length of the run."""

    optimizer: str = setting(
        "sgd",
        section=TRAINING,
        choices=("sgd", "adam"),
        help="Server-side optimizer.",
    )
    lr: float = setting(
        0.1,
        section=TRAINING,
        low=0,
        low_open=True,
        help="Learning rate.",
    )
    momentum: float = setting(
        0.9,
        section=TRAINING,
        low=0,
        high=1,
        high_open=True,
        unused=(
            unless(
                lambda cfg: cfg.optimizer == "sgd",
                "--momentum is SGD's: --optimizer {cfg.optimizer} keeps moments of its own",
            ),
        ),
        help="SGD momentum (server side).",
    )
    nesterov: bool = setting(
        False,
        section=TRAINING,
        unused=(
            unless(
                lambda cfg: cfg.optimizer == "sgd" or cfg.feedback == "dgc",
                "--nesterov is SGD's (and DGC's): --optimizer {cfg.optimizer} keeps moments of its own",
            ),
        ),
        help="Nesterov momentum: the server's SGD's, or with --feedback dgc, DGC's momentum correction on the workers (--dgc-momentum).",
        your_loop=True,  # DGC's: your loop refuses it without --feedback dgc (psgrad.userloop)
    )
    weight_decay: float = setting(
        0.0005,
        section=TRAINING,
        low=0,
        help="L2 weight decay.",
    )
    schedule: str = setting(
        "constant",
        section=TRAINING,
        choices=("constant", "multistep", "cosine"),
        help="Learning-rate schedule.",
    )
    lr_milestones: tuple[int, ...] = setting(
        (60, 120, 160),
        section=TRAINING,
        unused=(_multistep_only("--lr-milestones"),),
        help="multistep: epochs at which the LR is multiplied by --lr-decay.",
    )
    lr_decay: float = setting(
        0.2,
        section=TRAINING,
        low=0,
        low_open=True,
        unused=(_multistep_only("--lr-decay"),),
        help="multistep: factor per milestone (WRN paper: 0.2).",
    )
    warmup_epochs: float = setting(
        0.0,
        section=TRAINING,
        low=0,
        help="Linear LR warm-up length in epochs.",
    )
    scale_lr: bool = setting(
        False,
        section=TRAINING,
        help="Multiply the LR by the number of workers.",
    )
    batch_size: int = setting(
        32,
        section=TRAINING,
        low=1,
        help="Batch size per worker.",
    )
    steps: int | None = setting(
        None,
        section=TRAINING,
        low=1,
        help="Training steps (overrides --epochs).",
    )
    epochs: float = setting(
        1.0,
        section=TRAINING,
        low=0,
        low_open=True,
        help="Training epochs (of each worker's shard).",
    )
    accumulate: int = setting(
        1,
        section=TRAINING,
        low=1,
        help="Split each worker's batch into K micro-batches: forward and backward on each (less memory), one summed gradient sent per step. Same effective batch and learning rate.",
    )
    clip_grad_norm: float = setting(
        0.0,
        section=TRAINING,
        low=0,
        help="Clip each worker's gradient to this L2 norm (over all its layers) before coding; 0: off. Needs the whole gradient, so layers are coded after backward, as with --push after.",
    )
    local_steps: int = setting(
        0,
        section=TRAINING,
        low=0,
        help="Local steps H (DiLoCo): each worker takes H steps with its own optimizer (--inner-optimizer, --lr and its schedule; in your own loop, yours), then pushes the change of its parameters since the last exchange through the codec; the servers average it and apply the outer optimizer (--outer-optimizer). A step is still one batch. 0: off, a gradient every step.",
        your_loop=True,
    )
    inner_optimizer: str = setting(
        "sgd",
        section=TRAINING,
        choices=("sgd", "adamw"),
        unused=(_local_steps_only("--inner-optimizer"),),
        help="The workers' optimizer between exchanges (--local-steps): SGD with --momentum and --nesterov, or AdamW; both with --lr, its schedule and --weight-decay.",
    )
    outer_optimizer: str = setting(
        "nesterov",
        section=TRAINING,
        choices=("nesterov", "sgd"),
        unused=(_local_steps_only("--outer-optimizer"),),
        help="The optimizer of the averaged parameter change (--local-steps; the servers apply it, in your own loop every worker): SGD with Nesterov momentum (DiLoCo's), or plain SGD with momentum.",
        your_loop=True,
    )
    outer_lr: float = setting(
        0.7,
        section=TRAINING,
        low=0,
        low_open=True,
        unused=(_local_steps_only("--outer-lr"),),
        help="The outer optimizer's learning rate (--local-steps; DiLoCo: 0.7). 1 with --outer-momentum 0: the average of the workers' parameters.",
        your_loop=True,
    )
    outer_momentum: float = setting(
        0.5,
        section=TRAINING,
        low=0,
        high=1,
        high_open=True,
        unused=(_local_steps_only("--outer-momentum"),),
        help="The outer optimizer's momentum (--local-steps). 0.5 learned as well as dense on both datasets measured at 32 local steps, where DiLoCo's 0.9 trailed (docs/benchmarks.md, \"Slow links\").",
        your_loop=True,
    )
    overlap_exchange: bool = setting(
        False,
        section=TRAINING,
        unused=(_local_steps_only("--overlap-exchange"),),
        help="With --local-steps: an exchange does not wait. Each worker takes the outer step itself with its own change (a replica of the servers' optimizer) and trains on from there while the change travels; at the next exchange it moves by the servers' result minus its own (eager DiLoCo). The exchange before a checkpoint and the last one wait.",
    )
    overlap_steps: int = setting(
        0,
        section=TRAINING,
        low=0,
        unused=(
            unless(
                lambda cfg: cfg.overlap_exchange,
                "--overlap-steps shapes --overlap-exchange: give --overlap-exchange",
            ),
        ),
        help="With --overlap-exchange: take the servers' result this many steps after the exchange (waiting there if it has not arrived) instead of at the next exchange. Fewer steps start the workers from a less stale point; a slow link needs enough steps of compute to hide the exchange. 0: at the next exchange, H steps later.",
    )
    fragments: int = setting(
        1,
        section=TRAINING,
        low=1,
        unused=(_local_steps_only("--fragments"),),
        help="With --local-steps H: split the model into this many fragments of consecutive layers (balanced by size) that exchange at staggered steps, one every H/F steps, each still every H steps (Streaming DiLoCo). The link carries a fragment's bytes at a time instead of the whole model's; with --overlap-exchange each fragment's reply is taken --overlap-steps after its own exchange. 1: the whole model at once.",
    )
    amp: str = setting(
        "off",
        section=TRAINING,
        choices=("off", "bf16", "fp16"),
        help="Mixed precision for forward and backward (torch.autocast, CPU or CUDA); fp16 also scales the loss dynamically (as GradScaler) and needs --on-nonfinite skip. Gradients are coded in fp32.",
    )
