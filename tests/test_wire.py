import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psgrad import wire
from psgrad.codecs import Message, make_codec
from psgrad.comm.wire import WireError

SPECS = [
    "none",
    "fp16",
    "topk:ratio=0.1",
    "randomk:ratio=0.1",
    "threshold:v=0.5",
    "terngrad",
    "qsgd",
    "sign",
    "sign:bucket=16",
    "svd:rank=2",
]


def _message(spec="topk:ratio=0.1", shape=(40, 30)):
    msg = make_codec(spec).encode(torch.randn(shape), seed=11)
    msg.kind, msg.step, msg.layer, msg.sender = "grad", 5, "layer1.weight", 2
    return msg


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("compress", ["auto", "always", "never"])
def test_round_trip_preserves_everything(spec, compress):
    msg = _message(spec)
    msg.meta = {"op": "x", "n": 3, "f": 0.5, "b": True}
    back = wire.loads(wire.dumps(msg, compress=compress))
    for field in ("codec", "params", "shape", "dtype", "seed", "kind", "step", "layer", "sender", "meta"):
        assert getattr(back, field) == getattr(msg, field), field
    assert back.arrays.keys() == msg.arrays.keys()
    for key in msg.arrays:
        assert torch.equal(back.arrays[key], msg.arrays[key].contiguous())


@pytest.mark.parametrize("nbytes", [0, 1, 255, 256, 65_535, 65_536, 70_001])
def test_dumps_writes_exactly_what_msgpack_would(nbytes):
    """dumps joins the array bytes itself (one copy); the bytes must be msgpack's own, bin 8,
    bin 16 and bin 32 headers included."""
    arrays = {"values": torch.arange(nbytes, dtype=torch.uint8), "norms": torch.ones(3)}
    msg = Message("none", {}, (nbytes,), "float32", arrays, seed=5, step=2, layer="fc", meta={"skip": True})
    header = msgpack.unpackb(wire.dumps(msg, compress="never"), raw=False)
    assert wire.dumps(msg, compress="never") == msgpack.packb(header, use_bin_type=True)


def test_blosc_pays_on_sorted_index_gaps():
    msg = _message("topk:ratio=0.01", (1 << 16,))
    assert len(wire.dumps(msg)) < 0.8 * len(wire.dumps(msg, compress="never"))


def test_control_message_without_arrays():
    msg = Message("none", {}, (0,), "float32", {}, kind="control", meta={"op": "stop"})
    assert wire.loads(wire.dumps(msg)).meta == {"op": "stop"}


def _header(**changes):
    header = msgpack.unpackb(wire.dumps(_message()), raw=False)
    header.update(changes)
    return msgpack.packb(header, use_bin_type=True)


def _array_change(name, **changes):
    header = msgpack.unpackb(wire.dumps(_message(), compress="never"), raw=False)
    header["arrays"][name].update(changes)
    return msgpack.packb(header, use_bin_type=True)


@pytest.mark.parametrize(
    "buf,fragment",
    [
        (b"", "not a msgpack"),
        (b"\x93\x01\x02\x03", "must be a map"),
        (msgpack.packb({"v": 1}), "keys wrong"),
        (_header(v=2), "version"),
        (_header(kind="evil"), "kind"),
        (_header(dtype="int8"), "dtype"),
        (_header(step=-1), "step"),
        (_header(codec="nope"), "unknown codec"),
        (_header(params={"ratio": 5.0}), "ratio"),
        (_header(shape=[40, 31]), "expected"),
        (_header(shape=[1 << 20] * 3), "elements"),
        (_array_change("values", d="object"), "dtype"),
        (_array_change("values", b=b"\x00" * 7), "bytes"),
        (_array_change("values", s=[1 << 40]), "dimension"),
        (_array_change("gaps", b=(torch.tensor([5000] * 120, dtype=torch.int32).numpy().tobytes())), "beyond"),
        (_array_change("gaps", b=(torch.tensor([3, 0] * 60, dtype=torch.int32).numpy().tobytes())), "increasing"),
        (_array_change("values", z=1), "blosc"),
        (_header(arrays={"values": {"d": "float32", "s": [1], "z": 0, "b": "str"}}), "binary"),
    ],
)
def test_malformed_input_raises_wire_error(buf, fragment):
    with pytest.raises(WireError) as err:
        wire.loads(buf)
    assert fragment in str(err.value)


def test_sign_message_with_scales_for_another_bucket_size_is_refused():
    """A bucketed sign message must carry exactly one scale per bucket its params declare."""
    buf = _forged("sign:bucket=16", 160, params={"bucket": 32})  # 10 scales, 5 buckets declared
    with pytest.raises(WireError, match="scale"):
        wire.loads(buf)
    with pytest.raises(WireError, match="bucket"):
        wire.loads(_forged("sign:bucket=16", 160, params={"bucket": -1}))


