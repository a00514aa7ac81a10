"""Decentralized gossip (``--topology ring`` / ``torus``): CHOCO-SGD (Koloskova et al., ICML 2019).

No server and no all-to-all: every rank trains its shard and talks to its neighbours only — on a
ring rank i to i - 1 and i + 1 mod N (two ranks are each other's one neighbour); on an R x C torus
(``--grid RxC``, ranks row-major) the ranks above, below, left and right, wrapping around. Every rank keeps
public copies x_hat_j of itself and of its neighbours; every neighbour of j applies the same
messages of j, so all copies of x_hat_j agree. Per step, layer by layer in forward order:
1. local step: x_i = optimizer(x_i, g_i) with the run's optimizer and schedule — in the layer's
   gradient hook, so this and step 2 overlap the backward of the earlier layers;
2. q_i = C(x_i - x_hat_i) with the run's codec (seeded by step, layer and rank);
   x_hat_i += D(q_i); q_i goes to both neighbours (Isend; their q_j arrive into receives posted
   before backward);
3. x_hat_j += D(q_j) for each neighbour j;
4. x_i += gamma * sum_j w_ij (x_hat_j - x_hat_i) over the neighbours, gamma = ``--consensus-step``,
   w_ij = 1 / (neighbours + 1): uniform over the neighbourhood and self, which on a ring or a
   torus, where every degree is the same, is also the Metropolis-Hastings weight.
With codec ``none`` and gamma = 1 the copies are exact and step 4 is plain gossip averaging,
x_i = sum_j w_ij x_j (self included). A layer that is not compressed (the 1-D bucket) always
travels exact. Each link carries one message per layer and step, whatever N is.

Every ``--consensus-every-steps`` steps the metrics row also holds the consensus distance
(1/N) sum_i ||x_i - x_bar||^2 (one allreduce of the model). Evaluation scores the ranks' average
model x_bar (parameters and BatchNorm statistics averaged over ranks) on rank 0; the ranks'
own models train on.
"""

from __future__ import annotations

import time

import torch

from ..backprop import Backprop
from ..codecs import make_codec
from ..comm import wire
from ..comm.channel import Handle
from ..comm.envelope import Envelope, parse
from ..comm.protocol import (
    GradientGate,
    Layer,
    StepStats,
    copy_flat_into,
    flat_parts,
    layer_tag,
    layer_values,
    message_seed,
    skip_update,
    upload_bound,
)
from ..context import Role, RunContext
from ..optim import learning_rate
from .clock import StepClock
from .peers import PeerRows, load_replica_state, replica_state


