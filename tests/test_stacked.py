"""psgrad.stacked: N models computed as one grouped model give each model its own loss, gradient
and BatchNorm statistics, share their parameters with it, and refuse what would mix them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import run_local_ranks
from torch import nn

from psgrad.models import build_model
from psgrad.sim import stacked as stacked_module
from psgrad.sim import stacked_layers
from psgrad.sim.local import Meeting
from psgrad.sim.stacked import StackedPass, StackError, stack_inputs
from psgrad.sim.world import LocalWorld, OtherRankFailed

N, B = 3, 4


def _models(name: str, n: int = N) -> list[nn.Module]:
    """``n`` models in float64 (where the stacked and the plain pass agree to 1e-12), dropout off
    (its masks are drawn per pass, so they differ between the two anyway)."""
    torch.manual_seed(0)
    options = {"depth": 10, "widen_factor": 1} if name == "wrn" else {}
    models = [build_model(name, 10, **options).double() for _ in range(n)]
    for module in (m for model in models for m in model.modules()):
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return models


def _batches(n: int = N) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(1)
    return [torch.randn(B, 3, 32, 32, dtype=torch.float64) for _ in range(n)], [
        torch.randint(0, 10, (B,)) for _ in range(n)
    ]


@pytest.mark.parametrize("same_weights", [False, True], ids=["own-weights", "same-weights"])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("name", ["wrn", "convnet", "mlp", "resnet9", "alexnet"])
def test_every_model_gets_its_own_loss_gradient_and_batchnorm_statistics(name, layout, same_weights, monkeypatch):
    """Each way a stacked convolution computes: grouped, or (the same weights everywhere,
    channels-last) one plain convolution over the workers side by side: a wide 2-D one for
    stride 1, a 3-D one for the strided layers (WRN-10-1's, AlexNet's first)."""
    models = [copy.deepcopy(_models(name)[0]) for _ in range(N)] if same_weights else _models(name)
    alone = copy.deepcopy(models)
    images, labels = _batches()
    images = [x.contiguous(memory_format=layout) for x in images]
    for model in [*models, *alone]:
        model.train()
    shared = []
    apply = stacked_layers.SharedWeights.apply
    monkeypatch.setattr(stacked_layers.SharedWeights, "apply", lambda *args: shared.append(1) or apply(*args))
    losses = StackedPass(models).run(images, labels, F.cross_entropy)
    convolutions = [m for m in models[0].modules() if isinstance(m, nn.Conv2d)]
    # the check pass (eval) and the training pass each run the shared ones
    assert len(shared) == (2 * len(convolutions) if same_weights and layout == torch.channels_last else 0)
    if name in ("wrn", "alexnet"):
        assert any(m.stride != (1, 1) for m in convolutions)
    for i, model in enumerate(alone):
        loss = F.cross_entropy(model(images[i]), labels[i])
        loss.backward()
        assert losses[i] == pytest.approx(loss.item(), rel=1e-12)
        for (key, mine), theirs in zip(models[i].named_parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-9, atol=1e-12, msg=key)
        for (key, mine), theirs in zip(models[i].named_buffers(), model.buffers(), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-12, msg=key)  # running stats, counts


def test_the_models_and_the_stacked_model_share_their_parameters():
    models = _models("wrn")
    stacked = StackedPass(models)
    per_model = stacked.stacked.conv1.weight.view(N, *models[0].conv1.weight.shape)
    before = per_model.clone()
    with torch.no_grad():
        models[1].conv1.weight.add_(1.0)  # a pull or an optimizer step on worker 1
        stacked.stacked.blocks[0].bn1.running_mean.view(N, -1)[2].fill_(7.0)
    assert torch.equal(per_model[1], before[1] + 1.0)
    assert torch.equal(per_model[0], before[0]) and torch.equal(per_model[2], before[2])
    assert torch.equal(models[2].blocks[0].bn1.running_mean, torch.full_like(models[2].blocks[0].bn1.running_mean, 7.0))
    images, labels = _batches()
    stacked.run(images, labels, F.cross_entropy)
    grad = stacked.stacked.fc.weight.grad
    assert models[2].fc.weight.grad.data_ptr() == grad[2].data_ptr()  # a view, not a copy


def test_the_shared_convolutions_let_autograd_add_gradients_in_place():
    """A strided block's activation gets two input gradients (shortcut and 3x3), both from shared
    convolutions: autograd adds the second in place, as in one model's own pass. An output that
    kept a second reference to its memory made it add out of place (an 8 MB copy a block)."""
    models = [copy.deepcopy(_models("wrn")[0]) for _ in range(N)]
    images, labels = _batches()
    images = [x.contiguous(memory_format=torch.channels_last) for x in images]
    stacked = StackedPass(models)
    stacked.run(images, labels, F.cross_entropy)  # the first pass also checks the outputs
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        stacked.run(images, labels, F.cross_entropy)
    image_adds = [
        e.name for e in profile.events() if e.name in ("aten::add", "aten::add_") and len(e.input_shapes[0]) == 4
    ]
    residual_additions = 3  # WRN-10-1's blocks, in the forward
    assert image_adds.count("aten::add") == residual_additions
    assert image_adds.count("aten::add_") == 3  # the stem's output and the two strided blocks' activations


def test_the_stacked_inputs_put_each_models_channels_in_its_place():
    parts = [torch.full((2, 3, 4, 4), float(i)) for i in range(N)]
    stacked = stack_inputs(parts)
    assert stacked.shape == (2, 3 * N, 4, 4)
    assert [stacked[:, 3 * i : 3 * i + 3].unique().item() for i in range(N)] == [0.0, 1.0, 2.0]
    assert stacked.is_contiguous()
    last = stack_inputs([part.contiguous(memory_format=torch.channels_last) for part in parts])
    assert torch.equal(last, stacked) and not last.is_contiguous()
    assert last.is_contiguous(memory_format=torch.channels_last)  # the workers' layout is kept


def test_a_model_whose_forward_mixes_the_workers_channels_is_refused():
    models = _models("resnet20")  # its shortcut pads the channel dimension
    with pytest.raises(StackError, match="ResNet20"):
        StackedPass(models).run(*_batches(), F.cross_entropy)


def test_a_layer_it_cannot_stack_is_refused_by_name():
    models = [nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 8), nn.LayerNorm(8)) for _ in range(N)]
    with pytest.raises(StackError, match="'2' .LayerNorm."):
        StackedPass(models)


def test_batches_of_different_shapes_are_refused():
    images, labels = _batches()
    images[1] = images[1][:2]
    with pytest.raises(StackError, match="differ in shape"):
        StackedPass(_models("convnet")).run(images, labels, F.cross_entropy)


def test_groups_side_by_side_give_every_worker_its_own_gradient_and_a_failed_group_leaves_none():
    """Four workers in two stacked groups run at once: each worker's gradient is its own pass's.
    When one group cannot stack its batches, the other has already set its gradients: every
    worker must be left without one, to compute its own."""
    from types import SimpleNamespace

    models = _models("convnet", 4)
    own = copy.deepcopy(models)
    images, labels = _batches(4)
    workers = stacked_module.StackedWorkers(SimpleNamespace(members=4), groups=2)
    threads = torch.get_num_threads()  # a pass sets torch's (process-wide) threads
    try:
        for rank, model in enumerate(models):
            workers.member(rank).join(model, F.cross_entropy)
        parts = {rank: (images[rank], labels[rank]) for rank in range(4)}
        losses, _ = workers._compute(parts, threads=2)
        for rank, model in enumerate(own):
            loss = F.cross_entropy(model(images[rank]), labels[rank])
            loss.backward()
            assert losses[rank] == pytest.approx(float(loss.detach()), rel=1e-12)
            for mine, theirs in zip(models[rank].parameters(), model.parameters(), strict=True):
                torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-9, atol=1e-12)
        parts[3] = (images[3][:2], labels[3][:2])  # the second group's batches now differ in shape
        assert workers._compute(parts, threads=2) is None
        assert all(param.grad is None for model in models for param in model.parameters())
    finally:
        workers.close("the test ended")
        torch.set_num_threads(threads)


def test_a_pass_nobody_will_run_stops_its_rank_once_the_simulation_is_closed():
    """After Ctrl-C the serving thread no longer runs passes: a rank that hands one in, before
    or after ``close``, stops as from another rank's failure instead of waiting for ever."""
    import threading

    workers = stacked_module.StackedWorkers(Meeting(LocalWorld(2, 30.0), 2))
    outcomes: list = []

    def hand_in() -> None:
        try:
            outcomes.append(workers._pass({}))
        except OtherRankFailed as err:
            outcomes.append(err)

    before = threading.Thread(target=hand_in)
    before.start()
    while workers.passes.empty():
        before.join(0.01)
    workers.close("interrupted")
    after = threading.Thread(target=hand_in)
    after.start()
    for thread in (before, after):
        thread.join(5.0)
        assert not thread.is_alive()
    assert [str(err) for err in outcomes] == ["stopping: interrupted"] * 2, outcomes


