"""A message's envelope: what it is (kind), which layer and step it belongs to, who sent it and, for
a multi-round codec, which round. A message is an envelope around a codec's payload, put together
once (``Envelope.seal``); an arriving message is held against the envelope its receiver expects in
one place (``Envelope.check``), whatever the engine. ``parse`` reads an arriving message's bytes and
names the rank that sent them when they are malformed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..codecs import Message
from . import wire


class EnvelopeError(RuntimeError):
    """A message arrived that is not the one its receiver expects (another layer, step, sender,
    kind or round): the ranks disagree about where the run is, and it cannot go on."""


@dataclass(frozen=True)
class Envelope:
    """Where a message goes and what it stands for (see the module)."""

    kind: str
    layer: str
    step: int
    sender: int
    round: int = 0

    def seal(self, payload: Message, *, skip: bool = False) -> Message:
        """The message that carries ``payload`` (a codec's encoding) under this envelope.

        1. Kind, layer, step and sender are this envelope's.
        2. The round goes into ``meta`` when it is not 0 (a round the payload names already stays).
        3. ``skip`` marks a gradient every receiver leaves out of this step (``--on-nonfinite skip``).
        The payload is not changed: its arrays are shared, its meta copied."""
        meta = dict(payload.meta)
        if self.round:
            meta["round"] = self.round
        if skip:
            meta["skip"] = 1
        return dataclasses.replace(
            payload, kind=self.kind, step=self.step, layer=self.layer, sender=self.sender, meta=meta
        )

    def check(
        self, msg: Message, *, kinds: tuple[str, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> None:
        """Raise EnvelopeError unless ``msg`` is what this envelope expects: its kind (or one of
        ``kinds``), layer, step, sender and round, and its tensor's ``shape`` when one is given."""
        allowed = kinds or (self.kind,)
        got_round = msg.meta.get("round", 0)
        if (
            msg.kind in allowed
            and msg.layer == self.layer
            and msg.step == self.step
            and msg.sender == self.sender
            and got_round == self.round
            and (shape is None or tuple(msg.shape) == tuple(shape))
        ):
            return
        shown = f" shape {tuple(shape)}" if shape is not None else ""
        raise EnvelopeError(
            f"expected {'/'.join(allowed)} of {self.layer!r} for step {self.step} (round {self.round}){shown} "
            f"from rank {self.sender}, got {msg.kind} of {msg.layer!r} for step {msg.step} (round {got_round})"
            f"{f' shape {tuple(msg.shape)}' if shape is not None else ''} from rank {msg.sender}"
        )


def parse(
    data: bytes | bytearray | memoryview,
    *,
    sender: int,
    what: str,
    max_bytes: int,
    shape: tuple[int, ...] | None = None,
) -> Message:
    """The message in ``data``, which rank ``sender`` sent as ``what`` (``wire.loads``, bounded by
    ``max_bytes`` and the layer's ``shape``); malformed bytes raise ``WireError`` naming the sender
    and what the message was meant to be, so the job that ends on it says whose bytes were bad."""
    try:
        return wire.loads(data, max_bytes=max_bytes, shape=shape)
    except wire.WireError as err:
        raise wire.WireError(f"malformed {what} from rank {sender}: {err}") from None
