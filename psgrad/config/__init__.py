"""One validated dataclass of run settings; the CLI and the Python API both build it."""

from __future__ import annotations

import functools
import json
import typing
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..choices import RENAMED, option_flag, wrn_depth_problem
from ..roles import topology_of
from ..settings import named_with_guesses, settings_of, type_problem, value_problem
from .coding import CodecSettings
from .model_data import ModelDataSettings
from .output import OutputSettings, SystemSettings
from .placement import TopologySettings
from .training import TrainingSettings


def _shared(codec) -> str:
    """The variant of random-k that error feedback suits, where the refused one is random-k."""
    if codec.name != "randomk":
        return ""
    return f", or randomk:ratio={codec.params['ratio']},shared=1: every worker keeps the same coordinates, unscaled"


@functools.cache
def _type_hints(cls: type) -> dict:
    """The declared types of ``cls``'s fields (resolved once: the annotations are strings)."""
    return typing.get_type_hints(cls)


def _need(ok: bool, text: str) -> None:
    if not ok:
        raise ValueError(text)


@dataclass
# dataclass collects fields from the last base to the first: the sections keep --help's order
@dataclass
class RunConfig(SystemSettings, OutputSettings, TrainingSettings, TopologySettings, CodecSettings, ModelDataSettings):
    """Everything a run needs, each setting declared once (``psgrad.settings``): its flag, help,
    --help section, allowed values and when it means nothing come from its field here.
    ``validate()`` raises ValueError naming the bad setting."""

    def validate(self) -> RunConfig:
        """Raise ValueError naming the first bad setting; return self when there is none.

        1. Every setting against its own declaration: its type, its choices or its range.
        2. The codec specs parse, and the rules that link the codecs to other settings.
        3. The topology's own rules (``Topology.refuses`` and ``check``).
        4. The rules that link two other settings.
        """
        hints = _type_hints(type(self))
        for name, (_, meta) in settings_of(type(self)).items():
            value = getattr(self, name)
            if (problem := type_problem(name, hints[name], value) or value_problem(name, meta, value)) is not None:
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
        if self.local_steps:
            self._check_local_steps()
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

    def _check_local_steps(self) -> None:
        """What ``--local-steps`` needs: servers that apply the outer optimizer to every worker's
        change at once, and a checkpoint right after an exchange."""
        h = self.local_steps
        _need(
            self.topology in ("ps", "colocated"),
            f"--local-steps needs servers to apply the outer optimizer: --topology ps or colocated, not {self.topology}",
        )
        _need(self.mode == "sync", "--local-steps averages every worker's change before anyone goes on: --mode sync")
        _need(
            self.optimizer == "sgd",
            "--local-steps: the servers apply --outer-optimizer, the workers --inner-optimizer; --optimizer has no part",
        )
        _need(self.feedback != "dgc", "--feedback dgc corrects per-step gradients; with --local-steps use ef or none")
        _need(
            self.outer_optimizer != "nesterov" or self.outer_momentum > 0,
            "--outer-optimizer nesterov is a kind of momentum: it needs --outer-momentum > 0",
        )
        _need(self.amp != "fp16", "--local-steps with --amp fp16 would need a loss scale per worker: use --amp bf16")
        _need(
            self.overlap_steps <= h,
            f"--overlap-steps {self.overlap_steps}: the reply must be taken by the next exchange, "
            f"at most --local-steps {h} steps later",
        )
        _need(
            h % self.fragments == 0,
            f"--fragments {self.fragments} must divide --local-steps {h}: a fragment exchanges every H/F steps",
        )
        if self.fragments > 1:
            from ..codecs import make_codec  # torch: not needed to build the command line

            _need(
                not make_codec(self.codec).multi_round,
                f"--fragments: {self.codec}'s rounds answer the whole model's exchange; use a one-round codec",
            )
        _need(
            self.checkpoint_every_steps % h == 0,
            f"--checkpoint-every-steps {self.checkpoint_every_steps} must be a multiple of --local-steps {h}: "
            "a checkpoint is taken right after an exchange",
        )

    def _check_codecs(self) -> None:
        """The codec specs parse; the rules that link the codecs to feedback, mode and granularity."""
        from ..codecs import make_codec  # torch: not needed to build the command line

        for spec_field in ("codec", "down_codec"):
            try:
                make_codec(getattr(self, spec_field))
            except ValueError as err:
                raise ValueError(f"{option_flag(spec_field)}: {err}") from None
        up, down = make_codec(self.codec), make_codec(self.down_codec)
        _need(
            self.feedback == "none" or up.feedback_safe,
            f"--feedback {self.feedback} around {self.codec} diverges: the codec rescales the few values it keeps, "
            f"so the residual memory grows every step (use topk, threshold, sign or svd with feedback{_shared(up)})",
        )
        _need(
            down.feedback_safe,
            f"--down-codec {self.down_codec} diverges: the down-link keeps what the codec did not send for later "
            f"steps (error feedback), which grows without bound for a codec that rescales the values it keeps"
            f"{_shared(down).replace(', or', '; use')}",
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
    def model_options(self) -> dict:
        """The options ``models.build_model`` takes for ``model`` (a WideResNet's shape)."""
        return {"depth": self.depth, "widen_factor": self.widen_factor, "dropout": self.dropout}

    @property
    def num_classes(self) -> int:
        return {"cifar10": 10, "cifar100": 100, "digits": 10}.get(self.dataset, self.synthetic_classes)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, given: object) -> RunConfig:
        """The settings of a config.json already parsed (``given`` is left as it was)."""
        if not isinstance(given, dict):
            raise ValueError(f"a JSON object of settings expected, got a {type(given).__name__}")
        data = dict(given)
        data.pop("run", None)  # what the run was (world size, versions, host), not a setting
        for old, new in RENAMED.items():  # an older run's config.json
            if old in data:
                data.setdefault(new, data.pop(old))
        if data.get("extra") == {}:  # an empty field that config.json files of older versions hold
            del data["extra"]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config keys: {named_with_guesses(unknown, known=known)}")
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


_DEFAULTS = RunConfig()
