"""The run options every training command shares (train, server, worker, bench): one table,
attached to click commands by ``run_options``, and the parsing of a bench row's own options."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import click

from . import checkpoint
from .choices import DATASETS, FEEDBACKS, MEMORY_FORMATS, MODEL_NAMES, NONFINITE_POLICIES, option_flag
from .comm.layout import LAYOUTS, TOPOLOGIES
from .config import RunConfig

_DEFAULTS = RunConfig()


def _milestones(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated epochs like 60,120,160, got {value!r}") from None


# (flag, RunConfig field, click type, help). One table serves train, server and worker.
RUN_OPTIONS = [
    ("--model", "model", click.Choice(MODEL_NAMES), "Model architecture."),
    ("--depth", "depth", click.IntRange(min=10), "Only --model wrn: WideResNet depth (6n+4: 10, 16, 22, 28, 40)."),
    ("--widen-factor", "widen_factor", click.IntRange(min=1), "Only --model wrn: WideResNet width multiplier k."),
    ("--dropout", "dropout", click.FloatRange(0, 1, max_open=True), "Only --model wrn: dropout between convolutions."),
    (
        "--dataset",
        "dataset",
        click.Choice(list(DATASETS)),
        "Training data. synthetic and proxy are generated from --seed: synthetic is easy (dense reaches 100 % "
        "in a few epochs), proxy is the harder accuracy proxy for comparing codecs (docs/training.md).",
    ),
    (
        "--data-dir",
        "data_dir",
        click.Path(file_okay=False),
        "--dataset cifar10 or cifar100: directory with the CIFAR python archives (extracted or .tar.gz).",
    ),
    (
        "--synthetic-classes",
        "synthetic_classes",
        click.Choice(["10", "100"]),
        "Only --dataset synthetic or proxy: its number of classes.",
    ),
    (
        "--synthetic-size",
        "synthetic_size",
        click.IntRange(min=1),
        "Training samples of a generated dataset [default: 2048 synthetic, 8192 proxy].",
    ),
    (
        "--partition",
        "partition",
        click.Choice(["random", "contiguous"]),
        "How the training set is split over workers (reshuffled each epoch).",
    ),
    ("--augment/--no-augment", "augment", None, "Random crop (4-pixel padding) and horizontal flip."),
    ("--codec", "codec", str, "Gradient codec spec, e.g. qsgd:levels=16 or topk:ratio=0.01 (see psgrad codecs)."),
    (
        "--down-codec",
        "down_codec",
        str,
        "Server-to-worker codec: none sends each layer's new value; any other codec sends the encoded change "
        "since what the workers hold, the server keeping the rest for later steps (error feedback).",
    ),
    (
        "--feedback",
        "feedback",
        click.Choice(list(FEEDBACKS)),
        "Worker-side memory around the codec: error feedback or DGC.",
    ),
    (
        "--dgc-momentum",
        "dgc_momentum",
        click.FloatRange(0, 1, max_open=True),
        "DGC: momentum kept on the workers (use --momentum 0).",
    ),
    (
        "--dgc-clip-norm",
        "dgc_clip_norm",
        click.FloatRange(min=0, min_open=True),
        "DGC: local gradient clipping norm (default: off).",
    ),
    (
        "--dgc-warmup-epochs",
        "dgc_warmup_epochs",
        click.IntRange(min=0),
        "DGC: epochs of exponential sparsity warm-up (needs a codec with ratio).",
    ),
    (
        "--granularity",
        "granularity",
        click.Choice(["layer", "model"]),
        "One message per parameter tensor, or the whole model as one.",
    ),
    (
        "--push",
        "push",
        click.Choice(["backward", "after"]),
        "layer granularity: send each layer from backward as soon as its gradient is ready, or code all "
        "layers after backward and send them first layer first (the next forward starts on the first "
        "replies while the rest are in flight).",
    ),
    (
        "--accumulate",
        "accumulate",
        click.IntRange(min=1),
        "Split each worker's batch into K micro-batches: forward and backward on each (less memory), "
        "one summed gradient sent per step. Same effective batch and learning rate.",
    ),
    (
        "--clip-grad-norm",
        "clip_grad_norm",
        click.FloatRange(min=0),
        "Clip each worker's gradient to this L2 norm (over all its layers) before coding; 0: off. Needs the "
        "whole gradient, so layers are coded after backward, as with --push after.",
    ),
    (
        "--amp",
        "amp",
        click.Choice(["off", "bf16", "fp16"]),
        "Mixed precision for forward and backward (torch.autocast, CPU or CUDA); fp16 also scales the loss "
        "dynamically (as GradScaler) and needs --on-nonfinite skip. Gradients are coded in fp32.",
    ),
    (
        "--bucket-vectors/--no-bucket-vectors",
        "bucket_vectors",
        None,
        "layer granularity: send all 1-D parameters (biases, norm scales and shifts) as one uncompressed "
        "message per step, or each as its own compressed layer.",
    ),
    (
        "--serve-thread/--no-serve-thread",
        "serve_thread",
        None,
        "colocated: also serve this rank's shard from a helper thread, not only between the worker's hooks "
        "and inside its waits (measured slower on 2 cores, docs/benchmarks.md).",
    ),
    (
        "--on-nonfinite",
        "on_nonfinite",
        click.Choice(list(NONFINITE_POLICIES)),
        "A NaN or Inf in a gradient or a server's sum: abort the job naming the step, rank and layer, or "
        "skip: drop that layer's update at that step on every rank (counted in metrics.csv's nonfinite).",
    ),
    ("--optimizer", "optimizer", click.Choice(["sgd", "adam"]), "Server-side optimizer."),
    ("--lr", "lr", click.FloatRange(min=0, min_open=True), "Learning rate."),
    ("--momentum", "momentum", click.FloatRange(0, 1, max_open=True), "SGD momentum (server side)."),
    (
        "--nesterov/--no-nesterov",
        "nesterov",
        None,
        "Nesterov momentum: the server's SGD's, or with --feedback dgc, DGC's momentum correction on the workers "
        "(--dgc-momentum).",
    ),
    ("--weight-decay", "weight_decay", click.FloatRange(min=0), "L2 weight decay."),
    ("--schedule", "schedule", click.Choice(["constant", "multistep", "cosine"]), "Learning-rate schedule."),
    ("--lr-milestones", "lr_milestones", None, "multistep: epochs at which the LR is multiplied by --lr-decay."),
    (
        "--lr-decay",
        "lr_decay",
        click.FloatRange(min=0, min_open=True),
        "multistep: factor per milestone (WRN paper: 0.2).",
    ),
    ("--warmup-epochs", "warmup_epochs", click.FloatRange(min=0), "Linear LR warm-up length in epochs."),
    ("--scale-lr/--no-scale-lr", "scale_lr", None, "Multiply the LR by the number of workers."),
    ("--batch-size", "batch_size", click.IntRange(min=1), "Batch size per worker."),
    ("--steps", "steps", click.IntRange(min=1), "Training steps (overrides --epochs)."),
    ("--epochs", "epochs", click.FloatRange(min=0, min_open=True), "Training epochs (of each worker's shard)."),
    (
        "--servers",
        "servers",
        click.IntRange(min=1),
        "--topology ps: server ranks (0..S-1); layers are sharded over them by size.",
    ),
    (
        "--mode",
        "mode",
        click.Choice(["sync", "async"]),
        "sync: average all workers per step; async: apply each worker's gradient on arrival.",
    ),
    ("--staleness", "staleness", click.IntRange(min=0), "async: how many steps a worker may run ahead of the slowest."),
    (
        "--topology",
        "topology",
        click.Choice(list(TOPOLOGIES)),
        "ps: server ranks and worker ranks; colocated: every rank works and serves a shard of the layers "
        "(no extra server rank); alltoall: no server, every rank exchanges with every other; ring / torus: no "
        "server, every rank gossips with its ring or torus neighbours only (CHOCO-SGD).",
    ),
    (
        "--consensus-step",
        "consensus_step",
        click.FloatRange(0, 1, min_open=True),
        "ring or torus: gamma of CHOCO-SGD's consensus step x += gamma sum_j w_ij (x_hat_j - x_hat_i); 1 with codec none "
        "is exact gossip averaging, lossy codecs need less (docs/training.md).",
    ),
    (
        "--grid",
        "grid",
        str,
        "torus: RxC, rows x columns of the torus (= the number of ranks, placed row-major); each rank gossips "
        "with the ranks above, below, left and right of it, wrapping around.",
    ),
    (
        "--consensus-every",
        "consensus_every",
        click.IntRange(min=0),
        "ring or torus: log the consensus distance (1/N) sum ||x_i - x_mean||^2 in metrics.csv every N steps and at the "
        "last (one allreduce of the model each time; 0: never).",
    ),
    (
        "--device",
        "device",
        click.Choice(["auto", "cpu", "cuda"]),
        "Worker device; cuda puts each worker on cuda:<its index among its node's workers> (servers stay on the CPU).",
    ),
    ("--threads", "threads", click.IntRange(min=1), "torch threads per rank."),
    (
        "--memory-format",
        "memory_format",
        click.Choice(MEMORY_FORMATS),
        "Layout of image batches in forward and backward: channels-last runs oneDNN's faster convolutions on "
        "CPU (1.07-1.3x the steps per second of contiguous on the bundled models); auto: channels-last on "
        "CPU, contiguous on CUDA. The math is the same either way.",
    ),
    ("--seed", "seed", int, "Seed of the model, data order, augmentation and codec randomness."),
    (
        "--timeout",
        "timeout",
        click.FloatRange(min=0),
        "Seconds a rank may stay silent (stopped, dead, cut off), or every rank may wait, before the job "
        "ends naming the rank; 0: max(60, 10 x the slowest step so far).",
    ),
    (
        "--log-dir",
        "log_dir",
        click.Path(file_okay=False),
        "Write config.json, metrics.csv, eval.csv (and checkpoints) here; made if missing, and one that cannot be made or written is refused before training starts.",
    ),
    (
        "--eval-every",
        "eval_every",
        click.IntRange(min=0),
        "Evaluate on the test set every N epochs (0: only at the end).",
    ),
    (
        "--eval-steps",
        "eval_steps",
        click.IntRange(min=0),
        "Also evaluate every N steps (0: only by --eval-every epochs and at the end).",
    ),
    (
        "--eval-background/--no-eval-background",
        "eval_background",
        None,
        "Evaluate on a helper thread of rank 0 while training goes on (the workers never wait for it), "
        "or in the training loop (psgrad bench does, so time to accuracy leaves evaluation out exactly).",
    ),
    (
        "--tensorboard/--no-tensorboard",
        "tensorboard",
        None,
        "Also write TensorBoard event files to LOG_DIR/tb (needs tensorboardX: pip install 'psgrad[tensorboard]'; launch/setup.sh installs it with the test tools).",
    ),
    (
        "--progress/--no-progress",
        "progress",
        None,
        "Progress bar on rank 0: epoch, loss, it/s over the last 10 steps, MB per step.",
    ),
    (
        "--checkpoint-every",
        "checkpoint_every",
        click.IntRange(min=0),
        "Write a checkpoint every N steps (0: never), into --log-dir (without one, into ./checkpoints); with "
        "--log-dir the last step always writes one, and model.pt.",
    ),
    (
        "--overwrite/--no-overwrite",
        "overwrite",
        None,
        "Write into a --log-dir that holds a run already (its CSV files start over); without it that is refused.",
    ),
    (
        "--resume",
        "resume",
        click.Path(exists=True, file_okay=False),
        "Continue from a log dir (its newest complete checkpoint) or from one LOG_DIR/ckpt-stepN: the run's "
        "config.json gives every setting the command line does not (without --config), and the run logs on into "
        "that log dir (without --log-dir); e.g. --resume runs/a --steps 4000 trains it on to step 4000. Steps "
        "logged after the checkpoint are dropped from its CSV files.",
    ),
]


SECTIONS: dict[str, tuple[str, ...]] = {
    "Model and data": (
        "model", "depth", "widen_factor", "dropout", "dataset", "data_dir",
        "synthetic_classes", "synthetic_size", "partition", "augment",
    ),
    "Codec": (
        "codec", "down_codec", "feedback", "dgc_momentum", "dgc_clip_norm", "dgc_warmup_epochs",
        "granularity", "push", "bucket_vectors", "on_nonfinite",
    ),
    "Topology": ("topology", "servers", "mode", "staleness", "serve_thread", "consensus_step", "grid", "consensus_every"),
    "Optimizer and training": (
        "optimizer", "lr", "momentum", "nesterov", "weight_decay", "schedule", "lr_milestones", "lr_decay",
        "warmup_epochs", "scale_lr", "batch_size", "steps", "epochs", "accumulate", "clip_grad_norm", "amp",
    ),
    "Logging, evaluation and checkpoints": (
        "log_dir", "eval_every", "eval_steps", "eval_background", "tensorboard", "progress",
        "checkpoint_every", "overwrite", "resume", "config_path",
    ),
    "Launch and system": ("device", "threads", "memory_format", "seed", "timeout"),
}  # fmt: skip
"""The --help sections of the training options, by parameter name; other options go under
'Options' (a command's own, such as bench's)."""
SECTION_OF = {name: title for title, names in SECTIONS.items() for name in names}


def section_of(param: click.Parameter) -> str:
    return SECTION_OF.get(param.name or "", "Options")


class SectionedCommand(click.Command):
    """A command whose --help lists its options in SECTIONS, in that order, then the rest."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        grouped: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                grouped.setdefault(section_of(param), []).append(record)
        for title in [*SECTIONS, "Options"]:
            if grouped.get(title):
                with formatter.section(title):
                    formatter.write_dl(grouped[title])


