"""Worker: backward hooks encode each gradient and push it at once; forward pre-hooks pull.

Per step (docs/architecture.md has the picture):
1. forward — a pre-hook on each module waits only for *its* parameters' replies from the last
   step, so the pull of late layers overlaps the forward of early ones;
2. post the receives for this step's replies (into per-layer buffers kept across steps);
3. backward — a post-accumulate-grad hook per parameter runs feedback -> codec -> wire and
   ``isend``s the bytes to the layer's server while autograd carries on with earlier layers;
4. wait for the sends, report the step's timings and bytes to server 0.

With ``--push after`` step 3 has no hooks: after backward every layer is coded and sent in
forward order (first layer first), and step 4 does not wait — the sends drain while the next
forward's pre-hooks wait for the first replies.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from . import wire
from .codecs import Message, make_codec
from .config import RunConfig
from .feedback import NoFeedback
from .roles import Layer, Roles
from .transport import TAG_CONTROL, Handle, Transport, layer_tag


def message_seed(run_seed: int, step: int, layer: int, rank: int) -> int:
    """One seed per (run seed, step, layer, rank): random codecs never share a stream."""
    return ((run_seed * 1_000_003 + step) * 65_537 + layer * 4_099 + rank) % (2**63)


_EXACT = make_codec("none")


def encode_gradient(
    feedback: NoFeedback, layer: Layer, grad: torch.Tensor, step: int, rank: int, run_seed: int
) -> bytes:
    """Feedback -> codec -> wire for one layer's gradient: the bytes a worker sends
    (an uncompressed layer skips feedback and codec: it goes exact)."""
    grad = grad.detach().reshape(layer.shape)
    if layer.compress:
        msg = feedback.encode(layer.name, grad, message_seed(run_seed, step, layer.index, rank))
    else:
        msg = _EXACT.encode(grad)
    msg.kind, msg.step, msg.layer, msg.sender = "grad", step, layer.name, rank
    return wire.dumps(msg)


def layer_grad(params: dict[str, torch.Tensor], layer: Layer) -> torch.Tensor:
    """``layer``'s gradient as one flat tensor (zeros for parameters that got none)."""
    parts = [
        (params[n].grad if params[n].grad is not None else torch.zeros_like(params[n])).reshape(-1)
        for n in layer.params
    ]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class GradientGate:
    """Tells when the last parameter of a layer got its gradient in this step's backward.

    Per-parameter hooks fire one at a time; a layer of several parameters (the 1-D bucket) is
    complete only with the last of them.
    """

    def __init__(self, layers: list[Layer]) -> None:
        self.layers = layers
        self.reset()

    def reset(self) -> None:
        self.missing = {layer.index: len(layer.params) for layer in self.layers}

    def arrived(self, layer: Layer) -> bool:
        """Count one parameter of ``layer`` in; True when it was the last one."""
        self.missing[layer.index] -= 1
        return self.missing[layer.index] == 0


def upload_bound(cfg: RunConfig, layer: Layer) -> int:
    """Largest gradient message a worker may send for ``layer`` (DGC warm-up sends more early on)."""
    if not layer.compress:
        return wire.max_message_bytes("none", layer.shape, layer.name)
    spec = cfg.codec
    codec = make_codec(spec)
    if cfg.feedback == "dgc" and cfg.dgc_warmup_epochs > 0 and "ratio" in codec.params:
        spec = make_codec(codec.name, **{**codec.params, "ratio": max(0.25, float(codec.params["ratio"]))}).spec
    return wire.max_message_bytes(spec, layer.shape, layer.name)


def buffers_vector(model: nn.Module) -> torch.Tensor:
    """All floating BatchNorm statistics as one fp32 vector (integer counters are not averaged)."""
    tensors = [b.detach().float().view(-1) for b in model.buffers() if b.is_floating_point()]
    return torch.cat(tensors) if tensors else torch.zeros(0)