class GossipRole(Role):
    name = "peer"

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.cfg, self.model, self.layers = ctx.cfg, ctx.model, ctx.layers
        self.world, self.rank, self.size = ctx.transport, ctx.rank, ctx.transport.size
        self.neighbours = ctx.topology.neighbours(self.rank, self.size, self.cfg)
        # uniform over the neighbourhood and self; every degree is the same on a ring or a torus,
        # so these are the Metropolis-Hastings weights too (and the mixing matrix is symmetric)
        self.weight = 1.0 / (len(self.neighbours) + 1)
        self.params_by_name = dict(self.model.named_parameters())
        self.backprop = Backprop(
            self.cfg, model=self.model, loss_fn=ctx.loss_fn, device=ctx.device, shared_pass=ctx.transport.shared_pass()
        )
        self.optimizer = ctx.make_optimizer()
        self.codec, self.exact = make_codec(self.cfg.codec), make_codec("none")
        self.feedback = ctx.make_feedback()
        self.bounds = [upload_bound(self.feedback, layer) for layer in self.layers]
        # x_hat of this rank and of each neighbour, per layer: every rank starts from the same model
        start = {layer.index: self._values(layer) for layer in self.layers}
        self.public = {(j, i): v.clone() for j in [self.rank, *self.neighbours] for i, v in start.items()}
        self.rows = PeerRows(ctx, self.world)
        self.doing = "starting"
        self.gate = GradientGate(self.layers)
        if self.cfg.granularity == "layer" and self.backprop.hooks_may_send:
            self.backprop.on_layer_gradients(self.params_by_name, self.gate, self._local_step_and_send)

    def _values(self, layer: Layer) -> torch.Tensor:
        return layer_values(self.params_by_name, layer).float().cpu()

    def _codec(self, layer: Layer):
        return self.codec if layer.compress else self.exact

    # ------------------------------------------------------------------ the step
    def train_step(self, step: int, images: torch.Tensor, labels: torch.Tensor) -> StepStats:
        """One step; steps 1 and 2 of a layer run in its gradient hook, while backward goes on
        with earlier layers (after backward for layers whose hook did not fire)."""
        s = self.stats = StepStats(step=step)
        self.lr = learning_rate(self.cfg, step, self.ctx.steps_per_epoch, self.size)
        self.sends: list[Handle] = []
        self.sent: set[int] = set()
        self.gate.reset()
        clock = StepClock()
        self.doing = f"step {step}: forward and backward"
        recvs: dict[tuple[int, int], Handle] = {}

        def post_receives() -> None:
            clock.mark("forward_done")
            for j in self.neighbours:
                for layer in self.layers:
                    recvs[(j, layer.index)] = self.world.irecv(
                        self.bounds[layer.index], j, layer_tag(layer.index), key=(j, layer.index)
                    )

        s.loss = self.backprop.run(images, labels, post_receives)
        self.backprop.finish(self.params_by_name)
        in_hooks = s.encode + s.apply
        clock.mark("backward_done")
        for layer in self.layers:
            if layer.index not in self.sent:
                self._local_step_and_send(layer)
        self.backprop.end_step(s.nonfinite > 0)
        clock.mark("exchange_started")
        self.doing = f"step {step}: waiting for the neighbours' messages"
        for (j, index), handle in recvs.items():
            handle.wait()
            s.bytes_down += handle.count
            decode_start = time.perf_counter()
            layer = self.layers[index]
            msg = parse(
                handle.payload(),
                sender=j,
                what=f"{layer.name!r} message",
                max_bytes=self.bounds[index],
                shape=layer.shape,
            )
            Envelope("grad", layer.name, step, j).check(msg)
            self._codec(layer).decode_add(msg, self.public[(j, index)])
            s.decode += time.perf_counter() - decode_start
        clock.mark("exchanged")
        with torch.no_grad():
            for layer in self.layers:  # 4. x_i += gamma sum_j w_ij (x_hat_j - x_hat_i)
                mine = self.public[(self.rank, layer.index)]
                pull = sum(self.public[(j, layer.index)] - mine for j in self.neighbours)
                if self.neighbours:
                    x = self._values(layer).add_(pull, alpha=self.cfg.consensus_step * self.weight)
                    copy_flat_into(self.params_by_name, layer.params, x)
        self.world.wait_all(self.sends)
        clock.mark("end")
        s.apply += clock.end - clock.exchanged
        return clock.fill(s, in_backward=in_hooks, in_exchange=s.decode, waited=self.backprop.waited)

    def _local_step_and_send(self, layer: Layer) -> None:
        """Steps 1 and 2 for one layer: the local update, then its public copy's change, sent."""
        s, step = self.stats, self.stats.step
        start = time.perf_counter()
        self.sent.add(layer.index)
        grad = self.backprop.gradient(self.params_by_name, layer)
        what = f"step {step}: rank {self.rank}'s gradient of {layer.name!r}"
        skipped = skip_update(grad, what, self.cfg.on_nonfinite)  # abort raises naming the step and layer
        s.nonfinite += int(skipped)
        x = self._values(layer)
        if not skipped:
            with torch.no_grad():
                self.optimizer.step(layer.name, x, grad.reshape(-1).float(), self.lr)
            copy_flat_into(self.params_by_name, layer.params, x)
        coded = time.perf_counter()
        s.apply += coded - start
        mine = self.public[(self.rank, layer.index)]
        seed = message_seed(self.cfg.seed, step, layer.index, self.rank)
        codec = self._codec(layer)
        payload = codec.encode(torch.sub(x, mine).view(layer.shape), seed=seed)
        codec.decode_add(payload, mine)
        data = wire.dumps(Envelope("grad", layer.name, step, self.rank).seal(payload))
        s.bytes_up += len(data) * len(self.neighbours)
        self.sends += [self.world.isend(data, j, layer_tag(layer.index)) for j in self.neighbours]
        self.sends = self.world.progress(self.sends)
        s.encode += time.perf_counter() - coded

    # ------------------------------------------------------------------ the Role interface
    def step(self, step: int) -> list[dict]:
        stats = self.ctx.train_on_batch(step, self.train_step)
        every = self.cfg.consensus_every_steps
        last = step == self.ctx.total - 1
        extra = {"consensus": self.consensus_distance()} if every and (step % every == 0 or last) else None
        return self.rows.row(stats, extra)

    def _averaged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's flat model (parameters, then floating buffers) and the ranks' average of it."""
        tensors = [p.detach().reshape(-1).double() for p in self.model.parameters()]
        tensors += [b.detach().reshape(-1).double() for b in self.model.buffers() if b.is_floating_point()]
        mine = torch.cat(tensors)
        total = self.world.allreduce_sum(mine.numpy())
        return mine, torch.from_numpy(total) / self.size

    def consensus_distance(self) -> float:
        """(1/N) sum_i ||x_i - x_bar||^2 over the parameters (collective)."""
        numel = sum(p.numel() for p in self.model.parameters())
        mine, mean = self._averaged()
        local = float(torch.sum((mine[:numel] - mean[:numel]) ** 2))
        return float(self.world.allreduce_sum([local])[0]) / self.size

    def evaluate(self, step: int) -> None:
        """Rank 0 scores the ranks' average model (collective: one allreduce of the model)."""
        start = time.perf_counter()
        _, mean = self._averaged()
        if self.rank == 0:
            before, self.doing = self.doing, self.ctx.evaluations.doing(step)
            model = self.ctx.evaluations.model()
            model.load_state_dict(self.model.state_dict())
            targets = [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
            with torch.no_grad():
                for t, part in zip(targets, flat_parts(mean, targets), strict=True):
                    t.copy_(part)
            self.ctx.evaluations.start(model, step, time.perf_counter() - start)
            self.doing = before  # started (in the background) or done (in the loop)

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params_by_name.items()}

    def state_dict(self) -> dict:
        state = replica_state(self.params_by_name, self.model, self.backprop, self.optimizer)
        return {"public": {f"{j}/{i}": v for (j, i), v in self.public.items()}, **state}

    def load_state_dict(self, state: dict) -> None:
        load_replica_state(
            state, params=self.params_by_name, model=self.model, backprop=self.backprop, optimizer=self.optimizer
        )
        for key, value in state["public"].items():
            j, i = (int(part) for part in key.split("/"))
            if (j, i) not in self.public:
                raise ValueError(f"checkpoint holds rank {j}'s copy, not a neighbour of rank {self.rank} here")
            self.public[(j, i)].copy_(value)
