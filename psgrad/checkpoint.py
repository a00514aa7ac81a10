"""Checkpoints on disk: per-rank state files, a marker that says a checkpoint is complete, and the
trained model as a plain state_dict.

Layout under the log directory:
- ``ckpt-stepN/rankR.pt``: rank R's state after N steps (``torch.save`` of tensors and plain
  values; read back with ``weights_only=True``);
- ``ckpt-stepN/COMPLETE``: JSON ``{"step": N, "ranks": P}``, written last, once every rank's file
  is in place. A checkpoint without it was cut off while being written and is never resumed from;
- ``model.pt``: the final model's ``state_dict()``, loadable without psgrad.

Every write goes to a temporary name first and is renamed over the final one, so a file is either
absent or whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from .choices import option_flag
from .runtime.chain import error_chain, stop_behind

if TYPE_CHECKING:  # torch is imported where files are written or read: the command line finds runs without it
    import torch

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"ckpt-step(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint (or the model) that cannot be written, or resumed from; the text says which
    file and what to do."""


def _written(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(file)`` into a temporary name beside ``path``, then rename it over ``path``.

    1. Write through a Python file, so that the system's error comes back as an ``OSError`` (torch
       writing to a path of its own turns a full disk into "basic_ios::clear: iostream error").
    2. On any error, remove the partial file (on a full disk it holds the space that is short).
    3. A Ctrl-C or SIGTERM that arrived during the write (the file's ``write`` is Python code, so
       the signal's exception is raised inside torch's writer, which reports it as a failed
       write: "unexpected pos") is raised as the stop it is; any other error as ``CheckpointError``
       naming the file and the system's reason."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        stop = stop_behind(err)
        if stop is not None:
            raise stop from None
        if not isinstance(err, (OSError, RuntimeError)):
            raise
        reason = system.strerror if (system := system_error(err)) is not None else str(err)
        raise CheckpointError(
            f"could not write {path}: {reason} (free space there, or start again with another --log-dir)"
        ) from err


def system_error(err: BaseException | None) -> OSError | None:
    """The system's error behind ``err``, itself included: torch raises its own error while the
    ``OSError`` of a failed write is handled, and ``CheckpointError`` is raised from that."""
    return next((e for e in error_chain(err) if isinstance(e, OSError) and e.strerror), None)


def _atomic_save(obj: object, path: Path) -> None:
    import torch

    _written(path, lambda f: torch.save(obj, f))


def step_dir(log_dir: str | Path, step: int) -> Path:
    return Path(log_dir) / f"ckpt-step{step}"


def step_of(directory: Path) -> int | None:
    """N of a ``ckpt-stepN`` directory (None for any other path)."""
    m = _STEP_DIR.search(directory.name)
    return int(m.group(1)) if m else None


def step_dirs(log_dir: str | Path) -> dict[int, Path]:
    """The ``ckpt-stepN`` directories in ``log_dir`` by step N, complete or not."""
    return {step: d for d in Path(log_dir).iterdir() if (step := step_of(d)) is not None and d.is_dir()}


def complete_dirs(log_dir: str | Path) -> dict[int, Path]:
    """The complete ``ckpt-stepN`` directories in ``log_dir`` (those with a marker) by step N."""
    return {step: d for step, d in step_dirs(log_dir).items() if _marker(d) is not None}


def save_rank_state(directory: Path, rank: int, state: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    _atomic_save(state, directory / f"rank{rank}.pt")


def mark_complete(directory: Path, step: int, ranks: int) -> None:
    """Called once every rank's file is written (the caller synchronizes the ranks first)."""
    _written(directory / MARKER, lambda f: f.write(json.dumps({"step": step, "ranks": ranks}).encode()))


def save_model(log_dir: str | Path, model: torch.nn.Module) -> Path:
    path = Path(log_dir) / "model.pt"
    # clone: a simulated worker's tensors are views into the stacked model's (psgrad/sim/stacked.py),
    # and torch.save writes a view's whole storage
    _atomic_save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, path)
    return path


def prune(log_dir: str | Path, *, keep: int) -> list[Path]:
    """``--keep-checkpoints``: delete what is older than the newest ``keep`` complete checkpoints
    (nothing with ``keep`` 0); returns the directories deleted.

    1. Find the complete checkpoints (those with a marker), newest first.
    2. Every ``ckpt-stepN`` older than the ``keep``-th of them goes, complete or cut off. Newer
       ones stay, a checkpoint being written included: so the newest complete checkpoint, the one
       a restart resumes from, is only deleted once ``keep`` newer ones are complete."""
    if keep <= 0:
        return []
    steps = step_dirs(log_dir)
    complete = sorted(complete_dirs(log_dir), reverse=True)
    if len(complete) <= keep:
        return []
    oldest_kept = complete[keep - 1]
    gone = [d for step, d in sorted(steps.items()) if step < oldest_kept]
    for directory in gone:
        shutil.rmtree(directory, ignore_errors=True)
    return gone


