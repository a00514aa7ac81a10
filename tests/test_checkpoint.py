"""Checkpoints: complete only with their marker, the newest complete one resumed, one-line errors."""

import io
import json

import pytest
import torch

from psgrad import checkpoint
from psgrad.checkpoint import CheckpointError


def _write(log, step, ranks=3, complete=True):
    directory = checkpoint.step_dir(log, step)
    for rank in range(ranks):
        checkpoint.save_rank_state(directory, rank, {"step": step, "w": torch.full((2,), float(rank))})
    if complete:
        checkpoint.mark_complete(directory, step, ranks)
    return directory


def test_log_dir_resumes_the_newest_complete_checkpoint(tmp_path):
    _write(tmp_path, 4)
    _write(tmp_path, 12)
    _write(tmp_path, 16, complete=False)  # cut off while writing
    assert checkpoint.resolve(tmp_path).name == "ckpt-step12"
    state = checkpoint.load_rank_state(checkpoint.resolve(tmp_path), 2, 3)
    assert state["step"] == 12 and state["w"].tolist() == [2.0, 2.0]
    assert json.loads((tmp_path / "ckpt-step12" / "COMPLETE").read_text()) == {"step": 12, "ranks": 3}


def test_incomplete_checkpoint_is_refused_with_the_way_out(tmp_path):
    directory = _write(tmp_path, 8, complete=False)
    with pytest.raises(CheckpointError, match="incomplete.*resume from"):
        checkpoint.resolve(directory)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        checkpoint.resolve(tmp_path)


def test_the_hint_after_an_interrupt_names_the_way_on(tmp_path):
    """After Ctrl-C or SIGTERM: resume from the newest complete checkpoint, or, with only an
    incomplete one (or none), start again with --overwrite, which the log dir needs."""
    log = tmp_path / "run"
    assert checkpoint.resume_hint(None) is None and checkpoint.resume_hint(log) is None  # no log dir
    log.mkdir()
    _write(log, 8, complete=False)
    assert checkpoint.resume_hint(log) == (
        f"{log} holds no complete checkpoint: to start the run again there, add --overwrite "
        "(--checkpoint-every-steps N writes one every N steps)"
    )
    _write(log, 4)
    assert checkpoint.resume_hint(log) == (
        f"the newest complete checkpoint is {log / 'ckpt-step4'}: continue the run with --resume {log}"
    )


def test_a_log_dir_holding_a_run_suggests_resume_only_with_a_checkpoint(tmp_path):
    from psgrad.checkpoint import log_dir_problem

    (tmp_path / "config.json").write_text("{}")
    problem = log_dir_problem(str(tmp_path), resume=None, overwrite=False)
    assert "no complete checkpoint to resume from: replace it with --overwrite" in problem, problem
    assert "--resume" not in problem, problem
    _write(tmp_path, 4)
    problem = log_dir_problem(str(tmp_path), resume=None, overwrite=False)
    assert f"continue it with --resume {tmp_path}, replace it with --overwrite" in problem, problem


def test_rank_count_mismatch_names_the_right_count(tmp_path):
    directory = _write(tmp_path, 8, ranks=5)
    with pytest.raises(CheckpointError, match="written by 5 ranks; this job has 3 .*-n 5"):
        checkpoint.load_rank_state(directory, 0, 3)


@pytest.mark.parametrize("content", [b"", b"\x00" * 10, bytes(range(256)) * 8, b"PK\x03\x04garbage"])
def test_corrupt_file_is_one_clear_line_never_suggesting_unsafe_loading(tmp_path, content):
    directory = _write(tmp_path, 8)
    (directory / "rank1.pt").write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load_rank_state(directory, 1, 3)
    text = str(err.value)
    assert "rank1.pt" in text and "corrupt" in text and "\n" not in text
    assert "weights_only" not in text


