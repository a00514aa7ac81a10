"""Local steps and an outer optimizer (``--local-steps H``, DiLoCo): psgrad.engine.local.

Under mpiexec (several ``psgrad train`` runs in one job): one local step with outer SGD at lr 1
and no momentum is today's synchronous step; with H > 1 only every H-th step exchanges, and the
metrics say which. Resuming mid-run is in test_training's resume job.
"""

from __future__ import annotations

import pytest
import torch
from conftest import metrics_rows, train_runs

from psgrad.comm.protocol import Layer
from psgrad.config import RunConfig
from psgrad.engine.local import exchange_of, exchanges_after, exchanges_done, fragment_of

BASE = ["--model", "mlp", "--dataset", "synthetic", "--steps", "12", "--lr", "0.05", "--no-progress"]
ONE_STEP_IS_A_STEP = ["--local-steps", "1", "--outer-optimizer", "sgd", "--outer-lr", "1", "--outer-momentum", "0"]


@pytest.mark.parametrize("topology, ranks", [("ps", 3), ("colocated", 2)])
def test_one_local_step_with_outer_sgd_at_lr_one_is_the_synchronous_step(tmp_path, topology, ranks):
    """H = 1: the change theta_sync - theta of one SGD step is lr times the gradient; its average, applied at outer lr 1, is the per-step run's update. A lossy
    codec with error feedback codes the change as it codes the gradient (a deterministic one: the
    change is lr times the gradient only to float rounding, which would move a random codec's
    draws)."""
    # no weight decay: the workers' SGD puts it into the change, which the codec then codes, where
    # the per-step run's servers add it after decoding (equal only for an exact codec)
    base = [*BASE, "--topology", topology, "--momentum", "0", "--weight-decay", "0"]
    runs = {}
    for codec in (["--codec", "none"], ["--codec", "topk:ratio=0.1", "--feedback", "ef"]):
        runs[f"step-{codec[1]}"] = [*base, *codec]
        runs[f"local-{codec[1]}"] = [*base, *codec, *ONE_STEP_IS_A_STEP]
    out = train_runs(tmp_path, runs, n=ranks, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for codec in ("none", "topk:ratio=0.1"):
        ours = torch.load(tmp_path / f"local-{codec}" / "model.pt", weights_only=True)
        theirs = torch.load(tmp_path / f"step-{codec}" / "model.pt", weights_only=True)
        assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) < 1e-5, codec
        rows = metrics_rows(tmp_path / f"local-{codec}")
        assert all(row["outer"] == "1" for row in rows), rows[0]