def test_ctrl_c_during_a_pass_stops_its_rank_quietly_and_goes_on_up(monkeypatch):
    """Ctrl-C lands in the serving thread, most often in a stacked pass: the serving thread raises
    it (the simulation stops) and the rank that handed the pass in stops as from another rank's
    failure, with nothing to report (not a KeyboardInterrupt of its own, printed with a traceback)."""
    from concurrent.futures import Future

    workers = stacked_module.StackedWorkers(Meeting(LocalWorld(2, 30.0), 2))

    def interrupted(parts, threads):
        raise KeyboardInterrupt

    monkeypatch.setattr(workers, "_compute", interrupted)
    done: Future = Future()
    workers.passes.put((done, {}, 1))
    with pytest.raises(KeyboardInterrupt):
        workers.serve(1.0)
    err = done.exception(timeout=0)
    assert isinstance(err, OtherRankFailed) and err.reported_elsewhere, err


# ---------------------------------------------------------------------- the meeting
def _meet(size: int, body) -> list:
    world = LocalWorld(size, 30.0)
    meeting = Meeting(world, size)
    return run_local_ranks(world, lambda rank: body(world, meeting, rank))


def test_the_last_rank_to_come_acts_for_all_and_every_rank_gets_the_result():
    acted_by = []

    def body(world, meeting, rank):
        results = []
        for round_ in range(3):
            world.enter(rank)
            try:
                results.append(
                    meeting.meet(rank, (round_, rank), lambda parts: (acted_by.append(1), sorted(parts.values()))[1])
                )
            finally:
                world.leave(rank)
        return results

    out = _meet(3, body)
    assert len(acted_by) == 3  # once a round
    for results in out:
        assert results == [[(r, 0), (r, 1), (r, 2)] for r in range(3)]