def load_model(log_dir: str | Path) -> torch.nn.Module:
    """The model the run in ``log_dir`` trained, in eval mode: the one its last evaluation scored.

    1. Read the run's ``config.json`` (its ``--model``, depth, width and classes). ``log_dir``
       may also be the run's ``model.pt``, the path the run printed at its end.
    2. Build that model (``psgrad.models.build_model``).
    3. Load ``model.pt`` into it (``weights_only``): a file torch cannot read is one
       CheckpointError, never torch's advice to load it without ``weights_only``.

    A model of your own (``train.run(model_fn=...)``) is not in config.json, which records only its
    class: that, or a model.pt that does not fit, is one CheckpointError saying to build it
    yourself and ``load_state_dict(torch.load(LOG_DIR/model.pt, weights_only=True))``."""
    import torch

    from .config import RunConfig
    from .models import build_model

    directory = Path(log_dir)
    if directory.is_file():
        if directory.name != "model.pt":
            raise CheckpointError(
                f"{log_dir} is a file: give the run's log dir (the folder of config.json and model.pt)"
            )
        directory = directory.parent
    for name in ("config.json", "model.pt"):
        if not (directory / name).is_file():
            raise CheckpointError(
                f"{directory / name}: missing (a run with --log-dir {directory} writes it at its end)"
            )
    saved = json.loads((directory / "config.json").read_text())
    cfg = RunConfig.from_dict(saved)
    model = build_model(cfg.model, cfg.num_classes, **cfg.model_options)
    trained = saved.get("run", {}).get("model", type(model).__name__)
    yours = "build it, then load_state_dict(torch.load(model.pt, weights_only=True))"
    if trained != type(model).__name__:  # train.run(model_fn=...): config.json's --model is not it
        raise CheckpointError(f"{directory} trained a model of your own ({trained}), not psgrad's {cfg.model}: {yours}")
    try:
        weights = torch.load(directory / "model.pt", weights_only=True)
    except Exception as err:  # noqa: BLE001  torch raises many types; its text suggests unsafe loading
        raise CheckpointError(
            f"{directory / 'model.pt'}: not a readable model ({type(err).__name__}): the file is damaged or cut short"
        ) from None
    try:
        model.load_state_dict(weights)
    except (RuntimeError, TypeError) as err:  # keys or shapes that do not fit: one line, not a wall of names
        raise CheckpointError(
            f"{directory / 'model.pt'} does not fit the {cfg.model} model config.json names "
            f"({str(err).splitlines()[0]}); a model of your own: {yours}"
        ) from None
    return model.eval()


def clear_run(log_dir: str | Path) -> None:
    """``--overwrite``: remove what an earlier run left in ``log_dir`` (its CSV files, TensorBoard
    events, checkpoints and model), so nothing of it is resumed from or plotted with the new one."""
    directory = Path(log_dir)
    for name in ("metrics.csv", "eval.csv", "config.json", "model.pt"):
        (directory / name).unlink(missing_ok=True)
    for path in [directory / "tb", *directory.glob("ckpt-step*")]:
        if path.is_dir():
            shutil.rmtree(path)


def _marker(directory: Path) -> dict | None:
    try:
        info = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("ranks"), int) else None


def resolve(resume: str | Path) -> Path:
    """The checkpoint directory ``--resume`` names.

    1. A ``ckpt-stepN`` directory: it, if its marker is there.
    2. Any other directory (a log dir): its newest ``ckpt-stepN`` that has a marker.
    """
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: no such directory")
    if step_of(path) is not None:
        if _marker(path) is None:
            raise CheckpointError(
                f"--resume {resume}: this checkpoint is incomplete (no {MARKER} marker: the run was cut off "
                f"while writing it); resume from {path.parent} to take the newest complete one"
            )
        return path
    complete = complete_dirs(path)
    if not complete:
        raise CheckpointError(f"--resume {resume}: no complete checkpoint (ckpt-stepN/{MARKER}) in this directory")
    return complete[max(complete)]


def resume_hint(log_dir: str | Path | None) -> str | None:
    """What to run after a run in ``log_dir`` was interrupted: continue from its newest complete
    checkpoint with ``--resume``, or, without one, start again with ``--overwrite`` (the log dir
    refuses a new run otherwise). None without a log dir."""
    if not log_dir or not Path(log_dir).is_dir():
        return None
    try:
        newest = resolve(log_dir)
    except CheckpointError:
        return (
            f"{log_dir} holds no complete checkpoint: to start the run again there, add --overwrite "
            "(--checkpoint-every-steps N writes one every N steps)"
        )
    return f"the newest complete checkpoint is {newest}: continue the run with --resume {log_dir}"


