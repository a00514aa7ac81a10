"""One validated dataclass of run settings; the CLI and the Python API both build it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from . import checkpoint
from .choices import (
    DATASETS,
    FEEDBACKS,
    MEMORY_FORMATS,
    MODEL_NAMES,
    NONFINITE_POLICIES,
    option_flag,
    wrn_depth_problem,
)
from .roles import TOPOLOGIES, topology_of
from .settings import (
    CODEC,
    MODEL_AND_DATA,
    OUTPUT,
    SYSTEM,
    TOPOLOGY,
    TRAINING,
    UnusedRule,
    setting,
    settings_of,
    unless,
    value_problem,
)


def folder_problem(folder: Path, noun: str = "folder") -> str | None:
    """Why files cannot be written into ``folder`` once it is made (with its parents, if it is not
    there): "is a file, not a <noun>", "cannot be made: <why>" or "is not writable"; or None."""
    if folder.exists() and not folder.is_dir():
        return f"is a file, not a {noun}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"cannot be made: {err.strerror or err}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return "is not writable"
    return None


def _wrn_only(flag: str) -> UnusedRule:
    return unless(
        lambda cfg: cfg.model == "wrn", flag + " shapes a WideResNet: it means nothing to --model {cfg.model}"
    )


def _generated_only(flag: str) -> UnusedRule:
    return unless(
        lambda cfg: cfg.dataset in ("synthetic", "proxy"),
        flag + " shapes a generated dataset (synthetic or proxy): it means nothing to --dataset {cfg.dataset}",
    )


def _dgc_only(flag: str) -> UnusedRule:
    return unless(
        lambda cfg: cfg.feedback == "dgc",
        flag + " is DGC's: it means nothing without --feedback dgc (this run has --feedback {cfg.feedback})",
    )


def _multistep_only(flag: str) -> UnusedRule:
    return unless(
        lambda cfg: cfg.schedule == "multistep",
        flag + " shapes --schedule multistep: it means nothing to --schedule {cfg.schedule}",
    )


def _warmup_needs_ratio(cfg: RunConfig) -> str | None:
    from .codecs import make_codec  # torch: not needed to build the command line
    from .feedback import warms_up

    if warms_up(make_codec(cfg.codec)):
        return None
    return (
        f"--dgc-warmup-epochs raises the codec's ratio epoch by epoch: --codec {cfg.codec} has none "
        "(topk and randomk have one)"
    )


def _need(ok: bool, text: str) -> None:
    if not ok:
        raise ValueError(text)


@dataclass
class RunConfig:
    """Everything a run needs, each setting declared once (``psgrad.settings``): its flag, help,
    --help section, allowed values and when it means nothing come from its field here.
    ``validate()`` raises ValueError naming the bad setting."""

    # model and data
    model: str = setting(
        "wrn",
        section=MODEL_AND_DATA,
        choices=MODEL_NAMES,
        help="Model architecture.",
    )
    depth: int = setting(
        16,
        section=MODEL_AND_DATA,
        low=10,
        unused=(_wrn_only("--depth"),),
        help="Only --model wrn: WideResNet depth (6n+4: 10, 16, 22, 28, 40).",
    )
    widen_factor: int = setting(
        4,
        section=MODEL_AND_DATA,
        low=1,
        unused=(_wrn_only("--widen-factor"),),
        help="Only --model wrn: WideResNet width multiplier k.",
    )
    dropout: float = setting(
        0.0,
        section=MODEL_AND_DATA,
        low=0,
        high=1,
        high_open=True,
        unused=(_wrn_only("--dropout"),),
        help="Only --model wrn: dropout between convolutions.",
    )
    dataset: str = setting(
        "synthetic",
        section=MODEL_AND_DATA,
        choices=DATASETS,
        help="Training data. synthetic and proxy are generated from --seed: synthetic is easy (dense reaches 100 % in a few epochs), proxy is the harder accuracy proxy for comparing codecs (docs/training.md).",
    )
    data_dir: str = setting(
        "data",
        section=MODEL_AND_DATA,
        path="dir",
        unused=(
            unless(
                lambda cfg: cfg.dataset in ("cifar10", "cifar100"),
                "--data-dir holds the CIFAR archives: --dataset {cfg.dataset} is generated, not read",
            ),
        ),
        help="--dataset cifar10 or cifar100: directory with the CIFAR python archives (extracted or .tar.gz).",
    )
    synthetic_classes: int = setting(
        10,
        section=MODEL_AND_DATA,
        choices=(10, 100),
        unused=(_generated_only("--synthetic-classes"),),
        help="Only --dataset synthetic or proxy: its number of classes.",
    )
    synthetic_size: int | None = setting(
        None,
        section=MODEL_AND_DATA,
        low=1,
        unused=(_generated_only("--synthetic-size"),),
        help="Training samples of a generated dataset [default: 2048 synthetic, 8192 proxy].",
    )
    partition: str = setting(
        "random",
        section=MODEL_AND_DATA,
        choices=("random", "contiguous"),
        help="How the training set is split over workers (reshuffled each epoch).",
    )
    augment: bool = setting(
        True,
        section=MODEL_AND_DATA,
        help="Random crop (4-pixel padding) and horizontal flip.",
    )
    # codec
    codec: str = setting(
        "none",
        section=CODEC,
        help="Gradient codec spec, e.g. qsgd:levels=16 or topk:ratio=0.01 (see psgrad codecs).",
    )
    down_codec: str = setting(
        "none",
        section=CODEC,
        help="Server-to-worker codec: none sends each layer's new value; any other codec sends the encoded change since what the workers hold, the server keeping the rest for later steps (error feedback).",
    )
    feedback: str = setting(
        "none",
        section=CODEC,
        choices=FEEDBACKS,
        help="Worker-side memory around the codec: error feedback or DGC.",
    )
    dgc_momentum: float = setting(
        0.9,
        section=CODEC,
        low=0,
        high=1,
        high_open=True,
        unused=(_dgc_only("--dgc-momentum"),),
        help="DGC: momentum kept on the workers (use --momentum 0).",
    )
    dgc_clip_norm: float | None = setting(
        None,
        section=CODEC,
        low=0,
        low_open=True,
        unused=(_dgc_only("--dgc-clip-norm"),),
        help="DGC: local gradient clipping norm (default: off).",
    )
    dgc_warmup_epochs: int = setting(
        0,
        section=CODEC,
        low=0,
        unused=(_dgc_only("--dgc-warmup-epochs"), _warmup_needs_ratio),
        help="DGC: epochs of exponential sparsity warm-up (needs a codec with ratio).",
    )
    granularity: str = setting(
        "layer",
        section=CODEC,
        choices=("layer", "model"),
        help="One message per parameter tensor, or the whole model as one.",
    )
    push: str = setting(
        "backward",
        section=CODEC,
        choices=("backward", "after"),
        help="layer granularity: send each layer from backward as soon as its gradient is ready, or code all layers after backward and send them first layer first (the next forward starts on the first replies while the rest are in flight).",
    )
    bucket_vectors: bool = setting(
        True,
        section=CODEC,
        unused=(
            unless(
                lambda cfg: cfg.granularity == "layer",
                "--no-bucket-vectors is for --granularity layer: --granularity model sends the whole model as one message",
            ),
        ),
        help="layer granularity: send all 1-D parameters (biases, norm scales and shifts) as one uncompressed message per step, or each as its own compressed layer.",
    )
    on_nonfinite: str = setting(
        "abort",
        section=CODEC,
        choices=NONFINITE_POLICIES,
        help="A NaN or Inf in a gradient or a server's sum: abort the job naming the step, rank and layer, or skip: drop that layer's update at that step on every rank (counted in metrics.csv's nonfinite).",
    )
    # topology
    topology: str = setting(
        "ps",
        section=TOPOLOGY,
        choices=TOPOLOGIES.keys(),  # a live view: a topology registered later is a choice too
        help="ps: server ranks and worker ranks; colocated: every rank works and serves a shard of the layers (no extra server rank); alltoall: no server, every rank exchanges with every other; ring / torus: no server, every rank gossips with its ring or torus neighbours only (CHOCO-SGD).",
    )
    servers: int = setting(
        1,
        section=TOPOLOGY,
        low=1,
        help="--topology ps: server ranks (0..S-1); layers are sharded over them by size.",
    )
    mode: str = setting(
        "sync",
        section=TOPOLOGY,
        choices=("sync", "async"),
        help="sync: average all workers per step; async: apply each worker's gradient on arrival.",
    )
    staleness: int = setting(
        0,
        section=TOPOLOGY,
        low=0,
        unused=(
            unless(
                lambda cfg: cfg.mode == "async",
                "--staleness bounds how far --mode async lets a worker run ahead: it means nothing to --mode sync",
            ),
        ),
        help="async: how many steps a worker may run ahead of the slowest.",
    )
    serve_thread: bool = setting(
        False,
        section=TOPOLOGY,
        help="colocated: also serve this rank's shard from a helper thread, not only between the worker's hooks and inside its waits (measured slower on 2 cores, docs/benchmarks.md).",
    )
    consensus_step: float = setting(
        0.5,
        section=TOPOLOGY,
        low=0,
        high=1,
        low_open=True,
        help="ring or torus: gamma of CHOCO-SGD's consensus step x += gamma sum_j w_ij (x_hat_j - x_hat_i); 1 with codec none is exact gossip averaging, lossy codecs need less (docs/training.md).",
    )
    grid: str | None = setting(
        None,
        section=TOPOLOGY,
        help="torus: RxC, rows x columns of the torus (= the number of ranks, placed row-major); each rank gossips with the ranks above, below, left and right of it, wrapping around.",
    )
    consensus_every: int = setting(
        10,
        section=TOPOLOGY,
        low=0,
        help="ring or torus: log the consensus distance (1/N) sum ||x_i - x_mean||^2 in metrics.csv every N steps and at the last (one allreduce of the model each time; 0: never).",
    )
    # optimizer and training
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
    amp: str = setting(
        "off",
        section=TRAINING,
        choices=("off", "bf16", "fp16"),
        help="Mixed precision for forward and backward (torch.autocast, CPU or CUDA); fp16 also scales the loss dynamically (as GradScaler) and needs --on-nonfinite skip. Gradients are coded in fp32.",
    )
    # logging, evaluation and checkpoints
    log_dir: str | None = setting(
        None,
        section=OUTPUT,
        path="dir",
        help="Write config.json, metrics.csv, eval.csv (and checkpoints) here; made if missing, and one that cannot be made or written is refused before training starts.",
    )
    eval_every: int = setting(
        1,
        section=OUTPUT,
        low=0,
        help="Evaluate on the test set every N epochs (0: only at the end).",
    )
    eval_steps: int = setting(
        0,
        section=OUTPUT,
        low=0,
        help="Also evaluate every N steps (0: only by --eval-every epochs and at the end).",
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
    checkpoint_every: int = setting(
        0,
        section=OUTPUT,
        low=0,
        help="Write a checkpoint every N steps (0: never), into --log-dir (without one, into ./checkpoints); with --log-dir the last step always writes one, and model.pt.",
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
    # launch and system
    device: str = setting(
        "cpu",
        section=SYSTEM,
        choices=("auto", "cpu", "cuda"),
        help="Worker device; cuda puts each worker on cuda:<its index among its node's workers> (servers stay on the CPU).",
    )
    threads: int = setting(
        1,
        section=SYSTEM,
        low=1,
        help="torch threads per rank.",
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
    )
    timeout: float = setting(
        0.0,
        section=SYSTEM,
        low=0,
        help="Seconds a rank may stay silent (stopped, dead, cut off), or every rank may wait, before the job ends naming the rank; 0: max(60, 10 x the slowest step so far).",
    )

    def validate(self) -> RunConfig:
        """Raise ValueError naming the first bad setting; return self when there is none.

        1. Every setting against its own declaration: its choices or its range.
        2. The codec specs parse, and the rules that link the codecs to other settings.
        3. The topology's own rules (``Topology.refuses`` and ``check``).
        4. The rules that link two other settings.
        """
        for name, (_, meta) in settings_of(type(self)).items():
            if (problem := value_problem(name, meta, getattr(self, name))) is not None:
                raise ValueError(problem)
        self._check_codecs()
        topology = topology_of(self.topology)
        _need(
            not self.grid or topology.takes_grid,
            f"--grid {self.grid} shapes a torus: it means nothing to --topology {self.topology} (use --topology torus)",
        )
        for name, why in topology.refuses.items():  # what this topology cannot run, away from the default
            _need(getattr(self, name) == getattr(_DEFAULTS, name), why)
        topology.check(self)
        _need(
            self.batch_size >= self.accumulate,
            f"--accumulate {self.accumulate} splits each batch into micro-batches: --batch-size {self.batch_size} is smaller",
        )
        _need(
            self.amp != "fp16" or self.on_nonfinite == "skip",
            "--amp fp16 scales the loss and lowers the scale when a gradient overflows; the overflowing step "
            "must be skipped, not end the run: add --on-nonfinite skip",
        )
        if self.model == "wrn":
            _need(wrn_depth_problem(self.depth) is None, f"--depth: {wrn_depth_problem(self.depth)}")
        _need(not self.tensorboard or self.log_dir is not None, "--tensorboard writes into --log-dir: give one")
        nesterovs = "dgc_momentum" if self.feedback == "dgc" else "momentum"  # DGC's correction takes the flag
        _need(
            not self.nesterov or getattr(self, nesterovs) > 0,
            f"--nesterov is a kind of momentum: it needs {option_flag(nesterovs)} > 0",
        )
        _need(self.synthetic_samples >= self.batch_size, "--synthetic-size must be at least --batch-size")
        _need(
            not (self.feedback == "dgc" and self.momentum > 0 and self.optimizer == "sgd"),
            "--feedback dgc keeps momentum on the workers: set --momentum 0 for the server's SGD",
        )
        return self

    def _check_codecs(self) -> None:
        """The codec specs parse; the rules that link the codecs to feedback, mode and granularity."""
        from .codecs import make_codec  # torch: not needed to build the command line

        for spec_field in ("codec", "down_codec"):
            try:
                make_codec(getattr(self, spec_field))
            except ValueError as err:
                raise ValueError(f"{option_flag(spec_field)}: {err}") from None
        up, down = make_codec(self.codec), make_codec(self.down_codec)
        _need(
            self.feedback == "none" or up.feedback_safe,
            f"--feedback {self.feedback} around {self.codec} diverges: the codec rescales the few values it keeps, "
            "so the residual memory grows every step (use topk, threshold, sign or svd with feedback)",
        )
        _need(
            down.feedback_safe,
            f"--down-codec {self.down_codec} diverges: the down-link keeps what the codec did not send for later "
            "steps (error feedback), which grows without bound for a codec that rescales the values it keeps",
        )
        if up.multi_round:
            _need(
                self.feedback == "none",
                f"{up.name} keeps its own error feedback ({up.name}:ef=0 turns it off): use --feedback none",
            )
            _need(
                self.mode == "sync",
                f"{up.name} sums every worker's factors before anyone goes on: it needs --mode sync",
            )
            _need(
                self.granularity == "layer",
                f"{up.name} factors each layer's matrix: it needs --granularity layer (model granularity is one vector)",
            )
        _need(
            not down.multi_round,
            f"--down-codec {self.down_codec}: a multi-round codec's reply is its own down-link; use it as --codec",
        )

    @property
    def sgd_nesterov(self) -> bool:
        """Whether the SGD that applies updates (the server's, or every rank's) uses Nesterov
        momentum: ``--nesterov``, unless ``--feedback dgc`` takes it for its momentum correction on
        the workers (DGC runs the server's SGD without momentum)."""
        return self.nesterov and self.feedback != "dgc"

    @property
    def synthetic_samples(self) -> int:
        """Training samples of a generated dataset: ``synthetic_size``, else 2048 (8192 for proxy,
        which needs more samples than its network can memorise)."""
        if self.synthetic_size is not None:
            return self.synthetic_size
        return 8192 if self.dataset == "proxy" else 2048

    @property
    def dataset_label(self) -> str:
        """How reports name the data: generated sets say so."""
        return {"synthetic": "synthetic", "proxy": "proxy (synthetic)"}.get(self.dataset, self.dataset)

    @property
    def num_classes(self) -> int:
        return {"cifar10": 10, "cifar100": 100}.get(self.dataset, self.synthetic_classes)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        data = json.loads(text)
        data.pop("run", None)  # what the run was (world size, versions, host), not a setting
        if data.get("extra") == {}:  # an empty field that config.json files of older versions hold
            del data["extra"]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config keys: {unknown}")
        for f in fields(cls):  # JSON has lists where the settings hold tuples
            if isinstance(f.default, tuple) and isinstance(data.get(f.name), list):
                data[f.name] = tuple(data[f.name])
        return cls(**data).validate()

    def save(self, directory: str | Path, run: dict | None = None) -> Path:
        """``config.json``: every setting, plus ``run`` (what the run was: world size, versions,
        host, start time), which ``from_json`` ignores."""
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.loads(self.to_json())
        if run:
            data["run"] = run
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        return path

    def log_dir_problem(self) -> str | None:
        """Why this run may not write into its log dir, or None.

        1. The directory is made (with its parents) if it is not there: a path that cannot be one
           (a file on the way, no permission, a read-only file system) is said now, before any
           rank builds a model, not as a traceback once training would start.
        2. It must be writable.
        3. A run is there already, and neither --resume nor --overwrite was given."""
        if not self.log_dir:
            return None
        problem = folder_problem(Path(self.log_dir), "directory")
        if problem is not None:
            return f"--log-dir {self.log_dir} {problem}"
        if self.resume or self.overwrite:
            return None
        there = [name for name in ("config.json", "metrics.csv") if (Path(self.log_dir) / name).exists()]
        if not there:
            return None
        try:
            checkpoint.resolve(self.log_dir)
        except checkpoint.CheckpointError:  # nothing to resume: do not suggest it
            return (
                f"--log-dir {self.log_dir} holds a run already ({', '.join(there)}) and no complete checkpoint to "
                "resume from: replace it with --overwrite, or choose another directory"
            )
        return (
            f"--log-dir {self.log_dir} holds a run already ({', '.join(there)}): continue it with --resume "
            f"{self.log_dir}, replace it with --overwrite, or choose another directory"
        )


_DEFAULTS = RunConfig()