def test_size_limit():
    buf = wire.dumps(_message("none", (1000,)))
    with pytest.raises(WireError, match="exceeds the limit"):
        wire.loads(buf, max_bytes=len(buf) - 1)


def test_blosc_claiming_a_huge_size_is_rejected_before_decompressing():
    header = msgpack.unpackb(wire.dumps(_message("qsgd", (1 << 14,)), compress="always"), raw=False)
    data = bytearray(header["arrays"]["levels"]["b"])
    data[4:8] = (1 << 30).to_bytes(4, "little")  # blosc header: uncompressed size
    header["arrays"]["levels"]["b"] = bytes(data)
    with pytest.raises(WireError, match="blosc"):
        wire.loads(msgpack.packb(header, use_bin_type=True))


def _forged(spec: str, numel: int, **header_fields) -> bytes:
    header = msgpack.unpackb(wire.dumps(_message(spec, (numel,)), compress="always"), raw=False)
    header.update(header_fields)
    return msgpack.packb(header, use_bin_type=True)


def test_tiny_message_claiming_a_huge_layer_is_refused_with_the_layer_shape():
    # 1 of 2^31 elements kept: a valid top-k message of ~200 bytes whose decode would allocate 8 GiB
    bomb = _forged("topk:ratio=0.001", 1000, shape=[1 << 31], params={"ratio": 1e-12})
    assert len(bomb) < 300 and wire.loads(bomb).numel == 1 << 31  # well-formed on its own
    with pytest.raises(WireError, match="not the layer's"):
        wire.loads(bomb, shape=(1000,))
    for spec in ("randomk:ratio=0.001", "threshold:v=3.0", "randomk:ratio=0.001,shared=1"):
        with pytest.raises(WireError, match="not the layer's"):
            wire.loads(_forged(spec, 1000, shape=[1 << 28]), shape=(1000,))
    # shared random-k checks its value count without drawing its 2^28 x ratio coordinates
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    shared = _forged("randomk:ratio=0.001,shared=1", 1000, shape=[1 << 31], params={"ratio": 0.5, "shared": True})
    with pytest.raises(WireError, match="values"):
        wire.loads(shared)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KB: nothing drawn


def test_blosc_frame_of_zeros_is_refused_before_decompressing(monkeypatch):
    # an honest none-coded message of 16 MB of zeros compresses to 67 KB, less than a receive
    # buffer for a 20,000-value layer; the declared size is refused before blosc runs
    bound = wire.max_message_bytes("none", (20_000,), "layer1.weight")
    zeros = make_codec("none").encode(torch.zeros(1 << 22), seed=0)
    zeros.kind, zeros.layer = "grad", "layer1.weight"
    bomb = wire.dumps(zeros, compress="always")
    assert len(bomb) < bound < 100_000

    def no_decompress(*args):
        raise AssertionError("decompressed a buffer whose declared size is over the limit")

    monkeypatch.setattr(wire.blosc, "decompress", no_decompress)
    with pytest.raises(WireError, match="declare 16777216 decoded bytes"):
        wire.loads(bomb, max_bytes=bound)


def test_loads_keeps_nothing_of_the_messages_it_read():
    # python-blosc's cbuffer_validate kept a reference to every buffer: ~7 KB a message, the
    # server grew by 300 MB over a 10,000-step soak
    import gc
    import tracemalloc

    buf = wire.dumps(_message("topk:ratio=0.1", (200, 100)), compress="always")
    assert msgpack.unpackb(buf)["arrays"]["gaps"]["z"] == 1
    wire.loads(buf)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(1000):
        wire.loads(buf)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 100_000, f"{grown} bytes kept after 1000 messages"


VALID = [wire.dumps(_message(spec, (33, 17)), compress="always") for spec in SPECS]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes_only_raise_wire_error(data):
    try:
        wire.loads(data)
    except WireError:
        pass


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(range(len(VALID))),
    st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=8),
    st.integers(0, 1 << 20),
)
def test_fuzz_mutated_messages_only_raise_wire_error(which, flips, cut):
    data = bytearray(VALID[which])
    for pos, value in flips:
        data[pos % len(data)] = value
    data = bytes(data[: max(1, cut % (len(data) + 1))])
    try:
        msg = wire.loads(data)
    except WireError:
        return
    # whatever survived validation must decode without error
    make_codec(msg.codec, **msg.params).decode(msg)