def test_only_every_hth_step_and_the_last_exchange(tmp_path):
    """H = 4 over 10 steps: steps 3 and 7 and the last (9) exchange, and only they send; the
    workers learn on their own in between."""
    runs = {"local": [*BASE, "--steps", "10", "--local-steps", "4", "--codec", "qsgd:levels=16", "--feedback", "ef"]}
    out = train_runs(tmp_path, runs, n=3, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics_rows(tmp_path / "local")
    outer = [int(row["step"]) for row in rows if row["outer"] == "1"]
    sending = [int(row["step"]) for row in rows if int(row["bytes_up"]) > 0]
    assert outer == sending == [3, 7, 9], rows
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"]), [row["loss"] for row in rows]
    assert "test accuracy" in out.stderr


def test_an_overlapped_exchange_moves_by_the_servers_result_minus_the_workers_own(tmp_path):
    """One worker, outer SGD at lr 1 and no momentum: the servers' result is the worker's own
    parameters, so taking it late moves them by nothing, and the run is plain local SGD, as the
    exchange that waits is (to rounding: theta_sync - (theta_sync - theta)). A reply applied
    without the worker's progress since, or onto the wrong base, would differ at once."""
    base = [*BASE, "--topology", "ps", "--momentum", "0", "--local-steps", "4", *ONE_STEP_IS_A_STEP[2:]]
    runs = {"waits": base, "overlaps": [*base, "--overlap-exchange"], "per-step": [*BASE, "--momentum", "0"]}
    out = train_runs(tmp_path, runs, n=2, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    models = {name: torch.load(tmp_path / name / "model.pt", weights_only=True) for name in runs}
    for name in ("overlaps", "per-step"):
        assert max(float((models[name][k] - models["waits"][k]).abs().max()) for k in models[name]) < 1e-5, name
    two_workers = {
        "overlap2": [*BASE, "--local-steps", "4", "--overlap-exchange"],
        "wait2": [*BASE, "--local-steps", "4"],
    }
    out = train_runs(tmp_path, two_workers, n=3, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics_rows(tmp_path / "overlap2")
    assert [int(row["step"]) for row in rows if row["outer"] == "1"] == [3, 7, 11]
    ours = torch.load(tmp_path / "overlap2" / "model.pt", weights_only=True)
    theirs = torch.load(tmp_path / "wait2" / "model.pt", weights_only=True)
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) > 1e-4  # two workers: late is not the same


def test_overlap_steps_take_the_reply_that_many_steps_after_the_exchange(tmp_path):
    """H = 4 over 12 steps, exchanges after steps 3, 7 and 11: the reply of each overlapped one
    arrives (bytes down) in the step tau after it, 4 and 8 at tau = 1, 7 and 11 at tau = H (the
    default: the next exchange), and only the initial pull in step 0 besides. tau = H is the
    default run to the bit; tau = 1 trains differently, the workers starting from the servers'
    result three steps sooner."""
    base = [*BASE, "--local-steps", "4", "--overlap-exchange"]
    runs = {"default": base, "by-4": [*base, "--overlap-steps", "4"], "by-1": [*base, "--overlap-steps", "1"]}
    out = train_runs(tmp_path, runs, n=3, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for name, replies in (("default", [0, 7, 11]), ("by-4", [0, 7, 11]), ("by-1", [0, 4, 8])):
        rows = metrics_rows(tmp_path / name)
        assert [int(row["step"]) for row in rows if int(row["bytes_down"]) > 0] == replies, name
        assert [int(row["step"]) for row in rows if row["outer"] == "1"] == [3, 7, 11], name
    models = {name: torch.load(tmp_path / name / "model.pt", weights_only=True) for name in runs}
    assert all(torch.equal(models["default"][k], models["by-4"][k]) for k in models["default"])
    assert max(float((models["by-1"][k] - models["default"][k]).abs().max()) for k in models["default"]) > 1e-4


def test_with_one_worker_an_overlapped_exchange_changes_nothing_under_outer_momentum(tmp_path):
    """One worker, DiLoCo's outer Nesterov (lr 0.7, momentum 0.9): the worker's replica of the
    outer optimizer, fed its own delta, lands where the servers do, so the overlapped run equals
    the one that waits, to rounding, whether the reply is taken at the next exchange or two
    steps after its own. Also with PowerSGD at an exact rank, whose reply is an
    update: applied to the worker's end point instead of theta_sync, it would count the worker's
    own steps twice; without the replica, the steps would start an outer momentum step behind."""
    base = [*BASE, "--topology", "ps", "--momentum", "0", "--local-steps", "4", "--outer-momentum", "0.9"]
    exact = ["--codec", "powersgd:rank=64,min_rate=0"]
    runs = {
        "waits": base,
        "overlaps": [*base, "--overlap-exchange"],
        "powersgd-waits": [*base, *exact],
        "powersgd-overlaps": [*base, *exact, "--overlap-exchange"],
        "overlaps-by-2": [*base, "--overlap-exchange", "--overlap-steps", "2"],
    }
    out = train_runs(tmp_path, runs, n=2, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    models = {name: torch.load(tmp_path / name / "model.pt", weights_only=True) for name in runs}
    pairs = (
        ("overlaps", "waits", 1e-5),
        ("overlaps-by-2", "waits", 1e-5),
        ("powersgd-overlaps", "powersgd-waits", 1e-4),
    )
    for ours, theirs, tolerance in pairs:
        gap = max(float((models[ours][k] - models[theirs][k]).abs().max()) for k in models[ours])
        assert gap < tolerance, (ours, gap)
    moved = max(float((models["waits"][k] - models["powersgd-waits"][k]).abs().max()) for k in models["waits"])
    assert moved < 1e-3  # the exact rank is exact: PowerSGD runs the dense run's course


def test_exchanges_are_counted_on_the_wire_not_batches():
    cfg = RunConfig(local_steps=4)
    assert [exchange_of(cfg, s) for s in (0, 3, 4, 9)] == [0, 0, 1, 2]
    assert [s for s in range(10) if exchanges_after(cfg, s, 10)] == [3, 7, 9]
    assert [exchanges_done(cfg, s, 10) for s in (0, 3, 4, 8, 9)] == [-1, 0, 0, 1, 2]
    plain = RunConfig()
    assert exchange_of(plain, 7) == 7 and exchanges_after(plain, 7, 10) and exchanges_done(plain, 7, 10) == 7


def test_fragments_take_turns_and_each_counts_its_own_exchanges():
    """H = 4, F = 2 over 12 steps: fragment 0 exchanges after steps 1, 5, 9, fragment 1 after 3
    and 7, both after the last; the wire counts each fragment's exchanges."""
    cfg = RunConfig(local_steps=4, fragments=2)
    turns = {f: [s for s in range(12) if exchanges_after(cfg, s, 12, fragment=f)] for f in (0, 1)}
    assert turns == {0: [1, 5, 9, 11], 1: [3, 7, 11]}
    assert [s for s in range(12) if exchanges_after(cfg, s, 12)] == [1, 3, 5, 7, 9, 11]
    assert [exchange_of(cfg, s, fragment=0) for s in (0, 1, 2, 5, 6, 10)] == [0, 0, 1, 1, 2, 3]
    assert [exchange_of(cfg, s, fragment=1) for s in (0, 3, 4, 7, 8)] == [0, 0, 1, 1, 2]
    assert [exchanges_done(cfg, s, 12, fragment=1) for s in (2, 3, 4, 7, 11)] == [-1, 0, 0, 1, 2]
    assert [exchanges_done(cfg, s, 12, fragment=0) for s in (0, 1, 4, 11)] == [-1, 0, 0, 3]


def test_fragments_are_runs_of_consecutive_layers_of_about_equal_size():
    sizes = [10, 20, 5, 30, 15, 10, 10]  # middles at 5, 20, 32.5 | 50 | 72.5, 85, 95
    layers = [Layer(i, f"l{i}", (n,), (f"l{i}.w",), 0) for i, n in enumerate(sizes)]
    plan = fragment_of(layers, 3)
    assert list(plan.values()) == sorted(plan.values()) == [0, 0, 0, 1, 2, 2, 2]
    assert fragment_of(layers, 1) == dict.fromkeys(range(7), 0)


def _gap(models: dict, ours: str, theirs: str) -> float:
    return max(float((models[ours][k] - models[theirs][k]).abs().max()) for k in models[ours])


def test_fragments_with_one_worker_run_plain_local_sgd(tmp_path):
    """One worker, outer SGD at lr 1: whatever fragment exchanges when, waiting or overlapped,
    the servers' result is the worker's own parameters and the run is plain SGD. A fragment's
    reply taken onto the wrong layers, counted twice, or a checkpoint's theta lost would move
    it. With two workers the staggered exchanges do train differently from the whole model's."""
    base = [*BASE, "--topology", "ps", "--momentum", "0", "--local-steps", "4", *ONE_STEP_IS_A_STEP[2:]]
    base += ["--checkpoint-every-steps", "4"]  # the checkpoint takes the replies in flight
    runs = {
        "per-step": [*BASE, "--momentum", "0"],
        "fragments": [*base, "--fragments", "2"],
        "fragments-overlap": [*base, "--fragments", "4", "--overlap-exchange"],
        "fragments-overlap-by-1": [*base, "--fragments", "2", "--overlap-exchange", "--overlap-steps", "1"],
    }
    out = train_runs(tmp_path, runs, n=2, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    models = {name: torch.load(tmp_path / name / "model.pt", weights_only=True) for name in runs}
    for name in runs:
        assert _gap(models, name, "per-step") < 1e-5, name
    two = {"whole": [*BASE, "--local-steps", "4"], "halves": [*BASE, "--local-steps", "4", "--fragments", "2"]}
    out = train_runs(tmp_path, two, n=3, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    models = {name: torch.load(tmp_path / name / "model.pt", weights_only=True) for name in two}
    assert _gap(models, "halves", "whole") > 1e-4


def test_a_fragment_moves_its_share_of_the_bytes(tmp_path):
    """WRN-10-1, H = 4, two workers: the whole model's exchange after step 3 against two
    fragments taking turns after steps 1 and 3 (overlapped, replies taken 2 steps later): each
    turn sends about half the bytes, together the whole, and each reply arrives 2 steps late."""
    wrn = ["--model", "wrn", "--depth", "10", "--widen-factor", "1", "--batch-size", "8", "--synthetic-size", "64"]
    base = [*BASE, *wrn, "--steps", "8", "--local-steps", "4", "--codec", "qsgd:levels=16", "--feedback", "ef"]
    overlap = ["--overlap-exchange", "--overlap-steps", "2"]
    runs = {"whole": [*base, *overlap], "halves": [*base, *overlap, "--fragments", "2"]}
    out = train_runs(tmp_path, runs, n=3, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    up = {name: {int(r["step"]): int(r["bytes_up"]) for r in metrics_rows(tmp_path / name)} for name in runs}
    assert [s for s, b in up["halves"].items() if b] == [1, 3, 5, 7]
    assert [s for s, b in up["whole"].items() if b] == [3, 7]
    for turn in (1, 3):
        assert 0.3 < up["halves"][turn] / up["whole"][3] < 0.7, up
    assert abs(up["halves"][1] + up["halves"][3] - up["whole"][3]) < 0.02 * up["whole"][3], up
    down = [int(r["step"]) for r in metrics_rows(tmp_path / "halves") if int(r["bytes_down"]) > 0]
    assert down == [0, 3, 5, 7], down


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"topology": "alltoall"}, "needs servers to apply the outer optimizer"),
        ({"mode": "async"}, "--mode sync"),
        ({"feedback": "dgc"}, "use ef or none"),
        ({"amp": "fp16", "on_nonfinite": "skip"}, "use --amp bf16"),
        ({"checkpoint_every_steps": 6}, "must be a multiple of --local-steps 4"),
        ({"outer_momentum": 0.0}, "needs --outer-momentum > 0"),
        ({"optimizer": "adam"}, "--optimizer has no part"),
        ({"overlap_exchange": True, "overlap_steps": 5}, "at most --local-steps 4 steps later"),
        ({"fragments": 3}, "must divide --local-steps 4"),
        ({"fragments": 2, "codec": "powersgd:rank=2", "feedback": "none"}, "use a one-round codec"),
    ],
)
def test_settings_that_cannot_take_local_steps_say_why(settings, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(local_steps=4, **settings).validate()


def test_the_servers_apply_the_outer_optimizer_and_the_workers_their_own():
    from psgrad.engine.local import inner_optimizer
    from psgrad.optim import LayerOptimizer, update_lr

    cfg = RunConfig(local_steps=4, outer_lr=0.5, outer_momentum=0.8, inner_optimizer="adamw", weight_decay=0.01)
    outer = LayerOptimizer.from_config(cfg)
    assert (outer.kind, outer.momentum, outer.nesterov, outer.weight_decay) == ("sgd", 0.8, True, 0.0)
    assert update_lr(cfg, step=100, steps_per_epoch=10, workers=2) == 0.5  # constant, whatever the schedule
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert isinstance(inner_optimizer(cfg, params), torch.optim.AdamW)
    assert isinstance(inner_optimizer(cfg, params, lambda p: torch.optim.Adagrad(p)), torch.optim.Adagrad)


def test_your_loops_coded_mean_change_is_said_to_be_unmeasured():
    """Your loop's local steps code the mean change where psgrad train codes the outer update:
    psgrad's accuracy figures are of the latter, and the start-up note must not borrow them."""
    from psgrad.userloop.local import coded_change_note

    assert coded_change_note(RunConfig(local_steps=32, codec="qsgd:levels=16", feedback="ef")) is None
    assert coded_change_note(RunConfig(codec="qsgd:levels=16", down_codec="qsgd:levels=64")) is None
    note = coded_change_note(
        RunConfig(local_steps=32, codec="qsgd:levels=16", feedback="ef", down_codec="qsgd:levels=64")
    )
    assert note is not None and "only that was measured for accuracy" in note and "down_codec='none'" in note