def test_a_damaged_checkpoint_names_the_complete_one_before_it(tmp_path):
    """A rank's file of the newest complete checkpoint missing or unreadable: the error names the
    complete checkpoint before it to resume from (not an incomplete one, not a newer one), and
    says nothing more when there is none."""
    _write(tmp_path, 4)
    _write(tmp_path, 6, complete=False)  # cut off while writing: no way back
    newest = _write(tmp_path, 8)
    _write(tmp_path, 12, complete=False)
    first = _write(tmp_path / "other", 2)
    (newest / "rank1.pt").write_bytes(b"\x00" * 10)
    (newest / "rank2.pt").unlink()
    (first / "rank0.pt").write_bytes(b"")
    way_back = f"; the complete checkpoint before it: --resume {tmp_path / 'ckpt-step4'}"
    for rank, said in ((1, "the file is corrupt"), (2, "was a file deleted?)")):
        with pytest.raises(CheckpointError) as err:
            checkpoint.load_rank_state(checkpoint.resolve(tmp_path), rank, 3)
        assert str(err.value).endswith(said + way_back), err.value
    with pytest.raises(CheckpointError) as err:
        checkpoint.load_rank_state(first, 0, 3)
    assert str(err.value).endswith("the file is corrupt"), err.value


def test_a_pickled_object_is_not_loaded(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    directory = _write(tmp_path, 8)
    torch.save({"step": 8, "x": Evil()}, directory / "rank0.pt")
    with pytest.raises(CheckpointError, match="corrupt"):
        checkpoint.load_rank_state(directory, 0, 3)


def test_model_file_loads_without_psgrad(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = checkpoint.save_model(tmp_path, model)
    fresh = torch.nn.Linear(3, 2)
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(fresh.weight, model.weight)


def test_a_resumed_log_appends_in_the_columns_its_metrics_file_already_has(tmp_path):
    """A run resumed by a newer psgrad (more metrics columns) keeps the file's own header, so
    every appended value stays under its name."""
    import csv

    from psgrad.metrics import METRIC_COLUMNS, MetricsLog

    old = [c for c in METRIC_COLUMNS if c != "load"]
    with open(tmp_path / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=old)
        writer.writeheader()
        writer.writerow({c: 0 for c in old})
    log = MetricsLog(str(tmp_path), total_steps=4, start_step=1, steps_per_epoch=4, label="test", progress=False)
    log.step({"step": 1, "loss": 0.5, "load": 0.25, "it_per_s": 2.0, "bytes_up": 7, "bytes_down": 0, "wall": 1.0})
    log.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[1]) == old
    assert (rows[1]["step"], rows[1]["loss"], rows[1]["bytes_up"], rows[1]["wall"]) == ("1", "0.5", "7", "1.0")
    fresh = MetricsLog(
        str(tmp_path / "new"), total_steps=4, start_step=0, steps_per_epoch=4, label="test", progress=False
    )
    fresh.close()
    assert "load" in (tmp_path / "new" / "metrics.csv").read_text().splitlines()[0].split(",")


def test_a_resumed_log_keeps_the_steps_before_its_checkpoint_once(tmp_path):
    """Resumed from an older checkpoint (step 6 of a run logged to step 9, its last line cut off by
    a kill), metrics.csv and eval.csv keep the rows before step 6 and the resumed run's, each step
    once."""
    import csv

    from psgrad.metrics import MetricsLog

    def row(step: int) -> dict:
        return {"step": step, "loss": 1.0 / (step + 1), "it_per_s": 2.0, "bytes_up": 7, "bytes_down": 0, "wall": step}

    first = MetricsLog(str(tmp_path), total_steps=10, start_step=0, steps_per_epoch=4, label="test", progress=False)
    for step in range(10):
        first.step(row(step))
    for step in (3, 7):
        first.evaluation(
            {"step": step, "epoch": (step + 1) / 4, "test_loss": 1.0, "test_acc": 0.5, "dataset": "synthetic"}
        )
    first.close()
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("10,0.1")  # the row being written when the job was killed
    resumed = MetricsLog(str(tmp_path), total_steps=12, start_step=6, steps_per_epoch=4, label="test", progress=False)
    for step in range(6, 12):
        resumed.step(row(step))
    resumed.evaluation({"step": 11, "epoch": 3.0, "test_loss": 0.5, "test_acc": 0.75, "dataset": "synthetic"})
    resumed.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert steps == list(range(12))
    with open(tmp_path / "eval.csv", newline="") as f:
        assert [(r["step"], r["test_acc"]) for r in csv.DictReader(f)] == [("3", "0.5"), ("11", "0.75")]


def test_a_resumed_run_s_clock_goes_on_from_its_last_step_kept(tmp_path):
    """A resumed job's own clock starts at 0; metrics.csv's ``wall`` goes on from the last step kept
    (the steps after the checkpoint, trained again, and the time the job was down do not count), so
    wall time and time to accuracy read one clock. It used to go back to 0 at the resume."""
    import csv

    from psgrad.metrics import MetricsLog

    def row(step: int, wall: float) -> dict:
        return {"step": step, "loss": 1.0, "it_per_s": 2.0, "bytes_up": 7, "bytes_down": 0, "wall": wall}

    first = MetricsLog(str(tmp_path), total_steps=10, start_step=0, steps_per_epoch=4, label="test", progress=False)
    for step in range(10):
        first.step(row(step, 0.5 * (step + 1)))  # steps 0..9 end at 0.5 .. 5.0 s
    first.close()
    resumed = MetricsLog(str(tmp_path), total_steps=12, start_step=6, steps_per_epoch=4, label="test", progress=False)
    for step in range(6, 12):
        resumed.step(row(step, 0.25 * (step - 5)))  # its own clock: 0.25 s after its start, ...
    resumed.close()
    with open(tmp_path / "metrics.csv", newline="") as f:
        walls = [float(r["wall"]) for r in csv.DictReader(f)]
    # step 5, the last kept, ended at 3.0 s: the resumed steps at 3.25 .. 4.5 s
    assert walls == [0.5 * (s + 1) for s in range(6)] + [3.0 + 0.25 * (s - 5) for s in range(6, 12)]


def _full_disk_save(obj, f):
    """torch.save as on a full disk: part of the file written, then the system's error, wrapped as
    torch wraps it (its zip writer raises its own error while the OSError is handled)."""
    f.write(b"partial")
    try:
        raise OSError(28, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_leaves_no_partial_file(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", _full_disk_save)
    directory = checkpoint.step_dir(tmp_path, 5)
    with pytest.raises(CheckpointError) as caught:
        checkpoint.save_rank_state(directory, 0, {"step": 5})
    message = str(caught.value)
    assert f"could not write {directory / 'rank0.pt'}: No space left on device" in message, message
    assert "another --log-dir" in message
    assert sorted(p.name for p in directory.iterdir()) == [], "the partial file holds the space that is short"


@pytest.mark.parametrize("stop", ["SIGTERM", "Ctrl-C"])
def test_a_stop_during_a_checkpoint_write_stops_and_is_no_write_error(tmp_path, monkeypatch, stop):
    """The file's ``write`` is Python code: a SIGTERM or Ctrl-C arriving while torch writes a
    checkpoint is raised inside torch's writer, which reports "unexpected pos". That was said as a
    failed write (CheckpointError, status 1) instead of the stop it is (130, 143: CI caught it)."""
    from psgrad.runtime.signals import Terminated

    real_save = torch.save

    class Stopped(io.FileIO):
        writes = 0

        def write(self, data):
            Stopped.writes += 1
            if Stopped.writes == 2:
                raise Terminated(15) if stop == "SIGTERM" else KeyboardInterrupt()
            return super().write(data)

    monkeypatch.setattr(torch, "save", lambda obj, f: real_save(obj, Stopped(f.fileno(), "wb", closefd=False)))
    directory = checkpoint.step_dir(tmp_path, 5)
    with pytest.raises(KeyboardInterrupt) as caught:
        checkpoint.save_rank_state(directory, 0, {"step": 5, "w": torch.zeros(10_000)})
    assert type(caught.value) is (Terminated if stop == "SIGTERM" else KeyboardInterrupt)
    assert sorted(p.name for p in directory.iterdir()) == [], "the partial file is removed"


def test_the_complete_marker_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    directory = checkpoint.step_dir(tmp_path, 5)
    directory.mkdir()
    checkpoint.mark_complete(directory, 5, 3)
    assert json.loads((directory / checkpoint.MARKER).read_text()) == {"step": 5, "ranks": 3}

    class FullDisk(io.BytesIO):
        def write(self, data):
            raise OSError(28, "No space left on device")

    def open_on_a_full_disk(path, mode):
        open(path, mode).close()  # the file is created; its bytes find no room
        return FullDisk()

    monkeypatch.setattr(checkpoint, "open", open_on_a_full_disk, raising=False)
    other = checkpoint.step_dir(tmp_path, 6)
    other.mkdir()
    with pytest.raises(CheckpointError, match="COMPLETE: No space left on device"):
        checkpoint.mark_complete(other, 6, 3)
    assert list(other.iterdir()) == []


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_model_pt_scores_what_the_last_evaluation_said(tmp_path, topology):
    """model.pt is the evaluated model: the servers' values with the workers' averaged BatchNorm
    statistics (a worker's own statistics scored otherwise), loaded back by psgrad.load_model."""
    import csv

    from click.testing import CliRunner

    from psgrad import load_model
    from psgrad.cli import main
    from psgrad.config import RunConfig
    from psgrad.data import eval_batches
    from psgrad.evaluation import evaluate
    from psgrad.shards import load_split

    log = tmp_path / "run"
    options = ["simulate", "--workers", "2", "--topology", topology, "--model", "wrn", "--depth", "10"]
    options += ["--widen-factor", "1", "--batch-size", "8", "--steps", "6", "--no-progress", "--log-dir", str(log)]
    done = CliRunner().invoke(main, options)
    assert done.exit_code == 0, done.output[-3000:]
    # said once, by rank 0, after the progress bar and the summary (not amid them by another rank)
    assert done.stderr.count("trained model:") == 1
    assert done.stderr.index("[psgrad] done:") < done.stderr.index("trained model:"), done.stderr
    with open(log / "eval.csv", newline="") as f:
        last = list(csv.DictReader(f))[-1]
    cfg = RunConfig.from_json((log / "config.json").read_text())
    loss, accuracy = evaluate(
        load_model(log), eval_batches(load_split(cfg, "test"), cfg.dataset), torch.nn.functional.cross_entropy
    )
    assert (loss, accuracy) == (pytest.approx(float(last["test_loss"]), rel=1e-6), float(last["test_acc"]))


def test_load_model_names_what_is_missing(tmp_path):
    from psgrad import load_model

    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_model(tmp_path)


def test_load_model_takes_the_path_the_run_printed_and_refuses_a_damaged_file_in_one_line(tmp_path):
    """load_model takes the run's log dir or its model.pt (the path a run prints at its end); a
    model.pt torch cannot read is one CheckpointError, not torch's advice to load it unsafely."""
    from psgrad import load_model
    from psgrad.config import RunConfig
    from psgrad.models import build_model

    RunConfig(model="mlp").save(tmp_path, {"model": "MLP"})
    model = build_model("mlp", 10)
    checkpoint.save_model(tmp_path, model)
    for given in (tmp_path, tmp_path / "model.pt"):
        loaded = load_model(given).state_dict()
        assert all(torch.equal(loaded[name], value) for name, value in model.state_dict().items())
    with pytest.raises(CheckpointError, match=r"config.json is a file: give the run's log dir"):
        load_model(tmp_path / "config.json")
    whole = (tmp_path / "model.pt").read_bytes()
    for damaged in (b"not a torch file", whole[: len(whole) // 2]):
        (tmp_path / "model.pt").write_bytes(damaged)
        with pytest.raises(
            CheckpointError, match=r"model.pt: not a readable model \(\w+\): the file is damaged"
        ) as err:
            load_model(tmp_path)
        assert "weights_only" not in str(err.value), err.value


def test_load_model_of_a_run_with_a_model_of_your_own_says_so_in_one_line(tmp_path):
    """train.run(model_fn=...) with a log dir: config.json records the model's class beside
    psgrad's --model default, and load_model says the model is the caller's to build, where it
    used to print every missing key of a WideResNet. A model.pt that does not fit (no class
    recorded) is one line too."""
    from psgrad import load_model
    from psgrad.config import RunConfig
    from psgrad.models import build_model
    from psgrad.sim.simulate import simulate

    def batches():
        return [(torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))]

    cfg = RunConfig(model="mlp", steps=2, batch_size=8, progress=False, timeout=30, log_dir=str(tmp_path / "run"))
    simulate(cfg, 2, model_fn=lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3072, 10)),
             eval_data=batches())  # fmt: skip
    facts = json.loads((tmp_path / "run" / "config.json").read_text())["run"]
    assert facts["model"] == "Sequential" and facts["data"] == cfg.dataset_label
    with pytest.raises(CheckpointError, match=r"a model of your own \(Sequential\), not psgrad's mlp: build it"):
        load_model(tmp_path / "run")
    del facts["model"]  # a config.json without the class (an older run's)
    (tmp_path / "run" / "config.json").write_text(json.dumps({**RunConfig(model="mlp").__dict__, "run": facts}))
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path / "run")
    assert "model.pt does not fit the mlp model" in str(err.value) and "\n" not in str(err.value), err.value
    checkpoint.save_model(tmp_path / "run", build_model("mlp", 10))
    assert isinstance(load_model(tmp_path / "run"), torch.nn.Module)  # psgrad's own model still loads
