"""Local steps in your loop (``psgrad.init(local_steps=H)``, DiLoCo): your optimizer steps on this
worker's own gradient, and every H-th ``step()`` the workers average how far they moved.

Per ``step()`` of a worker:
1. Your optimizer steps on this worker's gradient; nothing is sent (backward pushes nothing).
2. Every H-th step, after 1: each layer's pseudo-gradient delta = theta_sync - theta goes into
   ``.grad`` and through the exchange your per-step loop uses for gradients (feedback, codec, the
   layer's server), which replies with the workers' mean delta, exact or ``down_codec``-coded;
   your backward's gradient goes back into ``.grad`` after step 3.
3. Every worker applies the outer optimizer (``outer_optimizer``, ``outer_lr``,
   ``outer_momentum``: ``engine.local``'s) to theta_sync with that mean, the same update on the
   same values on every worker, and every worker's parameters become the new theta_sync.
On the wire an exchange is numbered k, as in ``psgrad train``: the servers count exchanges.
Where ``psgrad train``'s servers apply the outer optimizer and reply with the values, here they
reply with the mean change and each worker applies it: the same sum, the same update (tested
equal to ``psgrad train --local-steps`` step for step with an exact down-link), and your loop
needs no model on a server. A ``down_codec`` codes that mean change (inside the servers' error
feedback) where ``psgrad train`` codes the outer update, as INTELLECT-1 quantized the averaged
pseudo-gradient: psgrad measured the accuracy of its own variant only, and says so at start-up.
"""

from __future__ import annotations

import torch

from ..comm.protocol import Layer, copy_flat_into, flat_parts
from ..config import RunConfig
from ..optim import LayerOptimizer


def coded_change_note(cfg: RunConfig) -> str | None:
    """The start-up note of local steps with a coded down-link in your loop (None otherwise):
    psgrad's accuracy figures are of ``psgrad train``'s coded update, not of this coded change."""
    if not cfg.local_steps or cfg.down_codec == "none":
        return None
    return (
        "note: with local_steps your loop's down_codec codes the workers' mean change, and each worker takes "
        "the outer step on it; psgrad train codes the outer update instead, and only that was measured for "
        "accuracy (docs/benchmarks.md, \"Slow links\"): compare a run with down_codec='none' before relying on it"
    )


class OuterSteps:
    """theta_sync and the outer optimizer of one worker of your loop (see the module docstring)."""

    def __init__(self, cfg: RunConfig, params: dict[str, torch.Tensor], layers: list[Layer]) -> None:
        self.every, self.outer_lr = cfg.local_steps, cfg.outer_lr
        self.params, self.layers = params, layers
        self.outer = LayerOptimizer.from_config(cfg)
        self.inner_steps = 0  # steps since the last exchange
        self.means: dict[int, torch.Tensor] = {}  # the exchange's replies: each layer's mean change
        self.held: dict[str, torch.Tensor | None] = {}  # your gradients, while delta is in .grad
        self.synced = self._flat()  # theta_sync, per layer: every worker starts from the first's values

    def _flat(self) -> dict[int, torch.Tensor]:
        with torch.no_grad():
            return {
                layer.index: torch.cat([self.params[name].detach().reshape(-1) for name in layer.params])
                for layer in self.layers
            }

    def exchanges_now(self) -> bool:
        """Count the step taken; whether it is the H-th since the last exchange."""
        self.inner_steps += 1
        return self.inner_steps == self.every

    def changes_into_grad(self) -> None:
        """Step 2: delta = theta_sync - theta of every parameter into its ``.grad``; the gradient
        your backward left there comes back with the outer step (``outer_step``)."""
        self.held = {name: param.grad for name, param in self.params.items()}
        with torch.no_grad():
            for layer in self.layers:
                params = [self.params[name] for name in layer.params]
                for param, synced in zip(params, flat_parts(self.synced[layer.index], params), strict=True):
                    param.grad = (synced - param.detach()).to(param.dtype)

    def take_mean(self, layer: Layer, flat: torch.Tensor | None) -> None:
        """A layer's mean change; None where a worker's was not finite and ``on_nonfinite`` is
        ``skip``: that layer then takes no outer step, as a server skips its update."""
        self.means[layer.index] = None if flat is None else flat.clone()

    def outer_step(self) -> None:
        """Step 3, once every layer's mean change is in: theta_sync moves, the parameters follow."""
        with torch.no_grad():
            for layer in self.layers:
                point, mean = self.synced[layer.index], self.means.pop(layer.index)
                if mean is not None:
                    self.outer.step(layer.name, point, mean, self.outer_lr)
                copy_flat_into(self.params, layer.params, point)
        for name, grad in self.held.items():  # a gradient-norm log after step() sees your gradient, not delta
            self.params[name].grad = grad
        self.held = {}
        self.inner_steps = 0

    def state_dict(self) -> dict:
        return {
            "inner_steps": self.inner_steps,
            "synced": {layer.name: self.synced[layer.index].clone() for layer in self.layers},
            "outer": self.outer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.inner_steps = int(state["inner_steps"])
        self.synced = {layer.index: state["synced"][layer.name].clone() for layer in self.layers}
        self.outer.load_state_dict(state["outer"])
