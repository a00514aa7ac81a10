"""The output and system settings of a run: what is logged and kept, and where it runs."""

from __future__ import annotations

from dataclasses import dataclass

from ..choices import (
    MEMORY_FORMATS,
)
from ..settings import (
    OUTPUT,
    SYSTEM,
    setting,
)


@dataclass
class OutputSettings:
    """Logging, evaluation and checkpoints."""

    log_dir: str | None = setting(
        None,
        section=OUTPUT,
        path="dir",
        help="Write config.json, metrics.csv, eval.csv (and checkpoints) here; made if missing, and one that cannot be made or written is refused before training starts.",
    )
    eval_every_epochs: int = setting(
        1,
        section=OUTPUT,
        low=0,
        help="Evaluate on the test set every N epochs (0: only at the end).",
    )
    eval_every_steps: int = setting(
        0,
        section=OUTPUT,
        low=0,
        help="Also evaluate every N steps (0: only by --eval-every-epochs and at the end).",
    )
    eval_background: bool = setting(
        True,
        section=OUTPUT,
        help="Evaluate on a helper thread of rank 0 while training goes on (the workers never wait for it), or in the training loop (psgrad bench does, so time to accuracy leaves evaluation out exactly).",
    )
    tensorboard: bool = setting(
        False,
        section=OUTPUT,
        help="Also write TensorBoard event files to LOG_DIR/tb (needs tensorboardX: pip install 'psgrad[tensorboard]'; launch/setup.sh installs it with the test tools).",
    )
    progress: bool = setting(
        True,
        section=OUTPUT,
        help="Progress bar on rank 0: epoch, loss, it/s over the last 10 steps, MB per step.",
    )
    checkpoint_every_steps: int = setting(
        0,
        section=OUTPUT,
        low=0,
        help="Write a checkpoint every N steps (0: never), into --log-dir (without one, into ./checkpoints); with --log-dir the last step always writes one, and model.pt.",
    )
    keep_checkpoints: int = setting(
        2,
        section=OUTPUT,
        low=0,
        help="Keep the newest N complete checkpoints and delete older ones once a newer one is complete (0: keep all); the one a restart would resume from is never deleted before its successor is complete.",
    )
    overwrite: bool = setting(
        False,
        section=OUTPUT,
        help="Write into a --log-dir that holds a run already (its CSV files start over); without it that is refused.",
    )
    resume: str | None = setting(
        None,
        section=OUTPUT,
        path="existing-dir",
        help="Continue from a log dir (its newest complete checkpoint) or from one LOG_DIR/ckpt-stepN: the run's config.json gives every setting the command line does not (without --config), and the run logs on into that log dir (without --log-dir); e.g. --resume runs/a --steps 4000 trains it on to step 4000. Steps logged after the checkpoint are dropped from its CSV files.",
    )


@dataclass
class SystemSettings:
    """Device, threads, seed and time-out."""

    device: str = setting(
        "auto",
        section=SYSTEM,
        choices=("auto", "cpu", "cuda"),
        help="Worker device; cuda puts each worker on cuda:<its index among its node's workers> (servers stay on the CPU); auto: cuda where torch sees a GPU, else the CPU.",
    )
    threads: int = setting(
        1,
        section=SYSTEM,
        low=1,
        help="torch threads per rank; more than the cores rank 0 may use, counting every rank on its node, is noted at start-up (the ranks of a node share its cores).",
    )
    memory_format: str = setting(
        "auto",
        section=SYSTEM,
        choices=MEMORY_FORMATS,
        help="Layout of image batches in forward and backward: channels-last runs oneDNN's faster convolutions on CPU (1.07-1.3x the steps per second of contiguous on the bundled models); auto: channels-last on CPU, contiguous on CUDA. The math is the same either way.",
    )
    seed: int = setting(
        0,
        section=SYSTEM,
        help="Seed of the model, data order, augmentation and codec randomness.",
        your_loop=True,
    )
    timeout: float = setting(
        0.0,
        section=SYSTEM,
        low=0,
        help="Seconds a rank may stay silent (stopped, dead, cut off), or every rank may wait, before the job ends naming the rank; 0: max(60, 10 x the slowest step so far). A wait this long for a rank that is busy ends nothing: rank 0 names the busy rank.",
        your_loop=True,
    )