def load_buffers_vector(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for b in model.buffers():
        if b.is_floating_point():
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()


@dataclass
class StepStats:
    step: int = 0
    loss: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    encode: float = 0.0
    push_wait: float = 0.0
    pull_wait: float = 0.0
    decode: float = 0.0
    apply: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    step_time: float = 0.0


def control_message(op: str, sender: int, step: int = 0, **meta) -> Message:
    return Message("none", {}, (0,), "float32", {}, kind="control", step=step, sender=sender, meta={"op": op, **meta})


class Worker:
    """Trains ``model`` through the parameter servers; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        transport: Transport,
        roles: Roles,
        layers: list[Layer],
        cfg: RunConfig,
        feedback: NoFeedback,
        device: torch.device,
    ) -> None:
        self.model, self.transport, self.roles, self.layers, self.cfg = model, transport, roles, layers, cfg
        self.feedback, self.device = feedback, device
        self.rank = transport.rank
        self.params = dict(model.named_parameters())
        self.layer_of = {name: layer for layer in layers for name in layer.params}
        self.down_codec = make_codec(cfg.down_codec)
        self.exact_codec = make_codec("none")
        # the first message of a layer is its exact value, later ones may be the down-codec's deltas
        self.bounds = [
            max(
                wire.max_message_bytes(spec, layer.shape, layer.name)
                for spec in ({cfg.down_codec, "none"} if layer.compress else {"none"})
            )
            for layer in layers
        ]
        self.buffers = [bytearray(b) for b in self.bounds]
        self.pulls: dict[int, Handle] = {}
        self.pull_step = 0
        self.sends: list[Handle] = []
        self.sent: set[int] = set()
        self.step = 0
        self.gate = GradientGate(layers)
        self.stats = StepStats()
        self.doing = "starting"
        self._hooks = []
        if cfg.granularity == "layer" and cfg.push == "backward":
            for name, param in self.params.items():
                if param.requires_grad:
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._grad_ready(name)))
        for prefix, module in model.named_modules():
            own = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False)]
            if own:
                indices = sorted({self.layer_of[n].index for n in own})
                self._hooks.append(module.register_forward_pre_hook(self._pull_before(indices)))

    # ------------------------------------------------------------------ pull
    def post_pulls(self, step: int) -> None:
        """Post receives for the parameters the servers will send for ``step``."""
        self.pull_step = step
        for layer in self.layers:
            self.pulls[layer.index] = self.transport.irecv(
                self.bounds[layer.index], layer.owner, layer_tag(layer.index), layer.index, self.buffers[layer.index]
            )

    def _pull_before(self, indices: list[int]):
        def hook(module, inputs):
            for index in indices:
                self.finish_pull(index)

        return hook

    def finish_pull(self, index: int) -> None:
        handle = self.pulls.pop(index, None)
        if handle is None:
            return
        start = time.perf_counter()
        self.transport.wait(handle)
        self.stats.pull_wait += time.perf_counter() - start
        self.stats.bytes_down += handle.count
        start = time.perf_counter()
        layer = self.layers[index]
        msg = wire.loads(handle.payload(), max_bytes=self.bounds[index])
        if (
            msg.kind not in ("params", "delta")
            or msg.layer != layer.name
            or msg.step != self.pull_step
            or msg.sender != layer.owner
        ):
            raise RuntimeError(
                f"expected params of {layer.name!r} for step {self.pull_step} from rank {layer.owner}, got {msg.kind} {msg.layer!r} step {msg.step} from rank {msg.sender}"
            )
        if msg.codec not in (self.down_codec.name, "none"):
            raise RuntimeError(f"{layer.name!r} arrived encoded with {msg.codec!r}, expected {self.down_codec.name!r}")
        codec = self.down_codec if msg.codec == self.down_codec.name else self.exact_codec
        if msg.kind == "delta" and len(layer.params) == 1:
            # the common case: decode straight into the parameter, no dense temporary
            with torch.no_grad():
                codec.decode_add(msg, self.params[layer.params[0]])
            self.stats.decode += time.perf_counter() - start
            return
        values = codec.decode(msg, device=self.device).view(-1)
        mid = time.perf_counter()
        with torch.no_grad():
            offset = 0
            for name in layer.params:
                param = self.params[name]
                part = values[offset : offset + param.numel()].view_as(param)
                if msg.kind == "delta":
                    param.add_(part)
                else:
                    param.copy_(part)
                offset += param.numel()
        self.stats.decode += mid - start
        self.stats.apply += time.perf_counter() - mid

    def finish_pulls(self) -> None:
        for index in list(self.pulls):
            self.finish_pull(index)

    # ------------------------------------------------------------------ push
    def _grad_ready(self, name: str):
        def hook(param: torch.Tensor) -> None:
            layer = self.layer_of[name]
            if self.gate.arrived(layer):
                self.push(layer, layer_grad(self.params, layer))

        return hook

    def push(self, layer: Layer, grad: torch.Tensor) -> None:
        """Encode ``grad`` of ``layer`` (feedback -> codec -> wire) and isend it to its server."""
        start = time.perf_counter()
        data = encode_gradient(self.feedback, layer, grad, self.step, self.rank, self.cfg.seed)
        self.sends.append(self.transport.isend(data, layer.owner, layer_tag(layer.index)))
        self.stats.bytes_up += len(data)
        self.sent.add(layer.index)
        self.sends = self.transport.progress(self.sends)
        self.stats.encode += time.perf_counter() - start

    def push_missing(self) -> None:
        """Layers whose hook did not fire (model granularity, ``--push after``, unused parameters) are
        sent now, in forward order: the server can return the first layers first."""
        for layer in self.layers:
            if layer.index not in self.sent:
                self.push(layer, layer_grad(self.params, layer))

    # ------------------------------------------------------------------ step
    def train_step(self, step: int, images: torch.Tensor, labels: torch.Tensor, loss_fn) -> StepStats:
        self.step, self.sent, self.stats = step, set(), StepStats(step=step)
        self.gate.reset()
        start = time.perf_counter()
        self.doing = f"step {step}: forward"
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        loss = loss_fn(self.model(images.to(self.device)), labels.to(self.device))
        self.finish_pulls()
        t_fwd = time.perf_counter()
        self.post_pulls(step + 1)
        self.doing = f"step {step}: backward"
        loss.backward()
        self.push_missing()
        t_bwd = time.perf_counter()
        self.doing = f"step {step}: waiting for sends"
        if self.cfg.push == "after":
            # the sends drain while the next forward waits for its first layers
            self.sends = self.transport.progress(self.sends)
        else:
            self.transport.wait_all(self.sends)
            self.sends = []
        end = time.perf_counter()
        s = self.stats
        s.loss = float(loss.detach())
        s.forward = (t_fwd - start) - s.pull_wait - s.decode - s.apply
        s.backward = (t_bwd - t_fwd) - s.encode
        s.push_wait = end - t_bwd
        s.step_time = end - start
        return s

    def report(self, stats: StepStats) -> None:
        """Send the step's numbers to server 0 (it writes metrics.csv and drives the progress bar).

        Stats, BatchNorm buffers and stop share one tag: MPI keeps messages of one (source, tag)
        in order, so ``stop`` can never overtake the last stats or buffers.
        """
        msg = control_message("stats", self.rank, stats.step, **{k: v for k, v in asdict(stats).items() if k != "step"})
        self.sends.append(self.transport.isend(wire.dumps(msg), self.roles.server_ranks[0], TAG_CONTROL))

    def send_buffers(self, step: int) -> None:
        """BatchNorm statistics to server 0, which averages them over workers before evaluating."""
        flat = buffers_vector(self.model)
        msg = make_codec("none").encode(flat)
        msg.kind, msg.step, msg.layer, msg.sender = "buffers", step, "__buffers__", self.rank
        self.sends.append(self.transport.isend(wire.dumps(msg), self.roles.server_ranks[0], TAG_CONTROL))

    def stop(self) -> None:
        """Tell every server this worker is done, after the last step's parameters arrived."""
        self.doing = "stopping"
        self.finish_pulls()
        for server in self.roles.server_ranks:
            self.sends.append(
                self.transport.isend(wire.dumps(control_message("stop", self.rank, self.step)), server, TAG_CONTROL)
            )
        self.transport.wait_all(self.sends)
        self.sends = []
        for hook in self._hooks:
            hook.remove()
