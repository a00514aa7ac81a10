import pytest
import torch

from psgrad.codecs import make_codec
from psgrad.feedback import DGCMemory, ErrorFeedback, dgc_sparsity, make_feedback


@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "sign", "qsgd:levels=2", "svd:rank=1", "threshold:v=1.5"])
def test_error_feedback_conserves_mass(spec):
    """sum of everything sent + the residual == sum of everything put in."""
    torch.manual_seed(0)
    memory = ErrorFeedback(make_codec(spec))
    sent = torch.zeros(12, 10)
    inputs = torch.zeros(12, 10)
    for step in range(20):
        grad = torch.randn(12, 10)
        inputs += grad
        msg = memory.encode("w", grad, seed=step)
        sent += memory.codec.decode(msg)
    torch.testing.assert_close(sent + memory.residuals["w"], inputs, rtol=1e-4, atol=1e-4)
    assert memory.residuals["w"].abs().sum() > 0  # the test would be empty for a lossless codec


def test_error_feedback_layers_are_separate():
    memory = ErrorFeedback(make_codec("topk:ratio=0.1"))
    memory.encode("a", torch.randn(50), 0)
    memory.encode("b", torch.randn(7), 0)
    assert memory.residuals["a"].shape == (50,) and memory.residuals["b"].shape == (7,)


def test_dgc_sparsity_warmup():
    assert [round(dgc_sparsity(e, 4), 6) for e in range(6)] == [0.75, 0.9375, 0.984375, 0.996094, 0.999, 0.999]


def test_dgc_warmup_changes_codec_ratio():
    memory = DGCMemory(make_codec("topk:ratio=0.001"), warmup_epochs=4)
    memory.set_epoch(0)
    assert memory.codec.params["ratio"] == pytest.approx(0.25)
    memory.set_epoch(10)
    assert memory.codec.params["ratio"] == pytest.approx(0.001)


def test_dgc_momentum_correction_and_masking():
    memory = DGCMemory(make_codec("topk:ratio=0.25"), momentum=0.5)
    g = torch.tensor([4.0, 1.0, 0.5, 0.25])
    sent = memory.codec.decode(memory.encode("w", g, 0))
    assert sent.tolist() == [4.0, 0.0, 0.0, 0.0]
    # masked coordinate 0 has no momentum left; the others accumulate u and v
    assert memory.momentums["w"].tolist() == [0.0, 1.0, 0.5, 0.25]
    sent = memory.codec.decode(memory.encode("w", torch.zeros(4), 1))
    # v = v + u with u = 0.5 * u: coordinate 1 has 1 + 0.5 = 1.5
    assert sent.tolist() == [0.0, 1.5, 0.0, 0.0]


def test_dgc_clipping():
    memory = DGCMemory(make_codec("none"), momentum=0.0, clip_norm=1.0)
    out = memory.codec.decode(memory.encode("w", torch.tensor([3.0, 4.0]), 0))
    torch.testing.assert_close(out, torch.tensor([0.6, 0.8]))


@pytest.mark.parametrize("kind", ["ef", "dgc"])
def test_state_round_trip(kind, tmp_path):
    first = make_feedback(kind, make_codec("topk:ratio=0.2"))
    for step in range(3):
        first.encode("w", torch.randn(20), step)
    torch.save(first.state_dict(), tmp_path / "m.pt")
    second = make_feedback(kind, make_codec("topk:ratio=0.2"))
    second.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    g = torch.randn(20)
    assert torch.equal(first.codec.decode(first.encode("w", g, 9)), second.codec.decode(second.encode("w", g, 9)))