def test_fuzzed_messages_raise_only_wire_error():
    """Bit flips, truncations, insertions, random bytes, fields of the wrong type and size bombs
    (huge shapes, params), in valid messages of every codec: ``loads`` raises WireError and nothing
    else, and memory stays flat. Half the messages are read as a receiver does (its bound and the
    layer's shape) and, if accepted, decoded. 10^5 messages here; PSGRAD_FUZZ_MESSAGES=1000000 for
    a longer run."""
    import os
    import random
    import resource

    rng = random.Random(2026)
    torch.manual_seed(2026)  # the valid messages, hence every mutation, do not depend on earlier tests
    valid = []
    for spec in SPECS:
        for compress in ("auto", "always"):
            msg = make_codec(spec).encode(torch.randn(12, 10), seed=1)
            msg.kind, msg.layer = "grad", "w"
            valid.append((wire.dumps(msg, compress=compress), wire.max_message_bytes(spec, (12, 10), "w")))
    weird = [None, [], [1], {}, {"a": 1}, -1, 2**63, 1.5, "x", b"x", True, [[1]]]
    huge = [[1 << 31], [1 << 28], [1 << 16, 1 << 15], [120, 1 << 20]]

    def mutate(buf: bytes) -> bytes:
        b, r = bytearray(buf), rng.random()
        if r < 0.25:
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif r < 0.4:
            b = b[: rng.randrange(len(b))]
        elif r < 0.5:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randint(1, 8))
        elif r < 0.55:
            b = bytearray(rng.randbytes(rng.randint(0, 64)))
        elif r < 0.8:
            header = msgpack.unpackb(bytes(b), raw=False)
            target = header
            if rng.random() < 0.5 and header["arrays"]:
                target = header["arrays"][rng.choice(list(header["arrays"]))]
            target[rng.choice(list(target))] = rng.choice(weird)
            b = bytearray(msgpack.packb(header, use_bin_type=True))
        else:  # size bombs: a huge layer shape, array shape or codec parameter
            header = msgpack.unpackb(bytes(b), raw=False)
            if rng.random() < 0.4:
                header["shape"] = rng.choice(huge)
            elif rng.random() < 0.5 and header["arrays"]:
                header["arrays"][rng.choice(list(header["arrays"]))]["s"] = rng.choice(huge)
            else:
                header["params"] = {k: rng.choice([1e-12, 1e12, 1 << 30, 0]) for k in header["params"]}
            b = bytearray(msgpack.packb(header, use_bin_type=True))
        return bytes(b)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    others = []
    for i in range(int(os.environ.get("PSGRAD_FUZZ_MESSAGES", 100_000))):
        original, bound = rng.choice(valid)
        buf = mutate(original)
        try:
            if i % 2:
                wire.loads(buf)
            else:
                msg = wire.loads(buf, max_bytes=bound, shape=(12, 10))
                make_codec(msg.codec, **msg.params).decode(msg)
        except WireError:
            pass
        except Exception as err:  # the failure this test exists to catch
            others.append(f"{type(err).__name__}: {err}")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert not others, f"{len(others)} non-WireError exceptions, e.g. {others[:3]}"
    assert grown_mb < 100, f"peak RSS grew {grown_mb:.0f} MB"


def _memory_layers():
    from psgrad.comm.protocol import Layer

    return [
        Layer(0, "conv.weight", (4, 3), ("conv.weight",), owner=1),
        Layer(1, "__bias__", (5,), ("a.bias",), owner=1, compress=False),  # exact: no memory
        Layer(2, "fc.weight", (2, 6), ("fc.weight",), owner=1),
        Layer(3, "other.weight", (7,), ("other.weight",), owner=2),  # another server's
    ]


def test_a_servers_down_link_memory_travels_exactly_and_only_its_own_layers():
    from psgrad.engine.downmemory import memory_bound, memory_message, memory_state

    layers = _memory_layers()
    state = {"residual/conv.weight": torch.randn(4, 3), "residual/fc.weight": torch.randn(2, 6)}
    msg = memory_message(state, layers=layers, server=1, step=7, sender=1)
    data = wire.dumps(msg)
    assert len(data) <= memory_bound(layers, 1)
    back = memory_state(wire.loads(data, max_bytes=memory_bound(layers, 1)), layers=layers, server=1)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    # before the first step there is no memory, and none comes back
    empty = wire.loads(wire.dumps(memory_message({}, layers=layers, server=1, step=0, sender=1)))
    assert memory_state(empty, layers=layers, server=1) == {}


def test_a_down_link_memory_that_does_not_fit_the_layer_plan_is_refused():
    from psgrad.engine.downmemory import memory_message, memory_state

    layers = _memory_layers()
    other = memory_message({"residual/other.weight": torch.randn(7)}, layers=layers, server=2, step=0, sender=2)
    with pytest.raises(WireError, match="for server rank 1"):
        memory_state(wire.loads(wire.dumps(other)), layers=layers, server=1)
    with pytest.raises(ValueError, match="same model"):
        memory_message({"residual/conv.weight": torch.randn(5)}, layers=layers, server=1, step=0, sender=1)