def test_a_rank_that_fails_before_the_meeting_stops_the_others():
    def body(world, meeting, rank):
        if rank == 2:
            raise RuntimeError("no batch")
        return meeting.meet(rank, rank, lambda parts: parts)

    out = _meet(3, body)
    assert isinstance(out[2], RuntimeError)
    assert all(isinstance(err, OtherRankFailed) for err in out[:2])


def test_workers_whose_stacked_parameters_and_gradients_would_not_fit_are_not_stacked(monkeypatch):
    """Stacking copies every model's parameters and buffers side by side and then makes their
    gradients, in one go on the serving thread, where running out of memory would end the process
    without a word: it is refused (the workers then compute one pass each) when that would leave
    less than the floor."""
    import psgrad.memory

    models = [nn.Linear(1000, 1000) for _ in range(4)]  # 4 x 1,001,000 parameters
    needed = 4 * 1_001_000 * 4 * 2
    total = 100 << 30
    monkeypatch.setattr(psgrad.memory, "available_memory", lambda: (needed + int(0.03 * total) + 1, total))
    stacked_module.StackedWorkers._check_room(models)  # just fits
    monkeypatch.setattr(psgrad.memory, "available_memory", lambda: (needed + int(0.03 * total) - 1, total))
    with pytest.raises(StackError, match="stacking 4 workers needs 0.0 GiB for their parameters and gradients"):
        stacked_module.StackedWorkers._check_room(models)
