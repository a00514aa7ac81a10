"""psgrad's codecs as a torch DDP communication hook (psgrad.ddpcomm).

On gloo without MPI (gloo_scripts/ddphook.py, one process per rank): equal to DDP and to torch's
PowerSGD hook where the codec is exact, a checkpoint round trip, a NaN that stops every rank.
Under mpiexec (mpi_scripts/userloop.py): bit for bit equal to psgrad's server path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import run_script

import psgrad
from psgrad.comm.wire import WireError
from psgrad.ddpcomm import Bucket, frame, overlap_note, unframe
from psgrad.inorder import InOrder

SCRIPT = Path(__file__).parent / "gloo_scripts" / "ddphook.py"
WORLD = 2


def _gloo(tmp_path: Path, scenario: str, *codec: str, world: int = WORLD) -> list[dict]:
    """Every rank of the gloo script, as separate processes; a rank still running after two
    minutes fails the test (and every rank is killed)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    tmp_path.mkdir(parents=True, exist_ok=True)  # the ranks meet through a file store in it
    ranks = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp_path), str(rank), str(world), scenario, *codec],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    try:
        logs = [proc.communicate(timeout=120)[0] for proc in ranks]
    finally:
        for proc in ranks:
            proc.kill()
    for proc, log in zip(ranks, logs, strict=True):
        assert proc.returncode == 0, log[-3000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]
    return [{**result, "log": log} for result, log in zip(results, logs, strict=True)]


def test_codec_none_equals_ddp_without_a_hook_and_needs_no_mpi(tmp_path):
    for result in _gloo(tmp_path, "dense", "none"):
        assert result["plain"] == 0.0, result
        assert result["mpi_started"] is False


def test_exact_powersgd_equals_ddp_and_torchs_powersgd_hook(tmp_path):
    """At a rank no smaller than any layer's matrix, one power iteration reproduces it: psgrad's
    two all-reduced rounds and torch's hook both give DDP's mean gradient."""
    for result in _gloo(tmp_path, "dense", "powersgd:rank=16,min_rate=0"):
        assert result["plain"] < 1e-6, result
        assert result["torch_powersgd"] < 1e-6, result


@pytest.mark.parametrize("codec", [["qsgd:levels=16", "ef"], ["powersgd:rank=2"]])
def test_a_checkpoint_round_trip_resumes_compression_exactly(tmp_path, codec):
    for result in _gloo(tmp_path, "resume", *codec):
        assert result["resumed"] == 0.0, result
        assert result["memories"] >= 3 and result["steps_saved"] == 4, result  # a memory per coded layer


def test_a_codec_that_trailed_dense_is_said_by_the_first_rank(tmp_path):
    """As psgrad train says at start-up: PowerSGD at rank 2 reached 0.98x dense (said once, by
    rank 0, in the words of a DDP script); dense coding says nothing."""
    logs = [result["log"] for result in _gloo(tmp_path / "powersgd", "dense", "powersgd:rank=2")]
    said = "[psgrad] note: this combination of codec, feedback and down-link reached 0.98x dense"
    assert said in logs[0] and "more epochs than DDP without the hook" in logs[0], logs[0][-3000:]
    assert said not in logs[1]
    assert not any("[psgrad] note" in result["log"] for result in _gloo(tmp_path / "none", "dense", "none"))


@pytest.mark.parametrize("codec", ["none", "powersgd:rank=16,min_rate=0"])
def test_the_exchange_overlaps_backward_and_keeps_the_buckets_in_order(tmp_path, codec):
    """With one rank 1.5 s late into a backward, the other's hook hands DDP every bucket of that
    step before a byte of it could be exchanged, and DDP waits for their futures: in several
    buckets, the run still ends where DDP without a hook does (exactly: PowerSGD at full rank)."""
    first, last = _gloo(tmp_path, "overlap", codec)
    assert first["buckets"] >= 2 and first["pending"] == first["buckets"], first
    assert first["plain"] < 1e-6 and last["plain"] < 1e-6, (first, last)


