"""ParameterServer: decode-and-sum gradients as they arrive, update each layer when complete.

Sync mode, per layer l owned by this server:
1. A receive per (worker, l) is always posted, into a buffer sized by the codec's bound.
2. The loop waits (with back-off) for *any* receive to complete; an arriving gradient is
   validated (kind, layer, step, sender) and decoded straight into l's accumulator with weight 1/W,
   and the receive is re-posted for the next step.
3. When l has all W contributions: optimizer update of l, then l goes back to every worker at
   once, encoded once — layers go back in the order they complete. With ``--down-codec none`` the
   message is l's new value (``params``). With any other down-codec it is the encoded change
   since what the workers hold (``delta``): the server keeps a copy of the workers' l (the
   shadow), encodes value - shadow and adds the decoded message to the shadow, so what the codec
   dropped is sent in later steps (error feedback on the down-link) and never lost. A layer that
   is not compressed (the bucket of 1-D parameters) always goes back as its value.
4. At start every worker gets the shadow exactly (``params``, uncompressed): fresh or resumed,
   workers and shadow agree from the first step on.
Async mode: each worker's gradient is applied alone (weight 1/W) the moment it arrives; when a
worker's layers for its step are all in, it gets the current parameters back — unless it is more
than ``staleness`` steps ahead of the slowest active worker, in which case the reply waits. Replies
go to one worker at a time, so each worker has a shadow of its own.
Control messages (stop, stats, BatchNorm buffers) arrive on their own tags.
Evaluation with several servers: at an evaluation step every other server sends the values of its
layers to server 0 (``send_values``), which keeps a receive per server posted while it evaluates.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from . import wire
from .codecs import Codec, make_codec
from .config import RunConfig
from .optim import LayerOptimizer, learning_rate
from .roles import Layer, Roles
from .transport import SERVER_PATIENCE, TAG_CONTROL, TAG_VALUES, Handle, Transport, layer_tag
from .worker import message_seed, upload_bound

_CONTROL_BYTES = 4096


class ParameterServer:
    """Serves the layers this rank owns; ``run()`` returns when every worker sent ``stop``."""

    def __init__(
        self,
        transport: Transport,
        roles: Roles,
        layers: list[Layer],
        cfg: RunConfig,
        values: dict[int, torch.Tensor],
        steps_per_epoch: int,
        start_step: int = 0,
        buffers_size: int = 0,
    ) -> None:
        self.transport, self.roles, self.cfg = transport, roles, cfg
        self.rank = transport.rank
        self.layers = layers
        self.owned = [layer for layer in layers if layer.owner == self.rank]
        self.values = values  # owned layer index -> flat fp32 tensor (the authoritative copy)
        self.workers = roles.worker_ranks
        self.num_workers = len(self.workers)
        self.steps_per_epoch = steps_per_epoch
        self.optimizer = LayerOptimizer.from_config(cfg)
        self.down_codec = make_codec(cfg.down_codec)
        self.exact_codec = make_codec("none")
        self.send_deltas = self.down_codec.name != "none"
        # what the workers hold of each owned layer: one copy in sync mode, one per worker in async
        self.shadow: dict[tuple[int, int], torch.Tensor] = {}
        if self.send_deltas:
            for layer in (layer for layer in self.owned if layer.compress):
                for w in self.workers if cfg.mode == "async" else [-1]:
                    self.shadow[(layer.index, w)] = values[layer.index].clone()
        # value - shadow of each layer is formed here, not in a fresh allocation every step
        self.scratch = {i: torch.empty(v.numel()) for (i, _), v in self.shadow.items()}
        self.acc = {layer.index: torch.zeros(layer.numel) for layer in self.owned}
        self.count = {layer.index: 0 for layer in self.owned}
        self.layer_step = {layer.index: start_step for layer in self.owned}
        self.worker_count = {w: 0 for w in self.workers}  # async: layers in for the worker's step
        self.worker_step = {w: start_step for w in self.workers}
        self.deferred: set[int] = set()
        self.active = set(self.workers)
        self.pending: dict[object, Handle] = {}
        self.sends: list[Handle] = []
        self.codecs: dict[str, Codec] = {}
        self.bounds = {layer.index: upload_bound(cfg, layer) for layer in self.owned}
        self.buffers_size = buffers_size
        self.completed_step = start_step - 1
        self.doing = "starting"
        self.times = {"decode": 0.0, "apply": 0.0, "idle": 0.0}
        # hooks for train.py (metrics, evaluation, checkpoints); server 0 only for the first two
        self.on_stats: Callable[[int, dict], None] | None = None
        self.on_buffers: Callable[[int, torch.Tensor], None] | None = None
        self.on_step_done: Callable[[int], None] | None = None
        # server 0 with evaluation and other servers: their values arrive through on_values, and
        # the loop keeps running after the workers stopped while still_waiting() says so
        self.on_values: Callable[[int, int, torch.Tensor], None] | None = None
        self.still_waiting: Callable[[], bool] = lambda: False
        self._buffer_acc: dict[int, list] = {}

    # ------------------------------------------------------------------ posting
    def _post(self, key: object, nbytes: int, source: int, tag: int) -> None:
        self.pending[key] = self.transport.irecv(nbytes, source, tag, key)

    def start(self) -> None:
        """Post every receive and send the starting parameters to every worker."""
        for w in self.workers:
            for layer in self.owned:
                self._post(("grad", w, layer.index), self.bounds[layer.index], w, layer_tag(layer.index))
            # stats, buffers and stop share the control tag, so they arrive in the order sent
            control_bytes = max(_CONTROL_BYTES, wire.max_message_bytes("none", (self.buffers_size,), "__buffers__"))
            self._post(("control", w), control_bytes, w, TAG_CONTROL)
        if self.on_values is not None:
            for server in self.roles.server_ranks:
                if server != self.rank:
                    numel = sum(layer.numel for layer in self.layers if layer.owner == server)
                    nbytes = wire.max_message_bytes("none", (numel,), "__values__")
                    self._post(("values", server, numel), nbytes, server, TAG_VALUES)
        for layer in self.owned:
            self._reply(layer, self.workers, exact=True)

    def send_values(self, step: int) -> None:
        """Send the values of this server's layers after ``step`` to server 0 (for evaluation)."""
        flat = torch.cat([self.values[layer.index] for layer in self.owned])
        msg = make_codec("none").encode(flat)
        msg.kind, msg.step, msg.layer, msg.sender = "params", step, "__values__", self.rank
        self.sends.append(self.transport.isend(wire.dumps(msg), self.roles.server_ranks[0], TAG_VALUES))

    def _shadow_of(self, layer: Layer, workers: list[int]) -> torch.Tensor:
        return self.shadow[(layer.index, workers[0] if self.cfg.mode == "async" else -1)]

    def _reply(self, layer: Layer, workers: list[int], exact: bool = False) -> None:
        """Send ``layer`` to ``workers``: its value (exact, or --down-codec none) or its encoded change."""
        step = self.layer_step[layer.index]
        if not self.send_deltas or not layer.compress:
            msg = self.exact_codec.encode(self.values[layer.index].view(layer.shape))
            msg.kind = "params"
        elif exact:
            msg = self.exact_codec.encode(self._shadow_of(layer, workers).view(layer.shape))
            msg.kind = "params"
        else:
            shadow = self._shadow_of(layer, workers)
            seed = message_seed(self.cfg.seed, step, layer.index, self.rank)
            change = torch.sub(self.values[layer.index], shadow, out=self.scratch[layer.index])
            msg = self.down_codec.encode(change.view(layer.shape), seed=seed)
            # the same decode_add the workers run on their parameters: the shadow stays bit-exact
            self.down_codec.decode_add(msg, shadow)
            msg.kind = "delta"
        msg.step, msg.layer, msg.sender = step, layer.name, self.rank
        data = wire.dumps(msg)
        for w in workers:
            self.sends.append(self.transport.isend(data, w, layer_tag(layer.index)))

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        self.start()
        while self.active or self.still_waiting():
            self.doing = f"waiting for messages (step {self.completed_step + 1})"
            handles = list(self.pending.values())
            idle_before = self.transport.idle_seconds
            done = self.transport.wait_some(handles, patience=SERVER_PATIENCE)
            self.times["idle"] += self.transport.idle_seconds - idle_before
            for i in done:
                handle = handles[i]
                del self.pending[handle.key]
                self._dispatch(handle)
            self.sends = self.transport.progress(self.sends)
        for key, handle in list(self.pending.items()):
            self.transport.cancel(handle)
            del self.pending[key]
        self.doing = "flushing replies"
        self.transport.wait_all(self.sends)
        self.sends = []

    def _dispatch(self, handle: Handle) -> None:
        kind = handle.key[0]
        try:
            msg = wire.loads(handle.payload(), max_bytes=len(handle.buffer))
        except wire.WireError as err:
            raise RuntimeError(f"malformed {kind} message from rank {handle.peer}: {err}") from None
        if msg.sender != handle.peer:
            raise RuntimeError(f"{kind} message from rank {handle.peer} claims sender {msg.sender}")
        if kind == "grad":
            self._on_grad(handle.key[1], self.layers[handle.key[2]], msg)
            if handle.peer in self.active:
                self.pending[handle.key] = self.transport.repost(handle)
        elif kind == "values":
            numel = handle.key[2]
            if msg.kind != "params" or msg.layer != "__values__" or msg.numel != numel:
                raise RuntimeError(
                    f"rank {handle.peer} sent {msg.kind} {msg.layer!r} of {msg.numel} values, expected its {numel} layer values"
                )
            values = make_codec("none").decode(msg).view(-1)
            self.pending[handle.key] = self.transport.repost(handle)
            if self.on_values is not None:
                self.on_values(handle.peer, msg.step, values)
        elif msg.kind == "buffers":
            self._on_buffers(handle.peer, msg)
            self.pending[handle.key] = self.transport.repost(handle)
        elif msg.meta.get("op") == "stats":
            if self.on_stats is not None:
                self.on_stats(handle.peer, {"step": msg.step, **{k: v for k, v in msg.meta.items() if k != "op"}})
            self.pending[handle.key] = self.transport.repost(handle)
        elif msg.meta.get("op") == "stop":
            self._on_stop(handle.peer)
        else:
            raise RuntimeError(f"unknown control message {msg.kind}/{msg.meta.get('op')!r} from rank {handle.peer}")

    def _codec(self, msg) -> Codec:
        key = f"{msg.codec}:{sorted(msg.params.items())}"
        if key not in self.codecs:
            self.codecs[key] = make_codec(msg.codec, **msg.params)
        return self.codecs[key]

    def _on_grad(self, worker: int, layer: Layer, msg) -> None:
        expected = self.worker_step[worker] if self.cfg.mode == "async" else self.layer_step[layer.index]
        if msg.kind != "grad" or msg.layer != layer.name or msg.step != expected or tuple(msg.shape) != layer.shape:
            raise RuntimeError(
                f"rank {worker} sent {msg.kind} for {msg.layer!r} step {msg.step} shape {tuple(msg.shape)}; expected grad for {layer.name!r} step {expected} shape {layer.shape}"
            )
        start = time.perf_counter()
        if self.cfg.mode == "async":
            grad = torch.zeros(layer.numel)
            self._codec(msg).decode_add(msg, grad, alpha=1.0 / self.num_workers)
            self.times["decode"] += time.perf_counter() - start
            self._apply(layer, grad, msg.step)
            self.worker_count[worker] += 1
            if self.worker_count[worker] == len(self.owned):
                self.worker_count[worker] = 0
                self.worker_step[worker] += 1
                self.deferred.add(worker)
                self._release_async()
            return
        self._codec(msg).decode_add(msg, self.acc[layer.index], alpha=1.0 / self.num_workers)
        self.times["decode"] += time.perf_counter() - start
        self.count[layer.index] += 1
        if self.count[layer.index] == self.num_workers:
            self._apply(layer, self.acc[layer.index], msg.step)
            self.acc[layer.index].zero_()
            self.count[layer.index] = 0
            self.layer_step[layer.index] += 1
            self._reply(layer, self.workers)
            if all(self.layer_step[i] > msg.step for i in self.layer_step):
                self._step_done(msg.step)

    def _apply(self, layer: Layer, grad: torch.Tensor, step: int) -> None:
        start = time.perf_counter()
        lr = learning_rate(self.cfg, step, self.steps_per_epoch, self.num_workers)
        self.optimizer.step(layer.name, self.values[layer.index], grad, lr)
        self.times["apply"] += time.perf_counter() - start

    def _release_async(self) -> None:
        """Reply to every deferred worker that is at most ``staleness`` steps ahead of the slowest."""
        slowest = min(self.worker_step[w] for w in self.active) if self.active else 0
        for w in sorted(self.deferred):
            if self.worker_step[w] - slowest <= self.cfg.staleness:
                self.deferred.discard(w)
                for layer in self.owned:
                    self.layer_step[layer.index] = self.worker_step[w]
                    self._reply(layer, [w])
        done = min(self.worker_step.values()) - 1
        while self.completed_step < done:
            self._step_done(self.completed_step + 1)

    def _step_done(self, step: int) -> None:
        self.completed_step = step
        if self.on_step_done is not None:
            self.on_step_done(step)

    def _on_stop(self, worker: int) -> None:
        self.active.discard(worker)
        for key, handle in list(self.pending.items()):
            if handle.peer == worker:
                self.transport.cancel(handle)
                del self.pending[key]
        if self.cfg.mode == "async":
            self._release_async()

    def _on_buffers(self, worker: int, msg) -> None:
        if msg.kind != "buffers" or msg.numel != self.buffers_size:
            raise RuntimeError(
                f"rank {worker} sent {msg.kind} of {msg.numel} values, expected buffers of {self.buffers_size}"
            )
        entry = self._buffer_acc.setdefault(msg.step, [torch.zeros(self.buffers_size), 0])
        make_codec("none").decode_add(msg, entry[0], alpha=1.0 / self.num_workers)
        entry[1] += 1
        if entry[1] == self.num_workers:
            del self._buffer_acc[msg.step]
            if self.on_buffers is not None:
                self.on_buffers(msg.step, entry[0])

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"value/{i}": v for i, v in self.values.items()}
        state.update({f"shadow/{i}/{w}": v for (i, w), v in self.shadow.items()})
        state.update({f"optim/{k}": v for k, v in self.optimizer.state_dict().items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for key, tensor in state.items():
            if key.startswith("value/"):
                index = int(key.removeprefix("value/"))
                if index not in self.values or self.values[index].numel() != tensor.numel():
                    raise ValueError(
                        f"checkpoint layer {index} does not fit this run's layer plan (written with another "
                        "model, --granularity or --bucket-vectors, or by a psgrad before the vector bucket?)"
                    )
                self.values[index].copy_(tensor)
            elif key.startswith("shadow/") and self.shadow:
                index, worker = key.removeprefix("shadow/").split("/")
                self.shadow[(int(index), int(worker))].copy_(tensor)
        self.optimizer.load_state_dict(
            {k.removeprefix("optim/"): v for k, v in state.items() if k.startswith("optim/")}
        )