def run_options(fn):
    """Attach every RUN_OPTIONS entry to a click command."""
    for flag, field_name, kind, text in reversed(RUN_OPTIONS):
        default = getattr(_DEFAULTS, field_name)
        kwargs: dict = {"help": text, "default": default}
        if field_name == "lr_milestones":
            kwargs.update(default=",".join(map(str, default)), callback=_milestones)
        elif field_name == "synthetic_classes":
            kwargs.update(type=kind, default=str(default))
        elif kind is not None:
            kwargs["type"] = kind
        fn = click.option(flag, field_name, **kwargs)(fn)
    return fn


_INVOCATION_ONLY = ("resume", "overwrite")  # how that run was started, not what it was


def config_option(fn):
    """``--config``: start from a logged run's settings; options on the command line win."""
    return click.option(
        "--config",
        "config_path",
        type=click.Path(exists=True),
        default=None,
        help="Rerun a logged run: its config.json (or the log dir holding it) gives every setting, "
        "and options given on the command line override them. --resume and --overwrite are not taken from it.",
    )(fn)


def with_config(options: dict, config_path: str | None) -> dict:
    """``options`` with every value the command line did not set taken from ``config_path``
    (a config.json or a log dir); a file psgrad cannot read is a usage error naming it."""
    if config_path is None:
        return options
    path = Path(config_path)
    path = path / "config.json" if path.is_dir() else path
    try:
        saved = asdict(RunConfig.from_json(path.read_text()))
    except (OSError, ValueError, TypeError) as err:
        raise click.UsageError(f"--config {config_path}: not a psgrad config.json ({err})") from None
    for key in _INVOCATION_ONLY:
        saved.pop(key, None)
    merged = dict(options)
    for key, value in saved.items():
        if key in merged and not on_command_line(key):
            merged[key] = value
    return merged


