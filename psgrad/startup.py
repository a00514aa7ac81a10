"""Every rank's start, before anything is built: the settings are valid, the run's rank layout,
and what could stop this rank, agreed on by every rank (``psgrad.agreement``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .agreement import AgreementError, agree

if TYPE_CHECKING:  # the interface loads numpy: not for --help
    from .comm.channel import Channel
    from .comm.layout import RankLayout
    from .config import RunConfig

__all__ = ["AgreementError", "prepare"]  # a failed prepare raises AgreementError: callers catch it from here


def prepare(cfg: RunConfig, *, transport: Channel) -> RankLayout:
    """Every rank's start, before anything is built (collective): return this rank's layout.

    1. The settings are valid (``validate`` raises ValueError naming the bad one, on every rank).
    2. The layout of the run's topology on ``transport.size`` ranks.
    3. What stops this rank: rank 0's log dir and TensorBoard writer, a worker's device.
    4. ``agree``: no rank has such a problem, and every rank runs rank 0's settings.
    5. With --overwrite, rank 0 clears the log dir before any rank can write into it (the next
       collective comes after this).
    """
    from . import checkpoint  # torch and the rest: not for --help
    from .devices import device_problem
    from .metrics import tensorboard_problem
    from .roles import topology_of

    cfg.validate()
    layout = topology_of(cfg.topology).rank_layout(world=transport.size, servers=cfg.servers)
    problem = None
    if transport.rank == 0:
        problem = checkpoint.log_dir_problem(cfg.log_dir, resume=cfg.resume, overwrite=cfg.overwrite)
        problem = problem or (tensorboard_problem() if cfg.tensorboard else None)
    if problem is None and layout.is_worker(transport.rank):
        problem = device_problem(cfg.device)
    agree(transport, cfg, problem)
    if cfg.overwrite and cfg.log_dir and not cfg.resume and transport.rank == 0:
        checkpoint.clear_run(cfg.log_dir)
    return layout
