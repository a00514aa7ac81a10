"""One validated dataclass of run settings; the CLI and the Python API both build it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
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
from .comm.layout import LAYOUTS, TOPOLOGIES, parse_grid


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


@dataclass
class RunConfig:
    """Everything a run needs. ``validate()`` raises ValueError naming the bad setting."""

    # model and data
    model: str = "wrn"
    depth: int = 16
    widen_factor: int = 4
    dropout: float = 0.0
    dataset: str = "synthetic"
    data_dir: str = "data"
    synthetic_classes: int = 10
    synthetic_size: int | None = None  # training samples of a generated set; None: 2048, proxy 8192
    partition: str = "random"
    augment: bool = True
    # coding
    codec: str = "none"
    down_codec: str = "none"
    feedback: str = "none"
    dgc_momentum: float = 0.9
    dgc_clip_norm: float | None = None
    dgc_warmup_epochs: int = 0
    granularity: str = "layer"
    push: str = "backward"
    bucket_vectors: bool = True
    serve_thread: bool = False
    on_nonfinite: str = "abort"
    # optimisation
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    schedule: str = "constant"
    lr_milestones: tuple[int, ...] = (60, 120, 160)
    lr_decay: float = 0.2
    warmup_epochs: float = 0.0
    scale_lr: bool = False
    batch_size: int = 32
    accumulate: int = 1  # micro-batches per batch: forward/backward on each, one gradient sent
    clip_grad_norm: float = 0.0  # clip each worker's gradient to this L2 norm before coding; 0: off
    amp: str = "off"  # mixed precision of forward/backward: off, bf16 or fp16 (with loss scaling)
    memory_format: str = "auto"  # layout of image batches: auto (channels-last on CPU), channels-last, contiguous
    steps: int | None = None
    epochs: float = 1.0
    # system
    servers: int = 1
    mode: str = "sync"
    staleness: int = 0
    topology: str = "ps"
    consensus_step: float = 0.5  # ring: gamma of CHOCO-SGD's consensus step
    consensus_every: int = 10  # ring: log the consensus distance every N steps (0: never)
    grid: str | None = None  # torus: RxC
    device: str = "cpu"
    threads: int = 1
    seed: int = 0
    timeout: float = 0.0  # seconds without progress before the job is ended; 0: automatic
    # output
    log_dir: str | None = None
    eval_every: int = 1
    eval_steps: int = 0
    eval_background: bool = True
    tensorboard: bool = False
    progress: bool = True
    checkpoint_every: int = 0
    resume: str | None = None
    overwrite: bool = False
    extra: dict = field(default_factory=dict)

    def validate(self) -> RunConfig:
        from .codecs import make_codec  # torch: not needed to build the command line

        def need(ok: bool, text: str) -> None:
            if not ok:
                raise ValueError(text)

        for spec_field in ("codec", "down_codec"):
            try:
                make_codec(getattr(self, spec_field))
            except ValueError as err:
                raise ValueError(f"{option_flag(spec_field)}: {err}") from None
        need(self.feedback in FEEDBACKS, f"--feedback must be one of {FEEDBACKS}, got {self.feedback!r}")
        need(
            self.feedback == "none" or make_codec(self.codec).feedback_safe,
            f"--feedback {self.feedback} around {self.codec} diverges: the codec rescales the few values it keeps, "
            "so the residual memory grows every step (use topk, threshold, sign or svd with feedback)",
        )
        need(
            make_codec(self.down_codec).feedback_safe,
            f"--down-codec {self.down_codec} diverges: the down-link keeps what the codec did not send for later "
            "steps (error feedback), which grows without bound for a codec that rescales the values it keeps",
        )
        if make_codec(self.codec).multi_round:
            name = make_codec(self.codec).name
            need(
                self.feedback == "none",
                f"{name} keeps its own error feedback ({name}:ef=0 turns it off): use --feedback none",
            )
            need(self.mode == "sync", f"{name} sums every worker's factors before anyone goes on: it needs --mode sync")
            need(
                self.granularity == "layer",
                f"{name} factors each layer's matrix: it needs --granularity layer (model granularity is one vector)",
            )
        need(
            not make_codec(self.down_codec).multi_round,
            f"--down-codec {self.down_codec}: a multi-round codec's reply is its own down-link; use it as --codec",
        )
        need(
            not self.grid or self.topology == "torus",
            f"--grid {self.grid} shapes a torus: it means nothing to --topology {self.topology} (use --topology torus)",
        )
        if LAYOUTS.get(self.topology) == "gossip":
            need(0 < self.consensus_step <= 1, f"--consensus-step must be in (0, 1], got {self.consensus_step}")
            need(
                self.topology != "torus" or bool(self.grid),
                "--topology torus needs --grid RxC (rows x columns = the number of ranks)",
            )
            if self.topology == "torus":
                parse_grid(self.grid)
            need(
                self.feedback == "none" and self.down_codec == "none",
                f"--topology {self.topology} keeps public copies of the models (CHOCO-SGD), which already carry what the codec "
                "dropped into later steps: use --feedback none and no --down-codec (there is no down-link)",
            )
            need(
                not make_codec(self.codec).multi_round,
                f"--topology {self.topology} sends one message per layer and step: {self.codec} needs a server's rounds",
            )
        need(self.consensus_every >= 0, f"--consensus-every must be >= 0, got {self.consensus_every}")
        need(self.granularity in ("layer", "model"), f"--granularity must be layer or model, got {self.granularity!r}")
        need(self.push in ("backward", "after"), f"--push must be backward or after, got {self.push!r}")
        need(
            self.push == "backward" or LAYOUTS.get(self.topology) in ("separate", "colocated"),
            f"--push after needs servers (--topology ps or colocated): {self.topology} exchanges every layer before any update",
        )
        need(
            not self.serve_thread or LAYOUTS.get(self.topology) == "colocated",
            "--serve-thread is for --topology colocated: "
            + (
                "a server rank of ps serves all the time anyway"
                if LAYOUTS.get(self.topology) == "separate"
                else f"{self.topology} has no servers"
            ),
        )
        need(
            self.on_nonfinite in NONFINITE_POLICIES,
            f"--on-nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {self.on_nonfinite!r}",
        )
        need(self.accumulate >= 1, f"--accumulate must be >= 1, got {self.accumulate}")
        need(
            self.batch_size >= self.accumulate,
            f"--accumulate {self.accumulate} splits each batch into micro-batches: --batch-size {self.batch_size} is smaller",
        )
        need(self.clip_grad_norm >= 0, f"--clip-grad-norm must be >= 0 (0: off), got {self.clip_grad_norm}")
        need(self.amp in ("off", "bf16", "fp16"), f"--amp must be off, bf16 or fp16, got {self.amp!r}")
        need(
            self.memory_format in MEMORY_FORMATS,
            f"--memory-format must be one of {', '.join(MEMORY_FORMATS)}, got {self.memory_format!r}",
        )
        need(
            self.amp != "fp16" or self.on_nonfinite == "skip",
            "--amp fp16 scales the loss and lowers the scale when a gradient overflows; the overflowing step "
            "must be skipped, not end the run: add --on-nonfinite skip",
        )
        need(self.optimizer in ("sgd", "adam"), f"--optimizer must be sgd or adam, got {self.optimizer!r}")
        need(
            self.schedule in ("constant", "multistep", "cosine"),
            f"--schedule must be constant, multistep or cosine, got {self.schedule!r}",
        )
        need(self.model in MODEL_NAMES, f"--model must be one of {', '.join(MODEL_NAMES)}, got {self.model!r}")
        if self.model == "wrn":
            need(wrn_depth_problem(self.depth) is None, f"--depth: {wrn_depth_problem(self.depth)}")
        need(not self.tensorboard or self.log_dir is not None, "--tensorboard writes into --log-dir: give one")
        need(self.timeout >= 0, f"--timeout must be >= 0 seconds (0: automatic), got {self.timeout}")
        need(self.mode in ("sync", "async"), f"--mode must be sync or async, got {self.mode!r}")
        need(self.topology in TOPOLOGIES, f"--topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        need(self.device in ("auto", "cpu", "cuda"), f"--device must be auto, cpu or cuda, got {self.device!r}")
        need(
            self.partition in ("random", "contiguous"),
            f"--partition must be random or contiguous, got {self.partition!r}",
        )
        need(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        need(0 <= self.momentum < 1, f"--momentum must be in [0, 1), got {self.momentum}")
        nesterovs = "dgc_momentum" if self.feedback == "dgc" else "momentum"  # DGC's correction takes the flag
        need(
            not self.nesterov or getattr(self, nesterovs) > 0,
            f"--nesterov is a kind of momentum: it needs {option_flag(nesterovs)} > 0",
        )
        need(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        need(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        need(self.steps is None or self.steps >= 1, f"--steps must be >= 1, got {self.steps}")
        need(self.epochs > 0, f"--epochs must be > 0, got {self.epochs}")
        need(self.servers >= 1, f"--servers must be >= 1, got {self.servers}")
        need(self.staleness >= 0, f"--staleness must be >= 0, got {self.staleness}")
        need(self.threads >= 1, f"--threads must be >= 1, got {self.threads}")
        need(self.eval_every >= 0, f"--eval-every must be >= 0, got {self.eval_every}")
        need(self.eval_steps >= 0, f"--eval-steps must be >= 0, got {self.eval_steps}")
        need(self.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        need(0 <= self.dropout < 1, f"--dropout must be in [0, 1), got {self.dropout}")
        need(self.lr_decay > 0, f"--lr-decay must be > 0, got {self.lr_decay}")
        need(self.synthetic_classes in (10, 100), f"synthetic classes must be 10 or 100, got {self.synthetic_classes}")
        need(self.synthetic_samples >= self.batch_size, "--synthetic-size must be at least --batch-size")
        need(
            self.dataset in DATASETS,
            f"--dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}",
        )
        need(
            not (self.mode == "async" and LAYOUTS.get(self.topology) in ("peers", "gossip")),
            "--mode async needs servers (--topology ps or colocated)",
        )
        need(
            not (
                self.feedback == "dgc"
                and self.momentum > 0
                and self.optimizer == "sgd"
                and not self.extra.get("allow_double_momentum")
            ),
            "--feedback dgc keeps momentum on the workers: set --momentum 0 for the server's SGD",
        )
        return self

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
        data = asdict(self)
        data["lr_milestones"] = list(self.lr_milestones)
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        data = json.loads(text)
        data.pop("run", None)  # what the run was (world size, versions, host), not a setting
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config keys: {unknown}")
        data["lr_milestones"] = tuple(data.get("lr_milestones", ()))
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
