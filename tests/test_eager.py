"""The provisional outer step of an overlapped exchange: psgrad.engine.eager against the servers'
own outer optimizer (psgrad.optim.LayerOptimizer), on flat tensors."""

from __future__ import annotations

import pytest
import torch

from psgrad.config import RunConfig
from psgrad.engine.eager import EagerOuterStep
from psgrad.optim import LayerOptimizer

OUTER = {  # name: the outer optimizer's settings
    "nesterov": dict(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.5),
    "heavy-ball": dict(outer_optimizer="sgd", outer_lr=0.7, outer_momentum=0.9),
    "plain": dict(outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0),
}


@pytest.mark.parametrize("name", OUTER)
def test_the_replies_give_back_the_servers_average_and_momentum(name):
    """Four exchanges of two workers: after each reply the replica holds the average the servers
    stepped with and their momentum buffer, so its next point is the servers' own step with the
    estimate (the last average plus half this worker's change since)."""
    cfg = RunConfig(local_steps=4, overlap_exchange=True, **OUTER[name])
    torch.manual_seed(0)
    servers, replica = LayerOptimizer.from_config(cfg), EagerOuterStep(cfg, workers=2)
    theta, last_mine, last_average = torch.randn(50), None, None
    for exchange in range(4):
        mine, theirs = torch.randn(50), torch.randn(50)
        estimate = mine if exchange == 0 else last_average + (mine - last_mine) / 2
        expected = theta.clone()
        _copy(servers).step("layer", expected, estimate, cfg.outer_lr)
        assert torch.allclose(replica.point("layer", theta, mine), expected, atol=1e-5), exchange
        reply, average = theta.clone(), (mine + theirs) / 2
        servers.step("layer", reply, average, cfg.outer_lr)
        replica.settle("layer", theta, reply)
        assert torch.allclose(replica.average["layer"], average, atol=1e-5), exchange
        if cfg.outer_momentum:
            assert torch.allclose(replica.buffer["layer"], servers.state["layer/momentum"], atol=1e-5)
        theta, last_mine, last_average = reply, mine, average


def _copy(servers: LayerOptimizer) -> LayerOptimizer:
    copy = LayerOptimizer("sgd", momentum=servers.momentum, nesterov=servers.nesterov)
    copy.load_state_dict(servers.state_dict())
    return copy


def test_this_workers_share_is_fresh_the_others_are_the_last_known():
    """Two workers, outer SGD at lr 1 without momentum (P = theta_sync - estimate): the second
    exchange's estimate is the last average plus half this worker's change since, not this
    worker's change alone, which would move P by the whole difference between the workers."""
    cfg = RunConfig(local_steps=4, overlap_exchange=True, **OUTER["plain"])
    replica = EagerOuterStep(cfg, workers=2)
    theta, mine, theirs = torch.zeros(3), torch.tensor([1.0, 0.0, 2.0]), torch.tensor([3.0, 0.0, 0.0])
    assert torch.equal(replica.point("w", theta, mine), -mine)  # the first exchange: own change
    reply = theta - (mine + theirs) / 2
    replica.settle("w", theta, reply)
    again = torch.tensor([1.0, 4.0, 2.0])
    assert torch.allclose(
        replica.point("w", reply, again), reply - (torch.tensor([2.0, 0.0, 1.0]) + (again - mine) / 2)
    )


def test_one_worker_lands_where_the_servers_do():
    cfg = RunConfig(local_steps=4, overlap_exchange=True, **OUTER["nesterov"])
    servers, replica = LayerOptimizer.from_config(cfg), EagerOuterStep(cfg, workers=1)
    theta = torch.zeros(8)
    for seed in range(5):
        change = torch.randn(8, generator=torch.Generator().manual_seed(seed))
        point = replica.point("w", theta, change)
        reply = theta.clone()
        servers.step("w", reply, change, cfg.outer_lr)
        assert torch.allclose(point, reply, atol=1e-5), seed
        replica.settle("w", theta, reply)
        theta = reply


def test_an_exchange_that_waits_moves_the_momentum_by_the_estimate_and_the_state_round_trips():
    cfg = RunConfig(local_steps=4, overlap_exchange=True, **OUTER["heavy-ball"])
    replica = EagerOuterStep(cfg, workers=2)
    change = torch.ones(4)
    replica.point("w", torch.zeros(4), change, waits=True)
    assert torch.equal(replica.buffer["w"], change)
    replica.point("w", torch.zeros(4), 2 * change)
    replica.settle("w", torch.zeros(4), torch.full((4,), -3.0))  # an average and a buffer the estimate did not hold
    copy = EagerOuterStep(cfg, workers=2)
    copy.load_state_dict(replica.state_dict())
    assert torch.equal(copy.point("w", torch.zeros(4), change), replica.point("w", torch.zeros(4), change))