@pytest.mark.parametrize(
    "kind, spec, saved_as",
    [("ef", "topk:ratio=0.2", ("dgc", "topk:ratio=0.2")), ("dgc", "topk:ratio=0.2", ("ef", "topk:ratio=0.2")),
     ("none", "powersgd:rank=2", ("ef", "qsgd:levels=4")), ("none", "qsgd:levels=4", ("ef", "qsgd:levels=4"))],
)  # fmt: skip
def test_a_state_saved_by_another_memory_is_refused_by_name(kind, spec, saved_as):
    """A checkpoint from a run with another feedback or codec: its keys would land where nothing
    reads them (the memory silently starting afresh), so the load names them instead."""
    other = make_feedback(saved_as[0], make_codec(saved_as[1]))
    other.encode("w", torch.randn(4, 5), 0)
    with pytest.raises(ValueError, match="saved with another feedback or codec"):
        make_feedback(kind, make_codec(spec)).load_state_dict(other.state_dict())


@pytest.mark.parametrize(
    "kind, spec", [("ef", "qsgd:levels=4"), ("dgc", "topk:ratio=0.2"), ("none", "powersgd:rank=2")]
)
def test_a_memory_saved_for_another_model_is_refused_at_its_layer(kind, spec):
    """A memory of one element would broadcast over the gradient without a word; any other
    shape would fail inside the arithmetic."""
    saved = make_feedback(kind, make_codec(spec))
    saved.encode("w", torch.randn(1, 1) if kind != "none" else torch.randn(32, 24), 0)
    memory = make_feedback(kind, make_codec(spec))
    memory.load_state_dict(saved.state_dict())
    with pytest.raises(ValueError, match="saved for another model"):
        memory.encode("w", torch.randn(32, 16), 1)


def test_unknown_feedback():
    with pytest.raises(ValueError, match="unknown feedback"):
        make_feedback("bogus", make_codec("none"))


@pytest.mark.parametrize(
    "spec, bounded",
    [
        ("randomk:ratio=0.01", False),
        ("randomk:ratio=0.1", False),
        ("randomk:ratio=0.1,shared=1", True),  # the same coordinates, not rescaled: contractive
        ("topk:ratio=0.01", True),
        ("sign", True),
    ],
)
def test_error_feedback_memory_stays_bounded_only_for_contractive_codecs(spec, bounded):
    torch.manual_seed(0)
    ef = ErrorFeedback(make_codec(spec))
    for step in range(300):
        grad = torch.randn(10_000)
        ef.encode("layer", grad, seed=step)
    ratio = float(ef.residuals["layer"].norm() / grad.norm())
    assert (ratio < 10) == bounded, ratio
    assert make_codec(spec).feedback_safe == bounded


def test_feedback_and_down_link_refuse_rescaling_codecs():
    from psgrad.config import RunConfig

    with pytest.raises(ValueError, match="--feedback ef around randomk:ratio=0.01 diverges") as refused:
        RunConfig(codec="randomk:ratio=0.01", feedback="ef").validate()
    assert "or randomk:ratio=0.01,shared=1" in str(refused.value)  # the variant that works is named
    with pytest.raises(ValueError, match="--down-codec randomk:ratio=0.01 diverges") as refused:
        RunConfig(down_codec="randomk:ratio=0.01").validate()
    assert "use randomk:ratio=0.01,shared=1" in str(refused.value)
    RunConfig(codec="randomk:ratio=0.01").validate()  # plain random-k (no memory) is fine
    RunConfig(codec="randomk:ratio=0.01,shared=1", feedback="ef", down_codec="randomk:ratio=0.01,shared=1").validate()


@pytest.mark.parametrize("spec", ["sign", "topk:ratio=0.1", "qsgd:levels=4", "none"])
def test_encode_residual_is_encode_then_subtract_decoded(spec):
    codec = make_codec(spec)
    x = torch.randn(1000) * 3
    x[::7] = 0.0  # exact zeros: sign sends them as +scale, the residual must say so
    residual = x.clone()
    msg = codec.encode_residual(residual, seed=5)
    reference = codec.encode(x, seed=5)
    assert msg.arrays.keys() == reference.arrays.keys()
    for key in msg.arrays:
        torch.testing.assert_close(msg.arrays[key], reference.arrays[key], rtol=1e-6, atol=0)
    torch.testing.assert_close(residual, x - codec.decode(msg), rtol=0, atol=1e-5)
