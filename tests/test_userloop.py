"""psgrad in your own training loop (psgrad.userloop): every worker's result, under mpiexec.

tests/mpi_scripts/userloop.py trains a small CNN with SGD and momentum through
``psgrad.DistributedOptimizer`` and compares, on every worker, with the mean-gradient SGD written
out in one process, with torch DDP on gloo, with itself resumed from a checkpoint, and with
psgrad's own loop (``psgrad.train.run``) on the same data.
"""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS, interrupt_when, mpiexec, run_script

import psgrad
from psgrad.config import RunConfig
from psgrad.settings import settings_of

RANKS = {"ps": 3, "colocated": 2}  # ps: one server and two workers; colocated: two of both


def _results(tmp_path, scenario: str, topology: str, *codec: str) -> list[dict]:
    proc = run_script("userloop.py", str(tmp_path), scenario, topology, *codec, n=RANKS[topology], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = sorted(tmp_path.glob("rank*.json"))
    assert len(found) == 2, (found, proc.stderr[-3000:])  # every worker wrote its result
    return [json.loads(path.read_text()) for path in found]


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_with_codec_none_it_is_data_parallel_sgd_and_equals_ddp(tmp_path, topology):
    """The mean of the workers' gradients, in worker order, then the user's SGD: equal to the
    reference bit for bit, to DDP to float tolerance; a checkpoint round trip ends where the
    uninterrupted run does."""
    for result in _results(tmp_path, "train", topology, "none"):
        assert result["reference"] == 0.0, result
        assert result["ddp"] < 1e-5, result
        assert result["resumed"] == 0.0, result


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_the_workers_average_a_metric_and_their_batchnorm_statistics(tmp_path, topology):
    """psgrad.average is the workers' mean on every worker (floats and floating tensors averaged,
    counts and other values the first worker's); average_buffers gives every worker the mean of
    the running statistics, which followed each worker's own shard."""
    for result in _results(tmp_path, "average", topology, "none"):
        assert result == {
            "acc": 0.0, "t": 0.0, "count": 0, "pair": [0.0, "w"], "numpy": 0.0, "mean": 0.0, "var": 0.0, "tracked": 7,
        }  # fmt: skip


def test_values_of_different_structures_end_the_job_saying_what_each_worker_passed(tmp_path):
    proc = run_script("userloop.py", str(tmp_path), "average_apart", "colocated", "none", n=2, timeout=60)
    assert proc.returncode != 0
    said = "psgrad.average: every worker must pass a value of the same structure, got worker 0: ['loss'], worker 1: ['acc']"
    assert said in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize(
    "topology, codec",
    [
        ("colocated", ["sign:bucket=32", "ef", "qsgd:levels=16"]),  # worker and server-part memories
        ("ps", ["topk:ratio=0.1", "ef"]),  # the workers' error feedback
        ("ps", ["powersgd:rank=2"]),  # PowerSGD's rounds, error and Q on the workers
        ("ps", ["qsgd:levels=16", "ef", "qsgd:levels=16"]),  # the serving-only rank's down-link memory
    ],
)
def test_a_checkpoint_round_trip_resumes_compression_exactly(tmp_path, topology, codec):
    for result in _results(tmp_path, "train", topology, *codec):
        assert result["resumed"] == 0.0, result
        assert 0.0 < result["reference"] < 0.2, result  # lossy, and still the same training


@pytest.mark.parametrize(
    "topology, codec",
    [
        ("ps", ["qsgd:levels=16", "ef"]),  # a lossy codec inside the workers' error feedback
        ("colocated", ["powersgd:rank=2"]),  # PowerSGD's rounds: the same gradient on every rank
    ],
)
def test_your_loop_equals_psgrads_own_loop_bit_for_bit(tmp_path, topology, codec):
    """One engine, two doors: psgrad train's servers apply SGD to the sum of the workers' coded
    gradients; your loop gets that sum back and applies the same SGD on every worker."""
    proc = run_script("userloop.py", str(tmp_path), "run", topology, *codec, n=RANKS[topology], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for result in _results(tmp_path, "against_run", topology, *codec):
        assert result["run"] == 0.0, result


@pytest.mark.parametrize(
    "topology, codec",
    [
        ("ps", ["none"]),
        ("colocated", ["qsgd:levels=16", "ef"]),  # coded changes inside error feedback
        ("colocated", ["qsgd:levels=16", "ef", "qsgd:levels=64"]),  # and a coded mean change
    ],
)
def test_local_steps_in_your_loop_equal_psgrads_own_loop_and_resume_exactly(tmp_path, topology, codec):
    """``psgrad.init(local_steps=4)``: your SGD steps on each worker's own gradient, and every 4th
    step the workers' mean change takes the outer Nesterov step. psgrad train's servers take that
    step on their values; your loop's workers take it on theta_sync: the same parameters with an
    exact down-link, nearly the same with a coded one (it codes the change, psgrad train the
    update), the workers alike either way. After an exchange, ``.grad`` holds the worker's gradient
    (a gradient-norm log after step() sees no spike). A checkpoint between two exchanges resumes
    exactly; a per-step one is refused."""
    proc = run_script("userloop.py", str(tmp_path), "run_local", topology, *codec[:2], n=RANKS[topology], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    coded = len(codec) > 2
    for result in _results(tmp_path, "against_run_local", topology, *codec):
        assert (0.0 < result["run"] < 0.05) if coded else result["run"] == 0.0, result
        assert result["apart"] == 0.0 and result["resumed"] == 0.0 and result["grad_changed"] == 0.0, result
        assert "saved with local_steps off, and this job has local_steps=4" in result["per_step_state"], result


def test_accumulated_half_batches_equal_the_whole_batch(tmp_path):
    for result in _results(tmp_path, "accumulate", "colocated", "none"):
        assert result["reference"] < 1e-6, result


def test_clipping_between_synchronize_and_step_clips_the_mean_gradient(tmp_path):
    for result in _results(tmp_path, "clip", "ps", "none"):
        assert result["reference"] < 1e-6, result


def test_a_loss_scale_unscales_the_mean_gradient(tmp_path):
    """GradScaler's recipe: synchronize, unscale_, then the scaler's step without a second sync.
    Scales of a power of two divide away exactly."""
    for result in _results(tmp_path, "scaler", "colocated", "none"):
        assert result["reference"] < 1e-6, result


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_a_backward_inside_autocast_still_codes_in_fp32(tmp_path, topology):
    """Forward and backward inside a bf16 autocast block: psgrad's hooks run inside it, and
    PowerSGD's products in bf16 could not go on the wire (they did, and failed). The run ends
    near the same steps without autocast (only the forward's rounding differs)."""
    for result in _results(tmp_path, "autocast", topology, "powersgd:rank=2"):
        assert result["autocast"] < 0.05, result


def test_misuse_raises_a_clear_error_and_the_loop_goes_on(tmp_path):
    for result in _results(tmp_path, "misuse", "colocated", "none"):
        assert "before step() or synchronize()" in result["zero_grad"], result
        assert "backward_passes_per_step=1" in result["second_backward"], result
        assert "save after step()" in result["state_mid_step"], result
        assert "needs synchronize() first" in result["skip_without_synchronize"], result
        assert "one DistributedOptimizer per process" in result["second_optimizer"], result
        assert "saved by rank" in result["anothers_state"] and "load each rank's own" in result["anothers_state"]
        assert result["went_on"] == "yes"
        assert result["broadcast_lr"] == 0.123 and result["momentum_buffers"] == 6, result  # every worker


def test_set_epoch_drives_dgcs_sparsity_warm_up(tmp_path):
    """Top-k 1 % in DGC's memory, warmed up over 2 epochs: epoch 0 sends a denser top-k (25 %)
    than the final one, which ``set_epoch(2)`` reaches."""
    for result in _results(tmp_path, "warmup", "ps", "topk:ratio=0.01", "dgc"):  # every layer on the wire
        assert result["epoch0"] > 5 * result["after"], result


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_a_worker_that_stops_early_ends_the_job_with_an_error_not_a_hang(tmp_path, topology):
    """One worker takes a step more than the other: its gradients of that step can never be summed.
    The server that sees it names the stopped rank and the rule, and the whole job ends."""
    proc = run_script("userloop.py", str(tmp_path), "uneven", topology, "none", n=RANKS[topology], timeout=120)
    assert proc.returncode != 0
    assert "stopped training before its gradients of step" in proc.stderr, proc.stderr[-3000:]
    assert "every worker must take the same number of steps" in proc.stderr


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_a_stopped_worker_ends_the_job_naming_it(tmp_path, topology):
    """A worker stopped (SIGSTOP) at step 3 of your loop sends no heartbeat: within timeout=5
    seconds the job ends, naming it and what the others wait for (they waited for ever)."""
    proc = run_script("userloop.py", str(tmp_path), "stall", topology, "none", n=RANKS[topology], timeout=120)
    assert proc.returncode != 0
    stopped = 2 if topology == "ps" else 1
    assert f"no heartbeat from rank {stopped}" in proc.stderr, proc.stderr[-3000:]
    assert "waiting for" in proc.stderr and "(timeout=5)" in proc.stderr  # what the others wait for, how long


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_a_worker_busy_in_your_loop_is_named_and_the_job_goes_on(tmp_path, topology):
    """A worker sleeps 9 s in your loop at step 3 with timeout=5: the others wait for it. The
    watchdog says once which rank holds them up and what it last reported, and does not end the
    job: a rank still busy may yet finish (a stuck one used to hold the job without a word)."""
    proc = run_script("userloop.py", str(tmp_path), "busy", topology, "none", n=RANKS[topology], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    busy = 2 if topology == "ps" else 1
    said = [line for line in proc.stderr.splitlines() if line.startswith("[psgrad watchdog]")]
    assert len(said) == 1, proc.stderr[-3000:]
    role = "worker" if topology == "ps" else "server+worker"
    assert f"busy meanwhile: rank {busy} ({role}), last reported 'step 3: in your loop'" in said[0], said
    waiting = [r for r in range(RANKS[topology]) if r != busy]
    assert all(f"rank {r} (" in said[0].split("busy meanwhile")[0] for r in waiting), said
    assert "(timeout=5)" in said[0]


@pytest.mark.parametrize(
    "topology, stop, said, status",
    [
        ("ps", signal.SIGINT, "interrupted", 130),
        ("colocated", signal.SIGINT, "interrupted", 130),
        ("ps", signal.SIGTERM, r"terminated \(SIGTERM\)", 143),
    ],
)
def test_a_stopped_job_says_where_each_rank_stopped_and_ends_with_the_signals_status(
    tmp_path, topology, stop, said, status
):
    """Ctrl-C (or SIGTERM, a scheduler's cancel) in your loop: each rank says in one line where
    the script stopped and what psgrad was doing, and the job ends with the shell's status for the
    signal; no rank prints a traceback into psgrad's waits (three of them buried the one line
    before), and a terminated rank no longer dies without a word (its sentinel blamed a crash)."""
    cmd = [mpiexec(), "-n", str(RANKS[topology]), sys.executable, str(SCRIPTS / "userloop.py"), str(tmp_path),
           "forever", topology, "none"]  # fmt: skip
    trains = f"worker {RANKS[topology] - 2} trains"
    proc = interrupt_when(cmd, lambda err: trains in err, tmp_path / "err", timeout=120, sig=stop)
    err = (tmp_path / "err").read_text()
    assert proc.returncode == status, err[-3000:]
    said = re.findall(rf"^\[psgrad rank (\d)\] {said} at userloop\.py:\d+, (.*)$", err, re.MULTILINE)
    assert sorted(int(rank) for rank, _ in said) == list(range(RANKS[topology])), err[-3000:]
    assert all(re.match(r"(step \d+: |serving: )", doing) for _, doing in said), said
    assert "Traceback" not in err and "died without a word" not in err, err[-3000:]


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_a_scheduler_stop_with_dataloader_workers_says_one_line_a_rank(tmp_path, topology):
    """SIGTERM to every process of the job, the DataLoader's worker processes too (a scheduler's
    cancel): each rank says its line, and no report of the loader's workers killed by it follows
    (torch printed two tracebacks a rank from the loader's ``__del__``)."""
    cmd = [mpiexec(), "-n", str(RANKS[topology]), sys.executable, str(SCRIPTS / "userloop.py"), str(tmp_path),
           "forever_loader", topology, "none"]  # fmt: skip
    trains = f"worker {RANKS[topology] - 2} trains"
    proc = interrupt_when(cmd, lambda err: trains in err, tmp_path / "err", timeout=120, sig=signal.SIGTERM)
    err = (tmp_path / "err").read_text()
    assert proc.returncode == 143, err[-3000:]
    said = re.findall(r"^\[psgrad rank (\d)\] terminated \(SIGTERM\) at ", err, re.MULTILINE)
    assert sorted(map(int, said)) == list(range(RANKS[topology])), err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]


def test_an_error_a_library_reports_from_its_own_thread_does_not_end_the_job(monkeypatch):
    """multiprocessing's resource sharer hands its thread's errors to ``sys.excepthook``: psgrad's
    hook ended the job for them, as for an error of the script's. From another thread it prints,
    as Python's would; from the main thread it still ends the job."""
    import threading

    from psgrad.userloop import world

    aborted, printed = [], []
    monkeypatch.setattr(world, "_abort", lambda why, **_: aborted.append(why))
    hook = world._end_job_on_error(lambda kind, value, trace: printed.append(value))
    reset = ConnectionResetError("reset by peer")
    thread = threading.Thread(target=hook, args=(ConnectionResetError, reset, None))
    thread.start()
    thread.join()
    assert printed == [reset] and aborted == []
    hook(ValueError, ValueError("the script's"), None)
    assert aborted == ["ValueError: the script's"]


def test_a_library_threads_report_is_printed_whole_or_left_out_once_the_rank_stops(monkeypatch):
    """A DataLoader worker's resource sharer reports the rank's connection closed when a stop
    reaches the job, a moment before the worker's own SIGTERM ends it; printed line by line, the
    process's end left a bare "Traceback" line beside the ranks' one line each. The report
    waits that moment, is left out if the rank is stopping by then, and otherwise goes out in
    one write."""
    import threading
    import types

    from psgrad.userloop.stopping import report_from_thread

    writes = []
    monkeypatch.setattr(sys, "stderr", types.SimpleNamespace(write=writes.append, flush=lambda: None))
    try:
        raise ConnectionResetError("reset by peer")
    except ConnectionResetError:
        error = sys.exc_info()
    report_from_thread(sys.__excepthook__, error, stops=None)
    assert len(writes) == 1 and writes[0].startswith("Traceback (most recent call last):\n"), writes
    assert writes[0].endswith("ConnectionResetError: reset by peer\n"), writes
    writes.clear()
    stops = types.SimpleNamespace(stopping=False)
    threading.Timer(0.1, lambda: setattr(stops, "stopping", True)).start()  # the rank's signal, handled
    report_from_thread(sys.__excepthook__, error, stops=stops)
    assert writes == []


def test_a_stop_in_your_code_is_said_to_be_in_your_loop():
    """A signal handler's frames end every stop's traceback, wherever the main thread was: a
    Ctrl-C during your ``time.sleep`` was said to be "in psgrad's hooks" (the handler that notes
    the stop is psgrad's). A stop inside psgrad's code still says so."""
    import types

    from psgrad.codecs import make_codec
    from psgrad.runtime.signals import _raise_terminated
    from psgrad.userloop.stopping import StopTogether, where_it_stopped

    unasked = types.SimpleNamespace(stopping=False, passed_from=None, _takes=lambda signum: False)
    noted = StopTogether._noting(unasked, _raise_terminated)
    for handler in (noted, _raise_terminated):
        with pytest.raises(KeyboardInterrupt) as stopped:
            handler(signal.SIGTERM, None)  # as Python runs it, on this line
        line, inside = where_it_stopped(stopped.value.__traceback__)
        assert line.startswith("test_userloop.py:") and not inside, (handler, line)
    with pytest.raises(ValueError) as raised:
        make_codec("no-such-codec")
    assert where_it_stopped(raised.value.__traceback__)[1]  # it ended in psgrad's code


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_a_stopped_job_ends_once_every_rank_ran_its_finally_blocks(tmp_path, topology):
    """Ctrl-C while the first worker's ``finally`` takes 3 s to save: the job ends once it saved,
    its line said. The ranks with nothing to do on the way (the serving rank, the other worker)
    aborted the job after half a second and cut the save short."""
    cmd = [mpiexec(), "-n", str(RANKS[topology]), sys.executable, str(SCRIPTS / "userloop.py"), str(tmp_path),
           "forever_saving", topology, "none"]  # fmt: skip
    trains = f"worker {RANKS[topology] - 2} trains"
    proc = interrupt_when(cmd, lambda err: trains in err, tmp_path / "err", timeout=120)
    err = (tmp_path / "err").read_text()
    assert proc.returncode == 130, err[-3000:]
    assert (tmp_path / "saved").exists(), err[-3000:]
    said = re.findall(r"^\[psgrad rank (\d)\] interrupted at userloop\.py:\d+", err, re.MULTILINE)
    assert sorted(int(rank) for rank in said) == list(range(RANKS[topology])), err[-3000:]


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_a_rank_terminated_alone_stops_every_rank_as_it_was(tmp_path, topology):
    """SIGTERM to one rank alone (a node's scheduler, ``kill PID``): it passes the stop on, so every
    rank stops as if terminated itself (the first worker's ``finally`` saves), says so naming the
    rank, and the job ends with status 143. Before, the others were ended by its abort mid-step."""
    cmd = [mpiexec(), "-n", str(RANKS[topology]), sys.executable, str(SCRIPTS / "userloop.py"), str(tmp_path),
           "forever_saving", topology, "none"]  # fmt: skip
    last = RANKS[topology] - 1  # the last worker: not the one that saves

    def last_rank(err: str) -> int:
        return int(re.search(rf"\b{last}=[a-z+]+:(\d+)", err).group(1))

    trains = f"worker {RANKS[topology] - 2} trains"
    proc = interrupt_when(cmd, lambda err: trains in err, tmp_path / "err", timeout=120, sig=signal.SIGTERM,
                          target=last_rank)  # fmt: skip
    err = (tmp_path / "err").read_text()
    assert proc.returncode == 143, err[-3000:]
    assert (tmp_path / "saved").exists(), err[-3000:]
    said = dict(re.findall(r"^\[psgrad rank (\d)\] terminated \(SIGTERM\)(.*?) at userloop", err, re.MULTILINE))
    assert said == {str(r): "" if r == last else f" as rank {last} was," for r in range(RANKS[topology])}, err[-3000:]


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_the_same_error_on_every_worker_prints_one_traceback(tmp_path, topology):
    """Each worker says the error in one line; the traceback comes once, from the worker that
    ended the job (it came from every worker, one after another)."""
    proc = run_script("userloop.py", str(tmp_path), "raise_all", topology, "none", n=RANKS[topology], timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr[-3000:]
    assert "ValueError: the same error on every worker" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_a_script_that_ends_without_training_ends_the_job(tmp_path, topology):
    """Workers that exit after init without a DistributedOptimizer (a script's own --help) end
    the job with status 0: the serving ranks waited for ever for the layer plan. When only the
    first worker builds one, the job ends with an error naming both ranks."""
    proc = run_script("userloop.py", str(tmp_path), "no_optimizer", topology, "none", n=RANKS[topology], timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_script("userloop.py", str(tmp_path), "one_optimizer", topology, "none", n=RANKS[topology], timeout=60)
    first, second = (1, 2) if topology == "ps" else (0, 1)
    assert proc.returncode != 0
    assert f"rank {first} built a DistributedOptimizer and rank {second} ended without one" in proc.stderr, proc.stderr[
        -3000:
    ]


@pytest.mark.parametrize(
    "codec, says",
    [
        # trailed dense in psgrad's measurements: said once for the job, as psgrad train says it
        (["topk:ratio=0.01", "ef"], "reached 0.93x dense test accuracy at equal epochs on the accuracy proxy"),
        # the down-codec codes only the layers PowerSGD sends whole: the first worker knows them
        (
            ["powersgd:rank=2", "none", "qsgd:levels=4"],
            "down_codec='qsgd:levels=4' codes no reply here: powersgd:rank=2 factors every",
        ),
    ],
)
def test_your_loop_is_told_at_start_up_what_psgrad_train_would_say(tmp_path, codec, says):
    proc = run_script("userloop.py", str(tmp_path), "clip", "ps", *codec, n=3, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("[psgrad] note:")]
    assert len(notes) == 1 and says in notes[0], proc.stderr[-3000:]
    assert "codec='none'" in notes[0] or "down_codec=" in notes[0]  # the script's words, not the CLI's
    # who is who (rank 0 serves and never returns from init), and the exchange: once for the job
    roles = [line for line in proc.stderr.splitlines() if line.startswith("[psgrad] rank=role:pid ")]
    assert len(roles) == 1 and re.match(r"\[psgrad\] rank=role:pid 0=server:\d+, 1=worker:\d+, 2=worker:\d+$", roles[0])
    assert proc.stderr.count(f"psgrad.init: 3 ranks (1 serving, 2 working), topology ps, codec {codec[0]}") == 1


@pytest.mark.parametrize("topology", ["ps", "colocated"])
def test_two_ranks_under_ps_are_told_they_train_on_one_worker(tmp_path, topology):
    """mpiexec -n 2 under ps is one server and one worker: nothing runs in parallel, as psgrad
    train says; colocated, both ranks work."""
    proc = run_script("userloop.py", str(tmp_path), "no_optimizer", topology, "none", n=2, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = "note: the 2 ranks of topology ps are 1 server(s) and 1 worker: no data parallelism. topology='colocated'"
    assert proc.stderr.count(said) == (1 if topology == "ps" else 0), proc.stderr[-3000:]


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"lr": 0.5}, "lr is a setting of psgrad's own loop"),
        ({"epochs": 3, "log_dir": "runs/x"}, "epochs, log_dir are settings of psgrad's own loop"),
        ({"checkpoint_every_steps": 5}, "checkpoint_every_steps is a setting of psgrad's own loop"),
        ({"serve_thread": True}, "serve_thread is a setting of psgrad's own loop"),
        ({"nesterov": True}, "nesterov is DGC's momentum correction here: it needs feedback='dgc'"),
        ({"dgc_momentum": 0.5}, "--dgc-momentum is DGC's: it means nothing without --feedback dgc"),
        ({"topology": "ring"}, "topology must be one of ps, colocated"),
        ({"mode": "async"}, "mode must be sync"),
        ({"local_steps": 4, "overlap_exchange": True}, "overlap_exchange is a setting of psgrad's own loop"),
        ({"outer_lr": 0.5}, "--outer-lr shapes --local-steps: give --local-steps H"),
        ({"learning_rate": 0.1}, "unknown setting"),
        ({"codecs": "qsgd"}, "unknown setting(s) codecs (did you mean codec?)"),
    ],
)
def test_init_refuses_a_setting_your_loop_would_ignore(settings, says):
    """Before it joins any job: a setting of psgrad's own loop, or one its own rules call unused,
    is a ValueError naming it; psgrad would otherwise drop it without a word."""
    with pytest.raises(ValueError, match=re.escape(says)):
        psgrad.init(**{"topology": "colocated", **settings})
    assert psgrad.userloop.world._WORLD is None


def test_a_script_started_without_mpiexec_under_ps_is_told_how_to_start():
    """One rank cannot hold a server and a worker: the message names the script's own launch
    (it used to point at psgrad simulate, which runs psgrad's loop, not a script)."""
    import sys

    from conftest import run_bounded

    done = run_bounded([sys.executable, "-c", "import psgrad; psgrad.init(codec='none')"], 60)
    assert done.returncode != 0
    assert "needs at least 2 ranks, and this job has 1: start the script with mpiexec -n 3" in done.stderr, done.stderr
    assert "psgrad simulate" not in done.stderr


def test_docs_name_every_setting_init_takes():
    """docs/api.md lists exactly the settings table's ``your_loop`` settings."""
    text = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    listed = re.search(r"Its keywords are (.*?)\. ", text, re.DOTALL).group(1)
    named = set(re.findall(r"`(\w+)=`", listed))
    assert named == {name for name, (_, meta) in settings_of(RunConfig).items() if meta.your_loop}