def on_command_line(name: str) -> bool:
    """Whether the current command's command line gave the option of parameter ``name``."""
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(name) == ParameterSource.COMMANDLINE


def set_off_default(name: str) -> bool:
    """Whether the current command's command line set the option of parameter ``name`` to a value
    other than its default (what ``refuse_unused`` refuses when the run ignores it)."""
    ctx = click.get_current_context()
    if not on_command_line(name):
        return False
    param = next(p for p in ctx.command.params if p.name == name)
    # process_value: the default as the command sees it, through the option's type and callback
    return ctx.params[name] != param.process_value(ctx, param.get_default(ctx))


def run_settings(options: dict) -> RunConfig:
    """A training command's settings, validated (a bad one is a usage error naming it).

    1. ``--config C``: C's settings for every option the command line did not give.
    2. Else ``--resume D`` (or ``D/ckpt-stepN``): the settings of the run in D (its config.json),
       so that ``--resume D --steps 40`` continues that run as it was, for longer.
    3. A resumed run logs on into D unless ``--log-dir`` says otherwise.
    4. An option the command line gave that means nothing to the run is refused (``refuse_unused``).
    """
    options = dict(options)
    config_path = options.pop("config_path", None)
    resumed = checkpoint.run_dir(options.get("resume"))
    merged = with_config(options, config_path or resumed)
    if resumed is not None and not on_command_line("log_dir"):
        merged["log_dir"] = str(resumed)
    cfg = config_from(merged)
    try:
        refuse_unused([name for name in merged if on_command_line(name)], cfg)
    except ValueError as err:
        raise click.UsageError(str(err)) from None
    return cfg


