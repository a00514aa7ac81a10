"""The serving engine: decode-and-sum gradients as they arrive, update each layer when complete.

Sync mode (``SyncServer``), per layer l owned by this rank:
1. A receive per (remote worker, l) is always posted, into a buffer sized by the codec's bound.
   A worker on this same rank (colocated) hands its message over directly: no bytes, no MPI.
2. ``poll`` / ``serve_until`` wait (with back-off) for *any* receive to complete; an arriving
   gradient is validated (kind, layer, step, sender, shape) and decoded straight into l's
   accumulator with weight 1/W — held first if an earlier worker's is still missing, so the sum
   is always taken in worker order — and the receive is re-posted for the next step.
3. When l has all W contributions: optimizer update of l, then l goes back to every worker at
   once, encoded once — layers go back in the order they complete. A server that only sums
   (``ctx.sums``: the workers run their own optimizer, psgrad.userloop) sends the mean gradient
   instead (``mean``), coded with --down-codec inside error feedback on the server, and keeps no
   values. With ``--down-codec none`` the message is l's new value (``params``). With any other
   down-codec it is the encoded change since what the workers hold (``delta``): the server keeps
   a copy of the workers' l (the shadow), encodes value - shadow and adds the decoded message to
   the shadow, so what the codec dropped is sent in later steps (error feedback on the
   down-link) and never lost. A layer that is not compressed (the bucket of 1-D parameters)
   always goes back as its value.
4. At start every worker gets the shadow exactly (``params``, uncompressed): fresh or resumed,
   workers and shadow agree from the first step on.
5. A codec of several rounds (PowerSGD) sums each round's messages in code space, in worker
   order, and replies to every worker with ``codec.reduce`` of the sum (``code``); after the last
   round the layer is updated with ``codec.gradient`` of the replies, and the last reply is its
   down-link (no shadow, no parameters: the workers apply the same gradient).
Async mode (``AsyncServer``): each worker's gradient is applied alone (weight 1/W) the moment it
arrives; when a worker's layers for its step are all in, it gets the current parameters back —
unless it is more than ``staleness`` steps ahead of the slowest active worker, in which case the
reply waits. Replies go to one worker at a time, so each worker has a shadow of its own.
Control messages (stop, stats, BatchNorm buffers) arrive on their own tag; the metrics rank turns
stats into metrics rows. With several servers, every other server sends its layers' values to
the metrics rank at an evaluation step (``send_values``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from ..codecs import Codec, Message, make_codec
from ..comm import wire
from ..comm.channel import Handle
from ..comm.envelope import Envelope, parse
from ..comm.protocol import (
    SERVER_STREAM,
    SHARED_STREAM,
    TAG_CONTROL,
    TAG_VALUES,
    Layer,
    copy_flat_into,
    layer_rounds,
    layer_tag,
    layer_values,
    message_seed,
    skip_update,
    tensor_message,
    upload_bound,
)
from ..comm.waiting import SERVER_PATIENCE, Patience
from ..context import RunContext
from ..optim import learning_rate, update_lr
from .collector import Collector
from .local import exchange_of, exchanges_done, fragment_of

_CONTROL_BYTES = 4096
VALUES_LAYER = "__values__"
BUFFERS_LAYER = "__buffers__"


def _owned_values(model: nn.Module, owned: list[Layer]) -> dict[int, torch.Tensor]:
    params = dict(model.named_parameters())
    return {layer.index: layer_values(params, layer).cpu() for layer in owned}


class ServerBase:
    """Serves the layers this rank owns; ``serve_until`` runs the loop, ``poll`` one round of it."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx, self.cfg, self.transport = ctx, ctx.cfg, ctx.transport
        self.rank = ctx.rank
        self.layers = ctx.layers
        self.owned = [layer for layer in ctx.layers if layer.owner == self.rank]
        # owned layer index -> flat fp32 tensor: the authoritative copy (a summing server has none)
        self.sums = ctx.sums
        self.values = {} if self.sums else _owned_values(ctx.model, self.owned)
        self.workers = ctx.layout.worker_ranks
        self.remote_workers = [w for w in self.workers if w != self.rank]
        self.num_workers = len(self.workers)
        self.metrics_rank = ctx.layout.server_ranks[0]
        # the other ranks that own layers (with more servers than layers, some own none)
        self.other_servers = sorted({layer.owner for layer in ctx.layers} - {self.rank})
        self.optimizer = ctx.make_optimizer()
        self.down_codec = make_codec(self.cfg.down_codec)
        self.exact_codec = make_codec("none")
        self.send_deltas = self.down_codec.name != "none"
        # layers whose codec takes several rounds: their last reply is the down-link, no shadow
        codec = make_codec(self.cfg.codec)
        self.rounds = {layer.index: layer_rounds(codec, layer) for layer in self.owned}
        # what the workers hold of each owned layer: one copy in sync mode, one per worker in async
        self.shadow: dict[tuple[int, int], torch.Tensor] = {}
        # a summing server's down-link memory: what its coded means dropped, sent in later steps
        self.mean_feedback = ctx.make_down_feedback() if self.sums else None
        if self.send_deltas and not self.sums:
            for layer in (layer for layer in self.owned if layer.compress and self.rounds[layer.index] == 1):
                for w in self.shadow_keys():
                    self.shadow[(layer.index, w)] = self.values[layer.index].clone()
        # value - shadow of each layer is formed here, not in a fresh allocation every step
        self.scratch = {i: torch.empty(v.numel()) for (i, _), v in self.shadow.items()}
        # the step itself, unless --local-steps counts exchanges (each fragment its own)
        self.fragment = fragment_of(ctx.layers, ctx.cfg.fragments)
        count = functools.partial(exchange_of, ctx.cfg, ctx.start)
        self.layer_step = {x.index: count(fragment=self.fragment[x.index]) for x in self.owned}
        self.active = set(self.workers)
        self.pending: dict[object, Handle] = {}
        self.sends: list[Handle] = []
        feedback = ctx.make_feedback()
        self.bounds = {layer.index: upload_bound(feedback, layer) for layer in self.owned}
        self.buffers_size = ctx.buffers_size
        self.completed_step = exchange_of(ctx.cfg, ctx.start) - 1
        self._phase: str | None = "starting"
        self.times = {"decode": 0.0, "apply": 0.0, "idle": 0.0}
        # what a worker on this rank gets back (colocated): layer index -> the reply message
        self.local_replies: dict[int, Message] = {}
        # the metrics rank's outputs, read by the role: rows, averaged buffers and other servers' values by step
        self.collector = (
            Collector(workers=self.num_workers, buffers_size=self.buffers_size, layers=self.layers)
            if self.rank == self.metrics_rank
            else None
        )
        # held by whoever drives this server: the rank's own worker, or the helper thread of
        # --serve-thread (a no-op lock where nothing else runs)
        self.lock: AbstractContextManager = nullcontext()

    @property
    def doing(self) -> str:
        """What this server does, for failure and hang reports: a phase set by its driver, or else
        (serving) which step's messages it waits for, read live: a colocated rank's server part is
        polled from its worker's hooks, never through ``serve_until``, and a step written down once
        went stale (`serving: waiting for messages (step 9)` from a rank at step 14)."""
        if self._phase is not None:
            return self._phase
        return f"waiting for messages (step {self.completed_step + 1})" if self.owned else "no layers to serve"

    @doing.setter
    def doing(self, phase: str | None) -> None:
        """Set a phase; None: serving."""
        self._phase = phase

    def shadow_keys(self) -> list[int]:
        return [-1]

    # ------------------------------------------------------------------ posting
    def _post(self, key: object, nbytes: int, source: int, tag: int) -> None:
        self.pending[key] = self.transport.irecv(nbytes, source, tag, key=key)

    def start(self) -> None:
        """Post every receive and send the starting parameters to every worker."""
        for w in self.remote_workers:
            for layer in self.owned:
                self._post(("grad", w, layer.index), self.bounds[layer.index], w, layer_tag(layer.index))
            # stats, buffers and stop share the control tag, so they arrive in the order sent
            control_bytes = max(_CONTROL_BYTES, wire.max_message_bytes("none", (self.buffers_size,), BUFFERS_LAYER))
            self._post(("control", w), control_bytes, w, TAG_CONTROL)
        if self.rank == self.metrics_rank:
            for server in self.other_servers:
                numel = sum(layer.numel for layer in self.layers if layer.owner == server)
                nbytes = wire.max_message_bytes("none", (numel,), VALUES_LAYER)
                self._post(("values", server, numel), nbytes, server, TAG_VALUES)
        for layer in self.owned if not self.sums else ():  # a summing server's workers start alike
            self._reply(layer, self.workers, exact=True)
        self.doing = None

    def send_values(self, step: int) -> None:
        """Send the values of this server's layers after ``step`` to the metrics rank (for evaluation)."""
        if not self.owned:
            return
        flat = torch.cat([self.values[layer.index] for layer in self.owned])
        msg = tensor_message("params", VALUES_LAYER, step=step, sender=self.rank, flat=flat)
        self.sends.append(self.transport.isend(wire.dumps(msg), self.metrics_rank, TAG_VALUES))

    def _shadow_of(self, layer: Layer, workers: list[int]) -> torch.Tensor:
        return self.shadow[(layer.index, -1)]

    def _reply(self, layer: Layer, workers: list[int], exact: bool = False) -> None:
        """Send ``layer`` to ``workers``: its value (exact, or --down-codec none) or its encoded change."""
        step = self.layer_step[layer.index]
        if not self.send_deltas or not layer.compress or self.rounds[layer.index] > 1:
            kind, payload = "params", self.exact_codec.encode(self.values[layer.index].view(layer.shape))
        elif exact:
            kind, payload = "params", self.exact_codec.encode(self._shadow_of(layer, workers).view(layer.shape))
        else:
            shadow = self._shadow_of(layer, workers)
            # a codec that shares its randomness sends the coordinates the workers' messages used
            stream = SHARED_STREAM if self.down_codec.shares_randomness else SERVER_STREAM
            seed = message_seed(self.cfg.seed, step, layer.index, stream)
            change = torch.sub(self.values[layer.index], shadow, out=self.scratch[layer.index])
            kind, payload = "delta", self.down_codec.encode(change.view(layer.shape), seed=seed)
            # the same decode_add the workers run on their parameters: the shadow stays bit-exact
            self.down_codec.decode_add(payload, shadow)
        self._deliver(layer, Envelope(kind, layer.name, step, self.rank).seal(payload), workers)

    def _reply_mean(self, layer: Layer, mean: torch.Tensor, *, step: int, skip: bool) -> None:
        """Send every worker the mean gradient of ``layer``: exact, or coded with --down-codec
        inside the server's error feedback (a layer that is not compressed always goes exact)."""
        if self.mean_feedback is not None and layer.compress:
            seed = message_seed(self.cfg.seed, step, layer.index, SERVER_STREAM)
            payload = self.mean_feedback.encode(layer.name, mean.view(layer.shape), seed)
        else:  # a copy: the accumulator is cleared for the next step while the reply may wait
            payload = self.exact_codec.encode(mean.view(layer.shape).clone())
        self._deliver(layer, Envelope("mean", layer.name, step, self.rank).seal(payload, skip=skip), self.workers)

    def _deliver(self, layer: Layer, msg: Message, workers: list[int]) -> None:
        """Send ``msg`` about ``layer`` to ``workers``: encoded once, handed over on this rank."""
        remote = [w for w in workers if w != self.rank]
        if len(remote) < len(workers):
            self.local_replies[layer.index] = msg
        if remote:
            data = wire.dumps(msg)
            for w in remote:
                self.sends.append(self.transport.isend(data, w, layer_tag(layer.index)))

    # ------------------------------------------------------------------ the loop
    def poll(self) -> bool:
        """Handle whatever arrived, without waiting; True when something did."""
        handles = list(self.pending.values())
        done = self.transport.test_some(handles)
        self._handle(handles, done)
        return bool(done)

    def _handle(self, handles: list[Handle], done: list[int]) -> None:
        """Dispatch the completed receives, then let finished replies go."""
        for i in done:
            self._arrived(handles[i])
        self.sends = self.transport.progress(self.sends)

    def serve_until(self, finished: Callable[[], bool], patience: Patience = SERVER_PATIENCE) -> None:
        """Serve until ``finished()`` is true, waiting with ``patience``'s back-off (by default the
        server's: rare wake-ups, see transport.SERVER_PATIENCE)."""
        while not finished():
            self.doing = None
            handles = list(self.pending.values())
            idle_before = self.transport.idle_seconds
            done = self.transport.wait_some(handles, patience=patience)
            self.times["idle"] += self.transport.idle_seconds - idle_before
            self._handle(handles, done)
            if not handles and not finished():
                raise RuntimeError(f"rank {self.rank} waits for nothing: no receive is posted")

    def finish(self) -> None:
        """Serve until every worker said stop, then cancel the spare receives and flush the replies."""
        self.serve_until(lambda: not self.active)
        for key, handle in list(self.pending.items()):
            handle.cancel()
            del self.pending[key]
        self.doing = "flushing replies"
        self.transport.wait_all(self.sends)
        self.sends = []

    def _arrived(self, handle: Handle) -> None:
        del self.pending[handle.key]
        kind = handle.key[0]
        shape = self.layers[handle.key[2]].shape if kind == "grad" else (handle.key[2],) if kind == "values" else None
        start = time.perf_counter()
        msg = parse(
            handle.payload(), sender=handle.peer, what=f"{kind} message", max_bytes=len(handle.buffer), shape=shape
        )
        if kind == "grad":  # parsing a gradient is decoding it (alltoall and gossip count it so too)
            self.times["decode"] += time.perf_counter() - start
        if msg.sender != handle.peer:
            raise RuntimeError(f"{kind} message from rank {handle.peer} claims sender {msg.sender}")
        if kind == "grad":
            self._on_grad(handle.key[1], self.layers[handle.key[2]], msg)
            if handle.peer in self.active:
                self.pending[handle.key] = self.transport.repost(handle)
        elif kind == "values":
            numel = handle.key[2]
            if msg.kind != "params" or msg.layer != VALUES_LAYER or msg.numel != numel:
                raise RuntimeError(
                    f"rank {handle.peer} sent {msg.kind} {msg.layer!r} of {msg.numel} values, expected its {numel} layer values"
                )
            self.collector.on_values(handle.peer, msg)
            self.pending[handle.key] = self.transport.repost(handle)
        else:
            if self.on_control(handle.peer, msg):
                self.pending[handle.key] = self.transport.repost(handle)

    def on_control(self, worker: int, msg: Message) -> bool:
        """A control message from ``worker`` (over MPI or handed over on this rank); False after stop."""
        if msg.kind == "buffers":
            self.collector.on_buffers(worker, msg)
        elif msg.meta.get("op") == "stats":
            if self.collector is not None:
                record = {"step": msg.step, **{k: v for k, v in msg.meta.items() if k != "op"}}
                self.collector.on_stats(record, lr_of=self._schedule_lr, times=self.times)
        elif msg.meta.get("op") == "stop":
            self._on_stop(worker)
            return False
        else:
            raise RuntimeError(f"unknown control message {msg.kind}/{msg.meta.get('op')!r} from rank {worker}")
        return True

    def on_local_grad(self, layer: Layer, msg: Message) -> None:
        """A gradient from the worker on this rank: no wire, no MPI."""
        self._on_grad(self.rank, layer, msg)

    def _codec(self, msg: Message) -> Codec:
        return wire.codec_of(msg)

    def _check_grad(self, worker: int, layer: Layer, msg: Message, *, expected: int, round_: int = 0) -> None:
        Envelope("grad", layer.name, expected, worker, round_).check(msg, shape=layer.shape)

    def _on_grad(self, worker: int, layer: Layer, msg: Message) -> None:
        raise NotImplementedError

    def _apply(self, layer: Layer, grad: torch.Tensor, step: int, skip: bool = False) -> None:
        """One optimizer update of ``layer``, unless a worker marked its gradient skipped or the sum
        is not finite (``--on-nonfinite``: abort names the step and layer; skip leaves it as is)."""
        what = f"step {step}: the gradient sum of {layer.name!r} on server rank {self.rank}"
        if skip_update(grad, what, self.cfg.on_nonfinite, skip):
            return
        start = time.perf_counter()
        self.optimizer.step(layer.name, self.values[layer.index], grad, self._lr(step))
        self.times["apply"] += time.perf_counter() - start

    def _on_stop(self, worker: int) -> None:
        self.active.discard(worker)
        for key, handle in list(self.pending.items()):
            if handle.peer == worker:
                handle.cancel()
                del self.pending[key]

    def _lr(self, step: int) -> float:
        """The LR of the update after ``step`` (with --local-steps, the outer optimizer's)."""
        return update_lr(self.cfg, step, self.ctx.steps_per_epoch, self.num_workers)

    def _schedule_lr(self, step: int) -> float:
        """The schedule's LR at ``step``: the metrics rows' (with --local-steps, the workers')."""
        return learning_rate(self.cfg, step, self.ctx.steps_per_epoch, self.num_workers)

    def has_done(self, step: int) -> bool:
        """Whether every layer this rank owns took the exchanges due by the end of ``step``: its
        gradients of ``step``, or with --local-steps its fragment's exchanges so far."""
        if self.cfg.fragments == 1:  # one count for every layer: the step, or the exchange
            return not self.owned or self.completed_step >= exchanges_done(self.cfg, step, self.ctx.total)
        done = functools.partial(exchanges_done, self.cfg, step, self.ctx.total)
        return all(self.layer_step[i] > done(fragment=self.fragment[i]) for i in self.layer_step)

    def wait_for_evaluation(self, step: int, patience: Patience = SERVER_PATIENCE) -> torch.Tensor:
        """On the metrics rank: serve until every worker's BatchNorm buffers of ``step`` and every
        other server's values are in; return the averaged buffers."""
        others = len(self.other_servers)
        self.serve_until(lambda: self.collector.ready(step, servers=others), patience)
        return self.collector.eval_buffers.pop(step)

    def load_model(self, model: nn.Module, step: int | None = None) -> None:
        """Copy the model's values into ``model``: this rank's layers, and the other servers' sent for ``step``."""
        params = dict(model.named_parameters())
        own = {layer.index: self.values[layer.index] for layer in self.owned}
        for index, flat in self.collector.model_values(own, step).items():
            copy_flat_into(params, self.layers[index].params, flat)

    def take_rows(self) -> list[dict]:
        return self.collector.take_rows() if self.collector is not None else []

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.sums:
            return {"mean_feedback": self.mean_feedback.state_dict()} if self.mean_feedback else {}
        state = {f"value/{i}": v for i, v in self.values.items()}
        state.update({f"shadow/{i}/{w}": v for (i, w), v in self.shadow.items()})
        state.update({f"optim/{k}": v for k, v in self.optimizer.state_dict().items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.sums:
            if self.mean_feedback is not None and "mean_feedback" in state:
                self.mean_feedback.load_state_dict(state["mean_feedback"])
            return
        for key, tensor in state.items():
            if key.startswith("value/"):
                index = int(key.removeprefix("value/"))
                if index not in self.values or self.values[index].numel() != tensor.numel():
                    raise ValueError(
                        f"checkpoint layer {index} does not fit this run's layer plan (written with another "
                        "model, topology, --servers, --granularity or --bucket-vectors?)"
                    )
                self.values[index].copy_(tensor)
            elif key.startswith("shadow/") and self.shadow:
                index, worker = key.removeprefix("shadow/").split("/")
                self.shadow[(int(index), int(worker))].copy_(tensor)
        self.optimizer.load_state_dict(
            {k.removeprefix("optim/"): v for k, v in state.items() if k.startswith("optim/")}
        )
