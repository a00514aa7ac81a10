"""psgrad's codecs inside torch DDP: a communication hook, with no MPI and no server.

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(ddp, psgrad.ddp_hook("qsgd:levels=16", feedback="ef"))

DDP calls the hook with each bucket of gradients once backward has filled it, and takes what the
hook returns as the bucket's average over the ranks. The hook hands the bucket to its thread
(``InOrder``) and returns a future at once, so backward goes on while the bucket is exchanged, as
with DDP's own all-reduce. The thread exchanges the buckets one at a time, in the order DDP handed
them over (the same on every rank), over a gloo group of its own: its collectives can then never
pair up with DDP's, or the script's, in another order on another rank. Per bucket, on every rank:
0. One small all-reduce tells every rank whose bucket holds NaN or Inf: then every rank raises
   (from backward), or, with ``on_nonfinite="skip"``, returns the bucket as NaN for GradScaler.
1. Each parameter's gradient is coded as a ``psgrad train`` worker codes it: feedback, then the
   codec, with the same seeds (run seed, step, layer index, this rank's stream). A 1-D parameter
   goes exact, as in ``psgrad train`` (``bucket_vectors``).
2. Messages that sum in code space (``Codec.sums_in_code_space``: exact values, shared random-k,
   PowerSGD's rounds) are summed by one all-reduce of their arrays, laid end to end. PowerSGD
   takes two, as through its server: the P factors, then, once every rank has orthonormalized
   their sum, the Q factors.
3. Every other message travels as wire bytes (msgpack, never pickle): one all-gather of the sizes,
   then one of the bytes. Each rank parses the others' messages (``wire.loads``, bounded by the
   layer) and decodes all of them in rank order, as a server would.
4. The sums, times 1 / world size, are written over the bucket, which the returned future holds.
A bucket on a GPU is copied to the host first and its average back (gloo and the wire work in host
memory), so there the coding is the CPU's work.
The step count goes up after DDP's last bucket of a backward pass. ``state_dict`` carries it and
the feedback memories, so a checkpoint resumes compression exactly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .accuracy import accuracy_note
from .codecs import Message
from .comm import wire
from .comm.envelope import Envelope, parse
from .comm.protocol import Layer, NonFiniteError, encode_gradient, plan_layers, upload_bound
from .config import RunConfig
from .config.refusals import your_loop_config
from .feedback import feedback_for
from .inorder import InOrder
from .metrics import say

SETTINGS = ("seed", "bucket_vectors", "on_nonfinite", "dgc_momentum", "nesterov", "dgc_clip_norm", "dgc_warmup_epochs")
"""The ``RunConfig`` settings the hook takes besides the codec and feedback (docs/cli.md)."""


def ddp_hook(
    codec: str = "none",
    *,
    feedback: str = "none",
    model: nn.Module | None = None,
    group: Any = None,
    **settings: Any,
) -> DDPHook:
    """A DDP communication hook that sends every gradient through ``codec`` (see the module).

    ``model`` names the parameters (their names set the seeds and the checkpoint's keys); without
    it, the hook takes them from its ``state`` when that is the model or the DDP wrapper:
    ``ddp.register_comm_hook(ddp, hook)``. ``group``: DDP's process group, when not the default.
    ``settings``: the run settings of ``SETTINGS``, as ``psgrad train`` takes them."""
    cfg = your_loop_config(
        {"codec": codec, "feedback": feedback, **settings},
        caller="psgrad.ddp_hook",
        takes=["codec", "feedback", *SETTINGS],
    )
    return DDPHook(cfg, model=model, group=group)


class DDPHook:
    """The hook ``ddp_hook`` makes: call it as DDP does, ``hook(state, bucket)``."""

    def __init__(self, cfg: RunConfig, *, model: nn.Module | None, group: Any) -> None:
        self.cfg, self.model, self.group = cfg, model, group
        self.feedback = feedback_for(cfg)
        self.step = 0
        self.layers: dict[int, Layer] | None = None  # id(parameter) -> its layer, from the first call
        self.world = self.rank = 0  # DDP's ranks and this one among them, from the first call
        self.exchange_group: Any = None  # the hook thread's own process group, from the first call
        self.exchanges = InOrder(name="psgrad-ddp-exchange")
        self.buckets: list[Bucket] | None = []  # the buckets of a backward, until DDP's are judged
        self.backwards_watched = 0
        self.__name__ = self.__qualname__ = "psgrad_ddp_hook"  # DDP logs a hook by its name

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The step and every feedback memory (error residuals, PowerSGD's error and Q)."""
        return {"step": torch.tensor(self.step), **self.feedback.state_dict()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """What ``state_dict`` gave; a ValueError for another hook's or optimizer's state."""
        state = dict(state)
        if "step" not in state:
            raise ValueError(f"not a psgrad.ddp_hook state_dict (no 'step' among {sorted(state)[:4]})")
        self.feedback.load_state_dict({key: value for key, value in state.items() if key != "step"})
        self.step = int(state["step"])

    def set_epoch(self, epoch: int) -> None:
        """For schedules that follow the epoch (``--feedback dgc``'s sparsity warm-up)."""
        self.feedback.set_epoch(epoch)

    # ------------------------------------------------------------------ the hook
    # no annotations: DDP checks them, and this module's are strings (from __future__)
    def __call__(self, state, bucket):
        """DDP's call: ``bucket`` (a ``dist.GradBucket``) averaged over the ranks, in a future that
        the hook's thread completes while DDP goes on with backward."""
        if self.layers is None:
            # the first call: where the hook first knows its rank, and where every rank calls it;
            # the layers are kept last, so that a call after a failed first one is a first call again
            layers_by_param = self._plan(self._named_model(state))
            self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
            self.exchange_group = exchange_group(self.group)
            self.layers = layers_by_param
            if self.rank == 0 and (note := accuracy_note(self.cfg, dense="DDP without the hook")):
                say(f"[psgrad] {note}")
        buffer, layers = bucket.buffer(), self._layers_of(bucket.parameters())
        step, index = self.step, bucket.index()  # the steps done before this one, as a worker numbers them
        if self.buckets is not None:
            self._watch_buckets(bucket)
        if bucket.is_last():
            self.step = step + 1
        written = written_event(buffer)

        def exchange() -> torch.Tensor:
            host = on_host(buffer, written=written)
            mean = self._exchange(host, layers=layers, step=step, index=index)
            return mean if mean is buffer else buffer.copy_(mean)

        return self.exchanges.submit(exchange, devices=[buffer.device] if buffer.is_cuda else None)

    def _watch_buckets(self, bucket: dist.GradBucket) -> None:
        """Rank 0 says if DDP's buckets leave little to overlap (``overlap_note``), once, from the
        second backward the hook sees: DDP sets its lasting buckets by the order the first backward
        filled them (unless it looks for unused parameters, it takes that first one in one bucket)."""
        assert self.buckets is not None
        self.buckets.append(Bucket.of(bucket))
        if not bucket.is_last():
            return
        self.backwards_watched += 1
        if self.backwards_watched == 2:
            if self.rank == 0 and (note := overlap_note(self.buckets)):
                say(f"[psgrad] {note}")
            self.buckets = None
        else:
            self.buckets = []

    @torch.no_grad()  # the thread's own grad mode is on; nothing here is for autograd
    def _exchange(self, buffer: torch.Tensor, *, layers: list[Layer], step: int, index: int) -> torch.Tensor:
        """Steps 1-4 of the module for one bucket, on the hook's thread: ``buffer`` averaged."""
        parts = buffer.split([math.prod(layer.shape) for layer in layers])
        bad = self._nonfinite_ranks(parts)
        if bad and self.cfg.on_nonfinite == "abort":
            raise NonFiniteError(
                f"step {step}: the gradient of rank {', '.join(map(str, bad))} holds NaN or Inf in DDP's bucket "
                f"{index} (lower the learning rate; under GradScaler, on_nonfinite='skip')"
            )
        if bad:
            return buffer.fill_(float("nan"))  # GradScaler sees it and skips the step; the memories stay
        msgs = [
            encode_gradient(
                self.feedback, layer, part, step=step, sender=self.rank, stream=self.rank, run_seed=self.cfg.seed
            )
            for layer, part in zip(layers, parts, strict=True)
        ]
        means = [torch.zeros(part.numel()) for part in parts]
        summed = {i for i, msg in enumerate(msgs) if wire.codec_of(msg).sums_in_code_space}
        gathered = [i for i in range(len(msgs)) if i not in summed]
        self._sum_in_code_space({i: msgs[i] for i in summed}, layers=layers, means=means)
        if gathered:
            self._gather_and_decode(gathered, msgs=msgs, layers=layers, means=means, step=step)
        for part, mean in zip(parts, means, strict=True):
            part.copy_(mean)
        return buffer

    def _layers_of(self, params: list[torch.Tensor]) -> list[Layer]:
        assert self.layers is not None
        try:
            return [self.layers[id(p)] for p in params]
        except KeyError:
            raise RuntimeError("psgrad.ddp_hook: DDP's bucket holds a parameter the model did not name") from None

    def _named_model(self, state: Any) -> nn.Module:
        module = self.model if self.model is not None else state
        module = getattr(module, "module", module)  # DDP wraps the model as .module
        if not isinstance(module, nn.Module):
            raise TypeError(
                "psgrad.ddp_hook needs the model's parameter names: register it with the model as its state, "
                "ddp.register_comm_hook(ddp, psgrad.ddp_hook(...)), or pass model=..."
            )
        return module

    def _plan(self, module: nn.Module) -> dict[int, Layer]:
        """psgrad train's layers of ``module`` (same indices, so the same seeds), one per parameter:
        a member of the exact 1-D bucket becomes an exact layer of its own."""
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        shapes = {name: tuple(p.shape) for name, p in named}
        plan = plan_layers(list(shapes.items()), granularity="layer", owners=1, bucket_vectors=self.cfg.bucket_vectors)
        by_name: dict[str, Layer] = {}
        for layer in plan:
            for name in layer.params:
                by_name[name] = dataclasses.replace(layer, name=name, shape=shapes[name], params=(name,))
        return {id(p): by_name[name] for name, p in named}

    def _nonfinite_ranks(self, parts: Iterable[torch.Tensor]) -> list[int]:
        """The ranks whose bucket holds NaN or Inf (one small all-reduce): every rank learns it at
        once, so all of them stop or skip together instead of some waiting for ever."""
        flags = torch.zeros(self.world)
        flags[self.rank] = float(not all(bool(torch.isfinite(p.sum())) for p in parts))
        dist.all_reduce(flags, group=self.exchange_group)
        return [r for r in range(self.world) if flags[r] > 0]

    # ------------------------------------------------------------------ sums in code space
    def _sum_in_code_space(
        self, pending: dict[int, Message], *, layers: list[Layer], means: list[torch.Tensor]
    ) -> None:
        """Step 2 of the module: all-reduce the arrays; a round that is not the last answers the
        reduced reply with the next round's message, which is summed in the next pass."""
        while pending:
            totals = self._all_reduce_arrays(pending)
            following: dict[int, Message] = {}
            for i, msg in pending.items():
                codec, layer, round_ = wire.codec_of(msg), layers[i], int(msg.meta.get("round", 0))
                if round_ == 0:
                    total = dataclasses.replace(msg, arrays=totals[i])
                    codec.decode_add(total, means[i], alpha=1.0 / self.world)
                    continue
                reply = codec.reduce(round_, totals[i], self.world)
                if round_ < codec.rounds(layer.shape):
                    following[i] = self.feedback.advance(layer.name, layer.shape, round_, reply)
                else:
                    means[i] = self.feedback.finish(layer.name, reply)
            pending = following

    def _all_reduce_arrays(self, messages: dict[int, Message]) -> dict[int, dict[str, torch.Tensor]]:
        order = [(i, name) for i, msg in sorted(messages.items()) for name in sorted(msg.arrays)]
        arrays = [messages[i].arrays[name].float().reshape(-1) for i, name in order]
        flat = torch.cat(arrays) if arrays else torch.zeros(0)
        dist.all_reduce(flat, group=self.exchange_group)
        totals: dict[int, dict[str, torch.Tensor]] = {i: {} for i in messages}
        for (i, name), part in zip(order, flat.split([a.numel() for a in arrays]), strict=True):
            totals[i][name] = part.view(messages[i].arrays[name].shape)
        return totals

    # ------------------------------------------------------------------ the others: gather, decode
    def _gather_and_decode(
        self,
        gathered: list[int],
        *,
        msgs: list[Message],
        layers: list[Layer],
        means: list[torch.Tensor],
        step: int,
    ) -> None:
        """Step 3 of the module."""
        blobs = self._all_gather_bytes(frame([wire.dumps(msgs[i]) for i in gathered]))
        for sender, blob in enumerate(blobs):
            pieces = unframe(blob, count=len(gathered))
            for i, piece in zip(gathered, pieces, strict=True):
                layer = layers[i]
                if sender == self.rank:
                    msg = msgs[i]  # the wire is lossless: parsing our own bytes would give it back
                else:
                    msg = parse(
                        piece,
                        sender=sender,
                        what=f"gradient of {layer.name!r}",
                        max_bytes=upload_bound(self.feedback, layer),
                        shape=layer.shape,
                    )
                    Envelope("grad", layer.name, step, sender).check(msg, shape=layer.shape)
                wire.codec_of(msg).decode_add(msg, means[i], alpha=1.0 / self.world)

    def _all_gather_bytes(self, blob: bytes) -> list[bytes]:
        size = torch.tensor([len(blob)], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        dist.all_gather(sizes, size, group=self.exchange_group)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        theirs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(theirs, mine, group=self.exchange_group)
        return [t[: int(s)].numpy().tobytes() for t, s in zip(theirs, sizes, strict=True)]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """What the overlap note needs of one of DDP's buckets: its size and its largest parameter's, in bytes."""

    size: int
    largest: int

    @classmethod
    def of(cls, bucket: dist.GradBucket) -> Bucket:
        itemsize = bucket.buffer().element_size()
        return cls(
            size=bucket.buffer().numel() * itemsize,
            largest=max((p.numel() for p in bucket.parameters()), default=0) * itemsize,
        )


SMALLEST_WORTH_A_NOTE = 2**20  # bytes: a last bucket under 1 MiB is too quick to send to matter


def overlap_note(buckets: list[Bucket]) -> str | None:
    """A sentence when DDP's last bucket, which only the end of backward fills, holds more than half
    of the gradient and could be split: its exchange overlaps nothing, so smaller buckets let most of
    the exchange go on during backward. None when the buckets already overlap, when the last one is
    small, or when one parameter alone fills it (smaller buckets would not split that)."""
    total, last = sum(bucket.size for bucket in buckets), buckets[-1]
    if last.size < SMALLEST_WORTH_A_NOTE or 2 * last.size <= total or 2 * last.largest > total:
        return None
    return (
        f"note: DDP's last bucket holds {last.size / total:.0%} of the gradient ({last.size / 2**20:.1f} MiB), "
        "and backward fills it only at its end, so the hook's exchange of it overlaps nothing: "
        "DistributedDataParallel(model, bucket_cap_mb=1) splits it (docs/api.md)"
    )


def written_event(buffer: torch.Tensor) -> Any:
    """A CUDA event after the work queued to write ``buffer`` (None off CUDA): recorded where DDP
    calls the hook, on the stream backward wrote the bucket on, for the hook's thread to wait on."""
    if not buffer.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(buffer.device))
    return event


def on_host(buffer: torch.Tensor, *, written: Any) -> torch.Tensor:
    """``buffer`` in host memory, where gloo exchanges and psgrad's wire reads: the buffer itself on
    the CPU, else a copy made once the bucket is written (``written``, from ``written_event``)."""
    if buffer.device.type == "cpu":
        return buffer
    if written is not None:
        written.synchronize()
    return buffer.to("cpu")


def exchange_group(group: Any) -> Any:
    """A gloo group over DDP's ranks (same order) for the hook's thread alone. Its collectives then
    cannot interleave with those of DDP or of the script on ``group``, which the main thread
    issues: two threads' collectives on one group would pair up in another order on each rank.
    A RuntimeError under the ``mpi`` backend, which has no store to make a gloo group through."""
    if dist.get_backend(group) == "mpi":
        raise RuntimeError(
            "psgrad.ddp_hook exchanges over a gloo group of its own, made through torch.distributed's store, "
            "and the mpi backend has none: init_process_group with gloo or nccl (env:// or tcp://) instead"
        )
    if group is None or group is dist.GroupMember.WORLD:
        return dist.new_group(backend="gloo")  # every rank calls the hook: each makes this group
    ranks = dist.get_process_group_ranks(group)
    # Only DDP's ranks call the hook. Made the usual way, the group would move the count that names
    # groups on them alone, and the next group the whole job makes would meet under two names.
    return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True, sort_ranks=False)


def frame(pieces: list[bytes]) -> bytes:
    """``pieces`` end to end behind their count and lengths (little-endian uint64)."""
    return np.array([len(pieces), *map(len, pieces)], dtype="<u8").tobytes() + b"".join(pieces)


def unframe(blob: bytes, *, count: int) -> list[bytes]:
    """The pieces ``frame`` joined; ``WireError`` unless ``blob`` holds exactly ``count`` of them."""
    head = 8 * (count + 1)
    if len(blob) < head:
        raise wire.WireError(f"a bucket of {len(blob)} bytes is shorter than its {count} lengths")
    lengths = np.frombuffer(blob[:head], dtype="<u8")
    if int(lengths[0]) != count or head + sum(map(int, lengths[1:])) != len(blob):
        raise wire.WireError(f"a bucket's framing does not hold {count} messages in {len(blob)} bytes")
    pieces, start = [], head
    for length in map(int, lengths[1:]):
        pieces.append(blob[start : start + length])
        start += length
    return pieces