def written_ranks(resume: str | Path) -> int:
    """How many ranks wrote the checkpoint ``--resume`` names (CheckpointError if there is none)."""
    return _marker(resolve(resume))["ranks"]


def run_dir(resume: str | Path | None) -> Path | None:
    """The log dir of the run ``--resume`` continues (``resume`` itself, or the parent of a
    ``ckpt-stepN``) when its ``config.json`` is there; None otherwise."""
    if not resume:
        return None
    path = Path(resume)
    path = path.parent if step_of(path) is not None else path
    return path if (path / "config.json").is_file() else None


# settings that say how long a run goes, where it writes and how it shows it: free to change on resume
_FREE_ON_RESUME = frozenset(
    {"steps", "epochs", "resume", "overwrite", "log_dir", "progress", "timeout", "threads", "device", "extra",
     "eval_every_epochs", "eval_every_steps", "eval_background", "tensorboard", "checkpoint_every_steps", "keep_checkpoints"}
)  # fmt: skip


def changed_settings(resume: str | Path, settings: dict) -> list[str]:
    """``--feedback ef -> none`` for each setting in ``settings`` (a RunConfig as a dict) that shapes
    the training and differs from the config.json of the run ``resume`` continues."""
    where = run_dir(resume)
    if where is None:
        return []
    try:
        saved = json.loads((where / "config.json").read_text())
    except (OSError, ValueError):
        return []
    changed = []
    for key, value in settings.items():
        value = json.loads(json.dumps(value))  # as config.json holds it (tuples as lists)
        if key not in _FREE_ON_RESUME and key in saved and saved[key] != value:
            changed.append(f"{option_flag(key)} {saved[key]} -> {value}")
    return changed


def load_rank_state(directory: Path, rank: int, ranks: int) -> dict:
    """Rank ``rank``'s state from a complete checkpoint; one-line CheckpointError otherwise."""
    info = _marker(directory)
    if info is None:
        raise CheckpointError(f"{directory}: incomplete checkpoint (no {MARKER} marker)")
    if info["ranks"] != ranks:
        raise CheckpointError(
            f"{directory} was written by {info['ranks']} ranks; this job has {ranks} (start it with -n {info['ranks']})"
        )
    path = directory / f"rank{rank}.pt"
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing, although {directory} is marked complete (was a file deleted?){_earlier(directory)}"
        )
    try:
        import torch

        state = torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001  torch raises many types; its text suggests unsafe loading
        raise CheckpointError(
            f"{path}: not a readable checkpoint ({type(err).__name__}): the file is corrupt{_earlier(directory)}"
        ) from None
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{path}: not a psgrad checkpoint (no step){_earlier(directory)}")
    return state


def _earlier(directory: Path) -> str:
    """Where a run whose checkpoint ``directory`` is damaged can resume instead: "; the complete
    checkpoint before it: --resume DIR/ckpt-stepM", or "" when there is none."""
    step = step_of(directory)
    older = {s: d for s, d in complete_dirs(directory.parent).items() if step is not None and s < step}
    return f"; the complete checkpoint before it: --resume {older[max(older)]}" if older else ""


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


def log_dir_problem(log_dir: str | None, *, resume: str | None, overwrite: bool) -> str | None:
    """Why a run may not write into ``log_dir`` (``--log-dir``), or None.

    1. The directory is made (with its parents) if it is not there: a path that cannot be one
       (a file on the way, no permission, a read-only file system) is said now, before any
       rank builds a model, not as a traceback once training would start.
    2. It must be writable.
    3. A run is there already, and neither --resume nor --overwrite was given."""
    if not log_dir:
        return None
    problem = folder_problem(Path(log_dir), "directory")
    if problem is not None:
        return f"--log-dir {log_dir} {problem}"
    if resume or overwrite:
        return None
    there = [name for name in ("config.json", "metrics.csv") if (Path(log_dir) / name).exists()]
    if not there:
        return None
    try:
        resolve(log_dir)
    except CheckpointError:  # nothing to resume: do not suggest it
        return (
            f"--log-dir {log_dir} holds a run already ({', '.join(there)}) and no complete checkpoint to "
            "resume from: replace it with --overwrite, or choose another directory"
        )
    return (
        f"--log-dir {log_dir} holds a run already ({', '.join(there)}): continue it with --resume "
        f"{log_dir}, replace it with --overwrite, or choose another directory"
    )