def test_a_hook_on_a_subgroup_needs_nothing_from_the_ranks_outside_it(tmp_path):
    """DDP over ranks 0 and 1 of three, the third busy elsewhere: the hook's own group is made by
    the two alone, their run ends where DDP without a hook does, and a group all three make
    afterwards still meets (a hang here fails the test at its timeout)."""
    first, second, third = _gloo(tmp_path, "subgroup", "none", world=3)
    assert first["plain"] == 0.0 and second["plain"] == 0.0, (first, second)
    assert third["outside"] and all(result["after"] == 3.0 for result in (first, second, third))


def test_a_bucket_exchanged_as_a_host_copy_gets_its_average_back(tmp_path):
    for result in _gloo(tmp_path, "hostcopy", "none"):
        assert result["plain"] == 0.0 and result["into_bucket"] and result["buckets"] >= 10, result


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("codec, tolerance", [("none", 1e-5), ("powersgd:rank=16,min_rate=0", 1e-4)])
def test_a_model_on_a_gpu_trains_as_ddp_without_the_hook_does(tmp_path, codec, tolerance):
    # the bucket goes to the host and its average back; the tolerance is for the GPU's own
    # nondeterministic kernels, which differ between the two trainings
    for result in _gloo(tmp_path, "cuda", codec):
        assert result["device"].startswith("cuda") and result["plain"] < tolerance, result


def test_the_first_rank_says_when_ddps_last_bucket_leaves_nothing_to_overlap(tmp_path):
    first, second = (result["log"] for result in _gloo(tmp_path, "buckets", "none"))
    said = "[psgrad] note: DDP's last bucket holds 100% of the gradient (2.4 MiB)"
    assert first.count(said) == 1, first  # once, for the default 25 MB buckets; not for 0.25 MB ones
    assert first.count("bucket_cap_mb=1") == 1 and "DDP's last bucket" not in second, (first, second)


