"""The working engine: backward hooks encode each gradient and push it at once; forward pre-hooks pull.

Per step (docs/architecture.md has the picture):
1. forward — a pre-hook on each module waits only for *its* parameters' replies from the last
   step, so the pull of late layers overlaps the forward of early ones;
2. post the receives for this step's replies (into per-layer buffers kept across steps);
3. backward — a post-accumulate-grad hook per parameter runs feedback -> codec -> wire and
   ``isend``s the bytes to the layer's server while autograd carries on with earlier layers;
4. wait for the sends, report the step's timings and bytes to the metrics rank.

A codec of several rounds (PowerSGD) adds to step 3: each server reply to round r is answered
with round r + 1 as soon as it arrives (in hooks and waits), and before step 4 the worker
finishes every round but the last, so the servers complete the step without it. The last reply
is the gradient everybody applies: the worker applies it with the run's optimizer before the
layer's next forward (a colocated rank copies its own shard from its server part instead).

With ``--push after`` step 3 has no hooks: after backward every layer is coded and sent in
forward order (first layer first), and step 4 does not wait — the sends drain while the next
forward's pre-hooks wait for the first replies.

With a ``local`` server (colocated), layers this rank owns never touch the network: their
gradients are handed to the server as messages and their replies taken from it, and every wait
— and every hook — lets the server handle what arrived for it meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..backprop import Backprop
from ..codecs import Message, make_codec
from ..comm import wire
from ..comm.channel import Handle
from ..comm.envelope import Envelope, parse
from ..comm.protocol import (
    TAG_CONTROL,
    GradientGate,
    Layer,
    StepStats,
    buffers_vector,
    control_message,
    encode_gradient,
    layer_rounds,
    layer_tag,
    load_buffers_vector,
    tensor_message,
)
from ..comm.waiting import Patience
from ..context import RunContext
from ..devices import outside_autocast
from ..feedback import NoFeedback
from .clock import StepClock
from .local import LocalSteps
from .replies import apply_values, reply_bounds
from .rounds import Rounds
from .server import BUFFERS_LAYER, ServerBase


class Worker(Rounds, LocalSteps):
    """Trains ``ctx.model`` through the servers; see the module docstring."""

    def __init__(
        self,
        ctx: RunContext,
        feedback: NoFeedback,
        local: ServerBase | None = None,
        *,
        on_mean: Callable[[Layer, torch.Tensor, bool], None] | None = None,
    ) -> None:
        """``on_mean(layer, flat_gradient, applied)`` takes each layer's mean gradient where the
        servers only sum (``ctx.sums``: the caller's optimizer updates the model)."""
        self.ctx, self.cfg, self.transport = ctx, ctx.cfg, ctx.transport
        self.model, self.layers, self.device = ctx.model, ctx.layers, ctx.device
        self.feedback, self.local = feedback, local
        self.rank = ctx.rank
        self.stream = ctx.layout.worker_index(self.rank)
        self.metrics_rank = ctx.layout.server_ranks[0]
        self.servers = ctx.layout.server_ranks
        self.params = dict(self.model.named_parameters())
        self.backprop = Backprop(
            self.cfg, model=self.model, loss_fn=ctx.loss_fn, device=self.device, shared_pass=ctx.transport.shared_pass()
        )
        self.layer_of = {name: layer for layer in self.layers for name in layer.params}
        down = make_codec(self.cfg.down_codec)
        self.reply_codecs = {"none": make_codec("none"), down.name: down}
        self.bounds = reply_bounds(self.layers, down_codec=self.cfg.down_codec)
        self.buffers = [bytearray(b) for b in self.bounds]
        # multi-round layers (PowerSGD): the round whose reply each open layer awaits, and the
        # optimizer that applies their last reply here, as the server does to its copy
        self.rounds = [layer_rounds(feedback.codec, layer) for layer in self.layers]
        self.awaiting: dict[int, int] = {}
        self.multi_round = max(self.rounds, default=1) > 1
        self.optimizer = ctx.make_optimizer() if self.multi_round and not ctx.sums else None
        self.on_mean = on_mean
        if ctx.sums and on_mean is None:
            raise ValueError("a worker of servers that only sum needs on_mean: who takes the mean gradient")
        self._advancing = False
        self.pulls: dict[int, Handle | None] = {}  # None: the reply comes from the local server
        self.parse_seconds = 0.0  # the last reply's wire.loads: decoding, not waiting
        self.pull_step = 0
        self.pull_steps: dict[int, int] = {}  # layer index -> the step its posted receive is for
        self.sends: list[Handle] = []
        self.sent: set[int] = set()
        self.step = 0
        self.gate = GradientGate(self.layers)
        self.deferred = False  # --overlap-exchange: the pulls posted wait until the reply is taken
        self.stats = StepStats()
        self.doing = "starting"
        self._hooks = []
        if self.cfg.local_steps:
            self.start_local_steps()  # no hooks: a layer leaves at an exchange, not in backward
        elif self.cfg.granularity == "layer" and self.cfg.push == "backward" and self.backprop.hooks_may_send:
            self._hooks += self.backprop.on_layer_gradients(
                self.params, self.gate, lambda layer: self.push(layer, self.backprop.gradient(self.params, layer))
            )
        for prefix, module in self.model.named_modules():
            own = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False)]
            if own:
                indices = sorted({self.layer_of[n].index for n in own})
                self._hooks.append(module.register_forward_pre_hook(self._pull_before(indices)))

    def _is_local(self, rank: int) -> bool:
        return self.local is not None and rank == self.rank

    def serve(self) -> bool:
        """Let the local server handle what arrived (the idle work of every wait); True if it did."""
        if self.local is None:
            return False
        start = time.perf_counter()
        with self.local.lock:
            worked = self.local.poll()
        self.stats.serve += time.perf_counter() - start
        return worked

    def _idle(self):
        if self.multi_round:
            return self._serve_and_advance
        return self.serve if self.local is not None else None

    def _serve_and_advance(self) -> bool:
        served = self.serve()
        return self.advance_rounds() or served

    # ------------------------------------------------------------------ pull
    def post_pulls(self, step: int, *, layers: list[Layer] | None = None) -> None:
        """Post receives for the parameters the servers will send for ``step`` (of ``layers``;
        None: every layer)."""
        self.pull_step = step
        for layer in self.layers if layers is None else layers:
            self.pull_steps[layer.index] = step
            if self._is_local(layer.owner):
                self.pulls[layer.index] = None
            else:
                self.pulls[layer.index] = self.transport.irecv(
                    self.bounds[layer.index],
                    layer.owner,
                    layer_tag(layer.index),
                    key=layer.index,
                    buffer=self.buffers[layer.index],
                )

    def _receive(self, index: int, block: bool) -> Message | None:
        """The next message the layer's server sent this worker (None: not yet, when not blocking)."""
        handle, layer = self.pulls[index], self.layers[index]
        self.parse_seconds = 0.0
        if handle is None:
            with self.local.lock:
                if block:
                    self.local.serve_until(lambda: index in self.local.local_replies, patience=Patience())
                return self.local.local_replies.pop(index, None)
        if block:
            handle.wait(self._idle())
        elif not handle.test():
            return None
        self.stats.bytes_down += handle.count
        start = time.perf_counter()
        msg = parse(
            handle.payload(),
            sender=handle.peer,
            what=f"reply for {layer.name!r}",
            max_bytes=self.bounds[index],
            shape=layer.shape,
        )
        self.parse_seconds = time.perf_counter() - start
        return msg

    def _pull_before(self, indices: list[int]):
        def hook(module, inputs):
            self.serve()
            if self.deferred:  # an overlapped exchange: its reply is taken later (engine.local)
                self.progress_exchange()
                return
            if self.pull_step != self.step:  # later micro-batches: the pulls posted are the next step's
                return
            for index in indices:
                self.finish_pull(index)

        return outside_autocast(hook, self.device)  # under the forward's autocast: code in fp32

    def finish_pull(self, index: int) -> None:
        if index not in self.pulls:
            return
        layer = self.layers[index]
        doing, self.doing = (
            self.doing,
            f"step {self.pull_steps[index]}: waiting for {layer.name!r} from rank {layer.owner}",
        )
        start = time.perf_counter()
        while index in self.awaiting:  # earlier rounds first: the last reply needs them
            self.advance_rounds(only=index)
        msg = self._receive(index, block=True)
        del self.pulls[index]
        # parsing the reply is decoding it, as encoding counts wire.dumps (and alltoall's and gossip's decode, wire.loads)
        self.stats.pull_wait += time.perf_counter() - start - self.parse_seconds
        self.stats.decode += self.parse_seconds
        start = time.perf_counter()
        self.doing = doing
        self._apply_pull(layer, msg, start)

    def _check_reply(self, layer: Layer, msg: Message, kinds: tuple[str, ...], round_: int = 0) -> None:
        Envelope(kinds[0], layer.name, self.pull_steps[layer.index], layer.owner, round_).check(msg, kinds=kinds)

    def _apply_pull(self, layer: Layer, msg: Message, start: float) -> None:
        if msg.kind == "code":
            return self._apply_code(layer, msg, start)
        if self.ctx.sums:
            self._check_reply(layer, msg, ("mean",))
            codec = self.reply_codecs[msg.codec]
            self.on_mean(layer, codec.decode(msg, device=self.device).view(-1), not msg.meta.get("skip"))
            self.stats.decode += time.perf_counter() - start
            return
        self._check_reply(layer, msg, ("params", "delta"))
        apply_values(
            msg, layer=layer, params=self.params, codecs=self.reply_codecs, device=self.device, stats=self.stats
        )

    def finish_pulls(self) -> None:
        for index in list(self.pulls):
            self.finish_pull(index)

    # ------------------------------------------------------------------ push
    def push(self, layer: Layer, grad: torch.Tensor) -> None:
        """Encode ``grad`` of ``layer`` (feedback -> codec) and send it to its server."""
        start = time.perf_counter()
        msg = encode_gradient(
            self.feedback,
            layer,
            grad,
            step=self.step,
            sender=self.rank,
            stream=self.stream,
            run_seed=self.cfg.seed,
            on_nonfinite=self.cfg.on_nonfinite,
        )
        self.stats.nonfinite += int(bool(msg.meta.get("skip")))
        self.sent.add(layer.index)
        if self.rounds[layer.index] > 1:
            self.awaiting[layer.index] = 1
        self.stats.encode += time.perf_counter() - start
        self._send(layer, msg)
        self.serve()
        if self.multi_round and self.cfg.push == "backward":  # after: the rounds come next anyway
            self.advance_rounds()

    def _send(self, layer: Layer, msg: Message) -> None:
        """Send ``msg`` to ``layer``'s server: over MPI, or handed to this rank's own server."""
        start = time.perf_counter()
        if self._is_local(layer.owner):
            with self.local.lock:
                self.local.on_local_grad(layer, msg)
            self.stats.serve += time.perf_counter() - start
            return
        data = wire.dumps(msg)
        self.sends.append(self.transport.isend(data, layer.owner, layer_tag(layer.index)))
        self.stats.bytes_up += len(data)
        self.sends = self.transport.progress(self.sends)
        self.stats.encode += time.perf_counter() - start

    def push_missing(self) -> None:
        """Layers whose hook did not fire (model granularity, ``--push after``, unused parameters) are
        sent now, in forward order: the server can return the first layers first."""
        for layer in self.layers:
            if layer.index not in self.sent:
                self.push(layer, self.backprop.gradient(self.params, layer))

    # ------------------------------------------------------------------ step
    def run_step(self, step: int) -> StepStats:
        """Train on this worker's batch of ``step`` and report the step to the metrics rank."""
        self.feedback.set_epoch(step // max(1, self.ctx.steps_per_epoch))
        self.doing = f"step {step}: loading the batch"
        stats = self.ctx.train_on_batch(step, self.train_step)
        self.report(stats)
        return stats

    def train_step(self, step: int, images: torch.Tensor, labels: torch.Tensor) -> StepStats:
        if self.cfg.local_steps:
            return self.local_train_step(step, images, labels)
        self.step, self.sent, self.stats = step, set(), StepStats(step=step)
        self.gate.reset()
        clock = StepClock()
        self.doing = f"step {step}: forward"

        def after_first_forward() -> None:
            self.finish_pulls()
            clock.mark("forward_done")
            self.post_pulls(step + 1)
            self.doing = f"step {step}: backward"

        loss = self.backprop.run(images, labels, after_first_forward, self._idle())
        self.backprop.finish(self.params)
        self.push_missing()
        self.backprop.end_step(self.stats.nonfinite > 0)
        clock.mark("backward_done")
        s = self.stats
        encode_in_backward, serve_in_backward = s.encode, s.serve
        self.doing = f"step {step}: exchanging later rounds"
        # every round but the last leaves within the step: the servers finish the step on their own
        while self.awaiting:
            self.advance_rounds(only=next(iter(self.awaiting)))
        self.doing = f"step {step}: waiting for sends"
        if self.cfg.push == "after":
            # the sends drain while the next forward waits for its first layers
            self.sends = self.transport.progress(self.sends)
        else:
            self.transport.wait_all(self.sends, self._idle())
            self.sends = []
        clock.mark("exchanged")
        clock.mark("end")
        s.loss = loss
        # pulls in forward, coding and serving in backward and after it have columns of their own
        return clock.fill(
            s,
            in_forward=s.pull_wait + s.decode + s.apply,
            in_backward=encode_in_backward + serve_in_backward,
            in_exchange=(s.encode - encode_in_backward) + (s.serve - serve_in_backward),
            waited=self.backprop.waited,
        )

    def _control(self, msg: Message, dest: int) -> None:
        """Stats, BatchNorm buffers and stop share one tag: MPI keeps messages of one (source, tag)
        in order, so ``stop`` can never overtake the last stats or buffers."""
        if self._is_local(dest):
            with self.local.lock:
                self.local.on_control(self.rank, msg)
        else:
            self.sends.append(self.transport.isend(wire.dumps(msg), dest, TAG_CONTROL))

    def report(self, stats: StepStats) -> None:
        """Send the step's numbers to the metrics rank (it writes metrics.csv, drives the progress bar)."""
        meta = {k: v for k, v in vars(stats).items() if k != "step"}  # flat fields: no deep copy
        self._control(control_message("stats", self.rank, stats.step, **meta), self.metrics_rank)

    def send_buffers(self, step: int) -> None:
        """BatchNorm statistics to the metrics rank, which averages them over workers before evaluating."""
        self._control(
            tensor_message("buffers", BUFFERS_LAYER, step=step, sender=self.rank, flat=buffers_vector(self.model)),
            self.metrics_rank,
        )

    def final_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.params.items()}

    def state_dict(self) -> dict:
        if self.multi_round:
            # the last round's replies update the multi-round memory (PowerSGD's error and Q)
            self.finish_pulls()
        return {
            "feedback": self.feedback.state_dict(),
            "buffers": buffers_vector(self.model),
            "rng": torch.get_rng_state(),
            "loss_scale": self.backprop.scale.state_dict(),
            **({"optim": self.optimizer.state_dict()} if self.optimizer is not None else {}),
            **(self.local_state_dict() if self.cfg.local_steps else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        self.feedback.load_state_dict(state["feedback"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state.get("optim", {}))
        load_buffers_vector(self.model, state["buffers"])
        if self.cfg.local_steps:
            self.load_local_state_dict(state)
        torch.set_rng_state(state["rng"])
        if "loss_scale" in state:  # checkpoints written before --amp have none
            self.backprop.scale.load_state_dict(state["loss_scale"])

    def stop(self) -> None:
        """Tell every server this worker is done, after the last step's parameters arrived."""
        self.doing = "stopping"
        self.finish_pulls()
        for server in self.servers:
            self._control(control_message("stop", self.rank, self.step), server)
        self.transport.wait_all(self.sends, self._idle())
        self.sends = []
        for hook in self._hooks:
            hook.remove()