def config_from(options: dict) -> RunConfig:
    options = dict(options)
    options["synthetic_classes"] = int(options["synthetic_classes"])
    try:
        return RunConfig(**options).validate()
    except ValueError as err:
        raise click.UsageError(str(err)) from None


def unused_option(name: str, cfg: RunConfig) -> str | None:
    """Why the run option of field ``name`` has no effect on the run ``cfg``, or None when it has one."""
    flag = option_flag(name)
    if name in ("depth", "widen_factor", "dropout") and cfg.model != "wrn":
        return f"{flag} shapes a WideResNet: it means nothing to --model {cfg.model}"
    if name.startswith("dgc_") and cfg.feedback != "dgc":
        return f"{flag} is DGC's: it means nothing without --feedback dgc (this run has --feedback {cfg.feedback})"
    if name == "dgc_warmup_epochs":
        from .codecs import make_codec  # torch: not needed to build the command line
        from .feedback import warms_up

        if not warms_up(make_codec(cfg.codec)):
            return (
                f"--dgc-warmup-epochs raises the codec's ratio epoch by epoch: --codec {cfg.codec} has none "
                "(topk and randomk have one)"
            )
    if name == "down_codec" and LAYOUTS[cfg.topology] == "peers":
        return (
            f"--down-codec codes the servers' replies: --topology {cfg.topology} has no servers (each rank decodes "
            "every other rank's gradient)"
        )
    if name == "bucket_vectors" and cfg.granularity == "model":
        return (
            "--no-bucket-vectors is for --granularity layer: --granularity model sends the whole model as one message"
        )
    if name in ("consensus_step", "consensus_every") and LAYOUTS[cfg.topology] != "gossip":
        return f"{flag} is CHOCO-SGD's: it means nothing to --topology {cfg.topology} (use --topology ring or torus)"
    if name == "staleness" and cfg.mode != "async":
        return "--staleness bounds how far --mode async lets a worker run ahead: it means nothing to --mode sync"
    if name == "servers" and cfg.topology != "ps":
        return "--servers counts the server ranks of --topology ps: " + (
            "every rank serves a shard under colocated" if cfg.topology == "colocated" else f"{cfg.topology} has none"
        )
    if name == "momentum" and cfg.optimizer != "sgd":
        return f"{flag} is SGD's: --optimizer {cfg.optimizer} keeps moments of its own"
    if name == "nesterov" and cfg.optimizer != "sgd" and cfg.feedback != "dgc":  # DGC's momentum correction uses it
        return f"{flag} is SGD's (and DGC's): --optimizer {cfg.optimizer} keeps moments of its own"
    if name in ("lr_milestones", "lr_decay") and cfg.schedule != "multistep":
        return f"{flag} shapes --schedule multistep: it means nothing to --schedule {cfg.schedule}"
    if name in ("synthetic_classes", "synthetic_size") and cfg.dataset not in ("synthetic", "proxy"):
        return f"{flag} shapes a generated dataset (synthetic or proxy): it means nothing to --dataset {cfg.dataset}"
    if name == "data_dir" and cfg.dataset not in ("cifar10", "cifar100"):
        return f"--data-dir holds the CIFAR archives: --dataset {cfg.dataset} is generated, not read"
    return None


def refuse_unused(given: list[str], cfg: RunConfig) -> None:
    """Raise ValueError naming the first of the run options ``given`` (field names) that sets a
    value other than its default and has no effect on ``cfg``: silently ignored, it would leave the
    user believing the run used it. An option left at its default stays quiet (a script may pass
    every option every time)."""
    for name in given:
        if getattr(cfg, name) != getattr(_DEFAULTS, name) and (why := unused_option(name, cfg)) is not None:
            raise ValueError(why)


@click.command()
@run_options
def _row_options(**options) -> None:
    """Parses the train options of one bench row."""


def option_overrides(args: list[str]) -> dict:
    """The RunConfig fields that train options ``args`` set (only those given), validated by click."""
    from click.core import ParameterSource

    try:
        ctx = _row_options.make_context("psgrad bench item", list(args))
    except click.ClickException as err:
        raise ValueError(f"{' '.join(args)!r}: {err.format_message()}") from None
    given = {k: v for k, v in ctx.params.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
    if "synthetic_classes" in given:
        given["synthetic_classes"] = int(given["synthetic_classes"])
    return given
