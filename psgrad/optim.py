"""Per-layer optimizers on flat tensors (the server's update) and learning-rate schedules.

The formulas are torch.optim's SGD (momentum, dampening 0, Nesterov, L2 weight decay) and Adam,
applied to one layer at a time, so the server can update each layer the moment it is complete;
``TorchLayerOptimizer`` applies any ``torch.optim.Optimizer`` the same way (``run(optimizer_fn=)``).
SGD runs torch's own fused kernel (``torch.optim.sgd.sgd(fused=True)``): one pass over the layer
instead of four, 1.2 ms against 4.5 ms for WRN-16-4's 2.7 M parameters on one CPU thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.sgd import sgd as torch_sgd

from .config import RunConfig


class LayerOptimizer:
    """``step(key, param, grad, lr)`` updates ``param`` in place; state is per key."""

    def __init__(
        self,
        kind: str = "sgd",
        *,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if kind not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be sgd or adam, got {kind!r}")
        if nesterov and momentum <= 0:
            raise ValueError("Nesterov momentum needs momentum > 0")
        self.kind, self.momentum, self.nesterov, self.weight_decay = kind, momentum, nesterov, weight_decay
        self.betas, self.eps = betas, eps
        self.state: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, cfg: RunConfig) -> LayerOptimizer:
        """The update of the ranks that update: ``--optimizer``, or with ``--local-steps`` the outer
        optimizer (SGD on the averaged parameter change, no weight decay: the workers' own
        optimizer applies it)."""
        if cfg.local_steps:
            nesterov = cfg.outer_optimizer == "nesterov"
            return cls("sgd", momentum=cfg.outer_momentum, nesterov=nesterov)
        return cls(cfg.optimizer, momentum=cfg.momentum, nesterov=cfg.sgd_nesterov, weight_decay=cfg.weight_decay)

    def step(self, key: str, param: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        """One update of ``param`` with ``grad``.

        SGD: 1. d = g + wd p. 2. b = d (first step) or m b + d. 3. d = d + m b (Nesterov) or b.
        4. p -= lr d.  Adam: m, v moments with bias correction, p -= lr m_hat / (sqrt(v_hat) + eps).
        """
        if self.kind == "sgd":
            buffers = [self.state.get(f"{key}/momentum")]
            torch_sgd(
                [param],
                [grad],
                buffers,
                fused=True,
                weight_decay=self.weight_decay,
                momentum=self.momentum,
                lr=lr,
                dampening=0.0,
                nesterov=self.nesterov,
                maximize=False,
            )
            if self.momentum > 0:
                self.state[f"{key}/momentum"] = buffers[0]
            return
        d = grad if self.weight_decay == 0 else grad.add(param, alpha=self.weight_decay)
        beta1, beta2 = self.betas
        m = self.state.setdefault(f"{key}/exp_avg", torch.zeros_like(param))
        v = self.state.setdefault(f"{key}/exp_avg_sq", torch.zeros_like(param))
        t = self.state.setdefault(f"{key}/step", torch.zeros((), dtype=torch.float64))
        t += 1
        m.mul_(beta1).add_(d, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(d, d, value=1 - beta2)
        bias1 = 1 - beta1 ** float(t)
        bias2 = 1 - beta2 ** float(t)
        denom = (v.sqrt() / math.sqrt(bias2)).add_(self.eps)
        param.addcdiv_(m, denom, value=-lr / bias1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.state = {k: v.clone() for k, v in state.items()}


OptimizerFn = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class TorchLayerOptimizer:
    """Any ``torch.optim.Optimizer``, one instance per layer: ``optimizer_fn([values])`` builds it
    the first time a layer is updated. The same ``step(key, param, grad, lr)`` as LayerOptimizer:

    1. The layer's flat values are the optimizer's one parameter. If the caller hands in another
       tensor for the layer (alltoall builds it anew each step), the optimizer's state moves over.
    2. ``param.grad = grad``, every param group's lr = psgrad's schedule, ``optimizer.step()``.
    """

    def __init__(self, optimizer_fn: OptimizerFn) -> None:
        self.optimizer_fn = optimizer_fn
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self._pending: dict[str, dict] = {}  # state loaded before the layer's first step

    def step(self, key: str, param: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        optimizer = self.optimizers.get(key)
        if optimizer is None:
            optimizer = self.optimizers[key] = self.optimizer_fn([param])
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer_fn must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
            if key in self._pending:
                optimizer.load_state_dict(self._pending.pop(key))
        group = optimizer.param_groups[0]
        old = group["params"][0]
        if old is not param:
            group["params"][0] = param
            if old in optimizer.state:
                optimizer.state[param] = optimizer.state.pop(old)
        for group in optimizer.param_groups:
            group["lr"] = lr
        param.grad = grad
        with torch.no_grad():
            optimizer.step()
        param.grad = None

    def state_dict(self) -> dict:
        return {**self._pending, **{key: opt.state_dict() for key, opt in self.optimizers.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.optimizers, self._pending = {}, dict(state)


def update_lr(cfg: RunConfig, step: int, steps_per_epoch: int, workers: int) -> float:
    """The LR of the update the servers apply after ``step``: the schedule's (``learning_rate``),
    or with ``--local-steps`` the outer optimizer's, ``--outer-lr``, constant."""
    return cfg.outer_lr if cfg.local_steps else learning_rate(cfg, step, steps_per_epoch, workers)


def learning_rate(cfg: RunConfig, step: int, steps_per_epoch: int, workers: int) -> float:
    """The LR at ``step`` (0-based).

    1. Base: ``lr``, times the number of workers with ``scale_lr``.
    2. Schedule by epoch e = step / steps_per_epoch: constant; multistep (x ``lr_decay`` at each
       passed milestone); cosine over the run.
    3. Linear warm-up over the first ``warmup_epochs``: from base / steps to base.
    """
    base = cfg.lr * (workers if cfg.scale_lr else 1)
    epoch = step / max(1, steps_per_epoch)
    if cfg.schedule == "multistep":
        base *= cfg.lr_decay ** sum(1 for m in cfg.lr_milestones if epoch >= m)
    elif cfg.schedule == "cosine":
        total = cfg.steps if cfg.steps is not None else cfg.epochs * steps_per_epoch
        base *= 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, total))))
    warmup_steps = cfg.warmup_epochs * steps_per_epoch
    if warmup_steps > 0 and step < warmup_steps:
        base *= (step + 1) / warmup_steps
    return base