def test_the_overlap_note_asks_for_smaller_buckets_only_where_they_would_help():
    mib = 2**20
    wrn_16_4 = [Bucket(size=int(10.57 * mib), largest=int(2.25 * mib))]  # DDP's default buckets
    assert "holds 100% of the gradient (10.6 MiB)" in overlap_note(wrn_16_4)
    split = [Bucket(size=int(s * mib), largest=mib) for s in (2.35, 2.25, 2.25, 1.13, 1.25, 1.02, 0.32)]
    assert overlap_note(split) is None  # bucket_cap_mb=1: the last holds 3 %
    assert overlap_note([Bucket(size=mib // 2, largest=mib // 8)]) is None  # too small to matter
    one_parameter = [Bucket(size=mib, largest=mib // 8), Bucket(size=3 * mib, largest=5 * mib // 2)]
    assert overlap_note(one_parameter) is None  # smaller buckets would not split its 2.5 MiB
    assert overlap_note([Bucket(size=mib, largest=mib // 8), Bucket(size=3 * mib, largest=mib)]) is not None


def test_a_nonfinite_gradient_stops_every_rank(tmp_path):
    """backward raises on every rank, and the error's first line names psgrad's error and the rank."""
    for result in _gloo(tmp_path, "nonfinite", "sign:bucket=32", "ef"):
        first_line = result["raised"].splitlines()[0] if result["raised"] else ""
        assert "NonFiniteError: step 3: the gradient of rank 1 holds NaN or Inf" in first_line, result


@pytest.mark.parametrize(
    "codec",
    [
        ["qsgd:levels=16", "ef"],  # all-gathered bytes, stochastic rounding from the same seeds
        ["powersgd:rank=2"],  # two all-reduced rounds
        ["randomk:ratio=0.1,shared=1", "ef"],  # all-reduced values on shared coordinates
    ],
)
def test_the_hook_equals_psgrads_server_path_bit_for_bit(tmp_path, codec):
    proc = run_script("userloop.py", str(tmp_path), "hook", "colocated", *codec, n=2, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert len(results) == 2 and all(result["hook"] == 0.0 for result in results), results


def test_settings_are_held_to_the_command_lines_rules():
    with pytest.raises(ValueError, match="keeps its own error feedback"):
        psgrad.ddp_hook("powersgd:rank=2", feedback="ef")
    with pytest.raises(ValueError, match="psgrad.ddp_hook: lr is a setting of psgrad's own loop"):
        psgrad.ddp_hook("qsgd", lr=0.1)
    with pytest.raises(ValueError, match="--dgc-momentum is DGC's: it means nothing without --feedback dgc"):
        psgrad.ddp_hook("qsgd", dgc_momentum=0.5)
    assert psgrad.ddp_hook("topk:ratio=0.01", feedback="dgc", dgc_warmup_epochs=2, nesterov=True)  # DGC, whole
    with pytest.raises(ValueError, match="no parameter 'levls'"):
        psgrad.ddp_hook("qsgd:levls=4")


def test_a_hook_without_parameter_names_says_how_to_give_them():
    hook = psgrad.ddp_hook("qsgd")
    with pytest.raises(TypeError, match="register it with the model as its state"):
        hook(None, None)


def test_under_the_mpi_backend_the_hook_says_why_it_cannot_make_its_group(monkeypatch):
    from psgrad import ddpcomm

    monkeypatch.setattr(ddpcomm.dist, "get_backend", lambda group=None: "mpi")
    monkeypatch.setattr(ddpcomm.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(ddpcomm.dist, "get_rank", lambda group=None: 0)
    hook = psgrad.ddp_hook("none")
    for _ in range(2):  # a call after the failed first one fails the same way, not with a half-made hook
        with pytest.raises(RuntimeError, match="the mpi backend has none: init_process_group with gloo or nccl"):
            hook(torch.nn.Linear(2, 2), None)


def test_a_state_that_is_not_the_hooks_is_refused_by_name():
    with pytest.raises(ValueError, match="not a psgrad.ddp_hook state_dict"):
        psgrad.ddp_hook("qsgd", feedback="ef").load_state_dict({"residual/w": torch.zeros(3)})
    with pytest.raises(ValueError, match="saved with another feedback or codec"):
        psgrad.ddp_hook("powersgd:rank=2").load_state_dict({"step": torch.tensor(3), "residual/w": torch.zeros(3)})


def test_framing_round_trips_and_refuses_malformed_buckets():
    pieces = [b"abc", b"", b"\x00" * 70]
    assert unframe(frame(pieces), count=3) == pieces
    blob = frame(pieces)
    with pytest.raises(WireError):
        unframe(blob, count=2)  # another layer count
    with pytest.raises(WireError):
        unframe(blob[:-1], count=3)  # cut short
    with pytest.raises(WireError):
        unframe(blob[:10], count=3)  # shorter than its lengths
    huge = bytearray(blob)
    huge[8:16] = (2**64 - 1).to_bytes(8, "little")  # a length that would wrap around
    with pytest.raises(WireError):
        unframe(bytes(huge), count=3)


def test_the_hooks_thread_runs_work_in_order_and_stops_at_the_first_failure():
    """``InOrder`` (the hook's thread): futures come back at once, complete in submission order on
    the named thread, and once a piece fails, the pieces after it fail too without running."""
    pieces, gate, ran = InOrder(name="psgrad-test-inorder"), threading.Event(), []

    def piece(value: float, *, fail: bool = False):
        def work():
            gate.wait(timeout=30)
            ran.append((value, threading.current_thread().name))
            if fail:
                raise ValueError(f"piece {value} failed")
            return torch.tensor(value)

        return work

    futures = [pieces.submit(piece(float(i))) for i in range(3)]
    assert not any(f.done() for f in futures)  # nothing runs on the caller's thread
    gate.set()
    assert [float(f.wait()) for f in futures] == [0.0, 1.0, 2.0]
    assert ran == [(float(i), "psgrad-test-inorder") for i in range(3)]
    failing, after = pieces.submit(piece(3.0, fail=True)), pieces.submit(piece(4.0))
    with pytest.raises(RuntimeError, match="ValueError: piece 3.0 failed"):
        failing.wait()
    with pytest.raises(RuntimeError, match="not run: an earlier piece failed with ValueError"):
        after.wait()
    assert [value for value, _ in ran] == [0.0, 1.0, 2.0, 3.0]
