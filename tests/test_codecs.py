import dataclasses
import math

import numpy as np
import pytest
import torch

from psgrad import wire
from psgrad.codecs import available_codecs, make_codec

SPECS = [
    "none",
    "fp16",
    "topk:ratio=0.1",
    "topk:ratio=0.1,approx=1",
    "topk:ratio=0.05,values=fp16",
    "randomk:ratio=0.2",
    "randomk:ratio=0.3,shared=1",
    "threshold:v=0.5",
    "terngrad",
    "terngrad:clip=1",
    "qsgd:levels=16,bucket=64",
    "qsgd:levels=1,bucket=7",
    "sign",
    "sign:bucket=32",
    "sign:bucket=100",
    "svd:rank=2",
    "svd:rank=2,sample=1",
    "powersgd:rank=2",
    "powersgd:rank=1,ef=0,orth=qr",
]
SHAPES = [(1,), (1001,), (7, 5), (16, 3, 3, 3), ()]


@pytest.fixture(autouse=True, params=["compiled kernels", "numpy, blocks of 65536", "numpy, blocks of 64"])
def cpu_block(request, monkeypatch):
    """Every test runs three times: with the compiled kernels (where the install built them;
    tests/test_kernels.py checks that it did), and with the numpy kernels at their real block
    size (one block for these small tensors) and at 64-element blocks, so that block edges,
    short last blocks and buckets spanning blocks are all crossed."""
    from psgrad.codecs import _cpu

    if request.param.startswith("numpy"):
        monkeypatch.setattr(_cpu, "compiled", None)
        monkeypatch.setattr(_cpu, "BLOCK", int(request.param.split()[-1]))


def test_every_registered_codec_is_tested():
    assert {s.split(":")[0] for s in SPECS} == set(available_codecs())


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_keeps_shape_and_dtype(spec, shape, dtype, device):
    codec = make_codec(spec)
    grad = torch.randn(shape, device=device).to(dtype)
    msg = codec.encode(grad, seed=7)
    out = codec.decode(wire.loads(wire.dumps(msg)), device=device)
    assert out.shape == grad.shape and out.dtype == grad.dtype and out.device.type == device.type
    assert torch.equal(out, codec.decode(msg, device=device))


@pytest.mark.parametrize("spec", ["none", "fp16"])
def test_dense_codecs_are_near_exact(spec):
    grad = torch.randn(300)
    out = make_codec(spec).decode(make_codec(spec).encode(grad))
    torch.testing.assert_close(out, grad, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("spec", [s for s in SPECS if make_codec(s).unbiased])
def test_unbiased_codecs_are_unbiased(spec):
    torch.manual_seed(0)
    grad = torch.randn(6, 10)
    codec = make_codec(spec)
    trials = 4000
    total = torch.zeros_like(grad, dtype=torch.float64)
    sq = torch.zeros_like(total)
    for seed in range(trials):
        out = codec.decode(codec.encode(grad, seed=seed)).double()
        total += out
        sq += out * out
    mean = total / trials
    std_err = ((sq / trials - mean * mean).clamp(min=0) / trials).sqrt()
    assert _within_noise(mean, grad.double(), std_err), (mean - grad).abs().max()


@pytest.mark.parametrize("spec", [s for s in SPECS if not make_codec(s).multi_round])
def test_a_codec_sums_in_code_space_exactly_when_it_says_so(spec):
    """Two senders' messages, with their seeds, summed array by array: the decoded sum is the
    sum of the decodes for a codec that says ``sums_in_code_space`` (DDP's hook all-reduces those),
    and is not for the others (lossy codecs whose scales or coordinates differ by sender)."""
    codec = make_codec(spec)
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(4096, generator=gen), 3 * torch.randn(4096, generator=gen)
    seeds = (11, 11) if codec.shares_randomness else (11, 12)  # as psgrad's senders draw them
    first, second = codec.encode(a, seed=seeds[0]), codec.encode(b, seed=seeds[1])
    try:  # in the arrays' own dtypes, as an all-reduce of them would add
        summed = {name: first.arrays[name] + second.arrays[name] for name in first.arrays}
        total = codec.decode(dataclasses.replace(first, arrays=summed))
        adds_up = torch.allclose(total, codec.decode(first) + codec.decode(second), atol=1e-5)
    except (IndexError, RuntimeError, ValueError, TypeError):  # summed indices, bits or sizes: no message
        adds_up = False
    assert adds_up == codec.sums_in_code_space, spec


def test_biased_codecs_say_so():
    assert set(available_codecs()) - {s.split(":")[0] for s in SPECS if make_codec(s).unbiased} >= {
        "topk",
        "threshold",
        "sign",
    }
    assert not make_codec("svd:sample=0").unbiased and make_codec("svd:sample=1").unbiased


def _within_noise(mean, target, std_err):
    """5 standard errors per entry; entries that never moved in any trial (std 0, e.g. a tiny
    value QSGD always rounds to 0) get half the median standard error as slack."""
    return bool(torch.all((mean - target).abs() <= 5 * std_err + 0.5 * std_err.median() + 1e-6))


def test_unbiasedness_check_catches_a_small_bias():
    grad = torch.randn(60)
    codec = make_codec("qsgd:levels=4")
    outs = torch.stack([codec.decode(codec.encode(grad, seed=s)) for s in range(4000)])
    mean, err = outs.mean(0), outs.std(0) / math.sqrt(4000)
    assert _within_noise(mean, grad, err)
    assert not _within_noise(mean * 1.05, grad, err)


@pytest.mark.parametrize("approx", [0, 1])
@pytest.mark.parametrize("n,ratio", [(10, 0.3), (50_000, 0.01), (100_003, 0.001)])
def test_topk_selects_exactly_the_k_largest(approx, n, ratio, device):
    grad = torch.randn(n, device=device)
    codec = make_codec("topk", ratio=ratio, approx=approx)
    out = codec.decode(codec.encode(grad, seed=3))
    k = math.ceil(ratio * n)
    expected = set(torch.topk(grad.abs(), k).indices.tolist())
    kept = set(torch.nonzero(out).view(-1).tolist())
    assert kept == expected
    assert torch.equal(out[list(expected)], grad[list(expected)])


def test_sampled_topk_refines_when_sample_misleads():
    # a few huge entries among tiny ones: the sampled threshold overshoots and must be lowered
    grad = torch.full((40_000,), 1e-3)
    grad[torch.randperm(40_000)[:400]] = torch.rand(400) + 1
    grad += torch.rand(40_000) * 1e-4
    codec = make_codec("topk:ratio=0.02,approx=1")
    out = codec.decode(codec.encode(grad, seed=1))
    assert set(torch.nonzero(out).view(-1).tolist()) == set(torch.topk(grad.abs(), 800).indices.tolist())


def test_threshold_keeps_entries_at_or_above_v():
    grad = torch.tensor([0.1, -0.5, 0.49, 2.0, -3.0])
    out = make_codec("threshold:v=0.5").decode(make_codec("threshold:v=0.5").encode(grad))
    assert out.tolist() == [0.0, -0.5, 0.0, 2.0, -3.0]


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("sample", [0, 1])
def test_svd_is_exact_for_low_rank_inputs(rank, sample):
    torch.manual_seed(rank)
    grad = (torch.randn(20, rank) @ torch.randn(rank, 36)).view(20, 4, 9)
    codec = make_codec("svd", rank=3, sample=sample)
    torch.testing.assert_close(codec.decode(codec.encode(grad, seed=5)), grad, rtol=1e-4, atol=1e-4)


def test_randomized_svd_on_large_matrices():
    from psgrad.codecs.svd import top_singular_triplets

    torch.manual_seed(0)
    low = (torch.randn(256, 2) @ torch.randn(2, 600)).view(256, 12, 50)
    codec = make_codec("svd:rank=2")
    torch.testing.assert_close(codec.decode(codec.encode(low, seed=1)), low, rtol=1e-4, atol=1e-4)
    # a full-rank matrix with a decaying spectrum: the top triplets of the full SVD
    u, _ = torch.linalg.qr(torch.randn(256, 256))
    v, _ = torch.linalg.qr(torch.randn(600, 256))
    spectrum = 0.7 ** torch.arange(256.0)
    matrix = (u * spectrum) @ v.T
    gen = torch.Generator().manual_seed(3)
    uk, sk, vk = top_singular_triplets(matrix, 2, generator=gen)
    torch.testing.assert_close(sk, spectrum[:2], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close((uk * sk) @ vk, (u[:, :2] * spectrum[:2]) @ v[:, :2].T, rtol=1e-3, atol=1e-4)
    # the same seed gives the same message
    grad = torch.randn(128, 300)
    a, b = codec.encode(grad, seed=9), codec.encode(grad, seed=9)
    assert all(torch.equal(a.arrays[k], b.arrays[k]) for k in a.arrays)


def test_svd_truncates_to_rank():
    grad = torch.randn(30, 20)
    msg = make_codec("svd:rank=2").encode(grad)
    assert msg.arrays["u"].shape == (30, 2) and msg.arrays["v"].shape == (2, 20)


def test_sign_keeps_signs_and_l1_norm():
    grad = torch.randn(101)
    out = make_codec("sign").decode(make_codec("sign").encode(grad))
    assert torch.equal(out < 0, grad < 0)
    torch.testing.assert_close(out.abs().sum(), grad.abs().sum())


@pytest.mark.parametrize("n,bucket", [(1001, 32), (1001, 100), (64, 32), (31, 32), (200_003, 96)])
def test_bucketed_sign_scales_each_bucket_by_its_mean_magnitude(n, bucket, device):
    """Each run of ``bucket`` elements (the last may be short) decodes to its own mean |g| with
    g's signs: written out here element by element, the codec's blocked kernel must agree."""
    magnitudes = torch.linspace(0.01, 10, n, device=device)  # every bucket's mean differs
    grad = torch.randn(n, device=device) * magnitudes
    codec = make_codec("sign", bucket=bucket)
    msg = codec.encode(grad)
    expected = torch.cat(
        [part.abs().mean().expand(part.numel()) * torch.where(part < 0, -1.0, 1.0) for part in grad.split(bucket)]
    )
    assert msg.arrays["scale"].numel() == -(-n // bucket)
    torch.testing.assert_close(codec.decode(msg), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(codec.decode(wire.loads(wire.dumps(msg))), expected, rtol=1e-5, atol=0)


def test_bucketed_sign_errs_less_than_one_scale_when_magnitudes_vary():
    """Rows 1,000x apart: one scale leaves 0.90 of the norm as error, a scale per row 0.60 (the
    Gaussian floor of sign, sqrt(1 - 2/pi))."""
    torch.manual_seed(0)
    grad = torch.randn(64, 32) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different size
    error = {
        b: (make_codec("sign", bucket=b).decode(make_codec("sign", bucket=b).encode(grad)) - grad).norm()
        for b in (0, 32)
    }
    assert error[32] < 0.75 * error[0]


def test_sign_bucket_at_least_the_tensor_is_the_one_scale_message():
    grad = torch.randn(40)
    one, wide = make_codec("sign").encode(grad), make_codec("sign:bucket=64").encode(grad)
    assert wide.arrays["scale"].shape == (1,)
    assert all(torch.equal(one.arrays[k], wide.arrays[k]) for k in one.arrays)


def test_terngrad_outputs_three_values():
    grad = torch.randn(1000)
    out = make_codec("terngrad").decode(make_codec("terngrad").encode(grad, seed=2))
    assert set(out.unique().tolist()) <= {0.0, grad.abs().max().item(), -grad.abs().max().item()}


def test_terngrad_codes_are_the_protocols_two_bit_codes():
    """docs/protocol.md: codes 0 (zero), 1 (+s), 2 (-s), packed as 2 bit planes."""
    from psgrad.codecs import _bits

    grad = torch.randn(1001)
    msg = make_codec("terngrad").encode(grad, seed=5)
    codes = _bits.unpack_bits(msg.arrays["codes"], grad.numel(), 2)
    out = make_codec("terngrad").decode(msg)
    scale = grad.abs().max()
    assert set(codes.unique().tolist()) == {0, 1, 2}
    assert torch.equal(out, torch.tensor([0.0, scale, -scale])[codes.long()])
    assert torch.equal(out[codes > 0] < 0, grad[codes > 0] < 0)


def test_seed_makes_random_codecs_reproducible():
    grad = torch.randn(25, 20)
    for spec in ["qsgd", "terngrad", "randomk:ratio=0.1", "svd:sample=1"]:
        codec = make_codec(spec)
        a, b, c = (codec.decode(codec.encode(grad, seed=s)) for s in (1, 1, 2))
        assert torch.equal(a, b) and not torch.equal(a, c), spec


def test_decode_add_matches_decode():
    grad = torch.randn(40, 25)
    for spec in SPECS:
        codec = make_codec(spec)
        msg = codec.encode(grad, seed=4)
        acc = torch.ones(40, 25)
        codec.decode_add(msg, acc, alpha=0.5)
        torch.testing.assert_close(acc, 1 + 0.5 * codec.decode(msg), msg=spec)


# ---------------------------------------------------------------- byte budgets (docs/codecs.md)
N = 1 << 16
BUDGET_BITS = {  # raw payload bits per element for N elements, as docs/codecs.md states them
    "none": 32,
    "fp16": 16,
    "topk:ratio=0.01": 0.01 * 64,
    "topk:ratio=0.01,values=fp16": 0.01 * 48,
    "randomk:ratio=0.01": 0.01 * 32,
    "terngrad": 2 + 32 / N,
    "qsgd:levels=16,bucket=512": 5 + 1 + 32 / 512,
    "qsgd:levels=15,bucket=512": 4 + 1 + 32 / 512,
    "qsgd:levels=1,bucket=512": 1 + 1 + 32 / 512,
    "sign": 1 + 32 / N,
    "sign:bucket=32": 1 + 32 / 32,
    "sign:bucket=128": 1 + 32 / 128,
    "svd:rank=2": 32 * 2 * (256 + 256 + 1) / N,
    "powersgd:rank=2": 32 * 2 * (256 + 256) / N,
}
HEADER_SLACK = 400  # msgpack header + per-array framing, in bytes


@pytest.mark.parametrize("spec", BUDGET_BITS)
def test_byte_budget(spec):
    grad = torch.randn(256, 256)
    msg = make_codec(spec).encode(grad, seed=1)
    payload = sum(a.numel() * a.element_size() for a in msg.arrays.values())
    assert payload * 8 / N == pytest.approx(BUDGET_BITS[spec], rel=0.002)
    assert make_codec(spec).budget_bits(grad.shape) == pytest.approx(BUDGET_BITS[spec], rel=0.002)
    assert len(wire.dumps(msg, compress="never")) <= payload + HEADER_SLACK
    assert len(wire.dumps(msg)) <= payload + HEADER_SLACK
    assert len(wire.dumps(msg)) <= wire.max_message_bytes(spec, grad.shape)


def test_threshold_budget_is_per_kept_entry():
    grad = torch.randn(N)
    msg = make_codec("threshold:v=2").encode(grad)
    kept = int((grad.abs() >= 2).sum())
    assert len(wire.dumps(msg, compress="never")) <= 8 * kept + HEADER_SLACK


def test_qsgd_is_bit_packed_not_byte_per_element():
    msg = make_codec("qsgd:levels=4,bucket=1024").encode(torch.randn(1 << 14))
    assert len(wire.dumps(msg, compress="never")) < (1 << 14) * 4 / 8 + 400  # 3+1 bits < 1 byte


# ---------------------------------------------------------------- specs
@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("nope", "unknown codec 'nope'"),
        ("topk:ratio=2", "ratio must be in (0, 1]"),
        ("topk:ratio=x", "ratio='x' is not a number"),
        ("qsgd:levels=abc", "levels='abc' is not an integer"),
        ("qsgd:level=3", "has no parameter 'level'"),
        ("qsgd:levels", "expected key=value"),
        ("topk:values=int8", "values must be one of"),
        ("", "non-empty"),
        ("svd:rank=0", "rank must be >= 1"),
    ],
)
def test_bad_spec_raises_value_error_naming_the_problem(spec, fragment):
    with pytest.raises(ValueError) as err:
        make_codec(spec)
    assert fragment in str(err.value)


def test_spec_and_keywords_agree():
    assert make_codec("qsgd:levels=4").params == make_codec("qsgd", levels=4).params
    assert make_codec(make_codec("topk:ratio=0.5,approx=1").spec).params == {
        "ratio": 0.5,
        "approx": True,
        "values": "fp32",
    }


def test_integer_gradients_are_rejected():
    with pytest.raises(TypeError, match="floating"):
        make_codec("none").encode(torch.arange(3))


@pytest.mark.parametrize("spec", SPECS)
def test_message_does_not_alias_the_gradient(spec):
    grad = torch.randn(30, 20)
    codec = make_codec(spec)
    msg = codec.encode(grad, seed=1)
    before = codec.decode(msg).clone()
    grad.zero_()
    assert torch.equal(codec.decode(msg), before)


@pytest.mark.parametrize("name", available_codecs())
@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0)])
def test_empty_tensors_round_trip_through_every_codec(name, shape):
    codec = make_codec(name)
    msg = codec.encode(torch.zeros(shape), seed=1)
    back = wire.loads(wire.dumps(msg))
    assert codec.decode(back).shape == shape
    out = torch.zeros(shape)
    codec.decode_add(back, out)
    assert out.shape == shape


# ---------------------------------------------------------------- CPU kernels against references
def test_qsgd_levels_are_a_neighbouring_level_and_decode_by_the_protocol():
    """Blocked encode: norms per bucket, signs, and each level floor(x) or floor(x) + 1 of
    x = |g| s / norm; blocked decode equals the bit-plane reference of docs/protocol.md."""
    from psgrad.codecs import _bits

    grad, bucket, s = torch.randn(3001), 64, 16
    codec = make_codec(f"qsgd:levels={s},bucket={bucket}")
    msg = codec.encode(grad, seed=9)
    norms = torch.cat([torch.linalg.vector_norm(b).reshape(1) for b in grad.split(bucket)])
    torch.testing.assert_close(msg.arrays["norms"], norms)
    levels = _bits.unpack_bits(msg.arrays["levels"], grad.numel(), codec.width).float()
    scaled = grad.abs() * s / norms.repeat_interleave(bucket)[: grad.numel()]
    assert torch.all((levels == scaled.floor()) | (levels == scaled.floor() + 1))
    negative = _bits.unpack_bits(msg.arrays["signs"], grad.numel(), 1).bool()
    assert torch.equal(negative, grad < 0)
    reference = levels * torch.where(negative, -1.0, 1.0) * norms.repeat_interleave(bucket)[: grad.numel()] / s
    torch.testing.assert_close(codec.decode(msg), reference)


def test_terngrad_clip_scale_is_the_clipped_maximum():
    grad = torch.randn(5000)
    grad[7] = 40.0  # far beyond 2.5 sigma: clipping must bound the scale
    msg = make_codec("terngrad:clip=1").encode(grad, seed=1)
    torch.testing.assert_close(msg.arrays["scale"][0], 2.5 * grad.std())


def test_uniforms_are_uniform_seeded_and_blocking_free():
    from psgrad.codecs import _cpu

    draws = _cpu.Uniforms(3, 1 << 16).at(0, 1 << 16).copy() - 1.0
    assert 0.0 <= draws.min() and draws.max() < 1.0
    histogram = torch.histc(torch.from_numpy(draws), bins=16, min=0.0, max=1.0)
    assert torch.all((histogram - 4096).abs() < 5 * 64)  # 5 standard deviations of a bin count
    other = _cpu.Uniforms(4, 1 << 16).at(0, 1 << 16)
    assert abs(np.corrcoef(draws, other - 1.0)[0, 1]) < 0.02
    again = _cpu.Uniforms(3, 100)
    assert (again.at(40_000, 100) - 1.0 == draws[40_000:40_100]).all()


@pytest.mark.parametrize("spec", SPECS)
def test_decode_add_into_a_parameter_that_requires_grad(spec):
    """Workers decode down-link deltas straight into their parameters (under no_grad)."""
    grad = torch.randn(30, 20)
    codec = make_codec(spec)
    msg = codec.encode(grad, seed=2)
    param = torch.nn.Parameter(torch.ones(30, 20))
    with torch.no_grad():
        codec.decode_add(msg, param, alpha=-0.5)
    torch.testing.assert_close(param.detach(), 1 - 0.5 * codec.decode(msg))


@pytest.mark.parametrize("spec", [s for s in SPECS if not s.startswith("svd")])
def test_non_finite_gradients_code_without_numpy_warnings(spec):
    """A NaN or inf gradient is --on-nonfinite's business; the CPU kernels must not spam warnings.
    (svd is left out: torch's SVD refuses non-finite input with an error of its own.)"""
    import warnings

    grad = torch.randn(300)
    grad[[3, 50, 299]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    codec = make_codec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        msg = codec.encode(grad, seed=1)
        codec.decode_add(msg, torch.zeros(300))


def test_shared_randomk_keeps_values_at_coordinates_every_worker_shares():
    """shared=1: unique sorted coordinates, values not rescaled, and encode_gradient seeds them
    by (step, layer) alone, so two workers' messages line up; the rescaled variant does not."""
    from psgrad.comm.protocol import Layer, encode_gradient
    from psgrad.feedback import NoFeedback

    grad = torch.randn(1000)
    codec = make_codec("randomk:ratio=0.1,shared=1")
    out = codec.decode(codec.encode(grad, seed=5))
    kept = torch.nonzero(out).view(-1)
    assert kept.numel() == 100 and torch.equal(out[kept], grad[kept])
    layer = Layer(3, "w", (1000,), ("w",), 0)
    for spec, same in [("randomk:ratio=0.1,shared=1", True), ("randomk:ratio=0.1", False)]:
        feedback = NoFeedback(make_codec(spec))
        a, b = (
            encode_gradient(feedback, layer, torch.randn(1000), step=7, sender=sender, stream=sender, run_seed=0)
            for sender in (1, 2)
        )
        assert (a.seed == b.seed) == same, spec
    assert make_codec("randomk:ratio=0.1,shared=1").feedback_safe and not make_codec("randomk:ratio=0.1").feedback_safe


# ---------------------------------------------------------------- PowerSGD
def test_powersgd_factors_what_torchs_hook_factors():
    """The hook's rule: matrices only, and only when (n + m) R min_rate < n m."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    codec = make_codec("powersgd:rank=2")
    for shape in [(64, 3072), (10, 64), (16, 3, 3, 3), (4, 4), (8, 3), (640, 64, 1, 1), (3, 100)]:
        n, m = shape[0], math.prod(shape[1:])
        assert codec.compresses(shape) == _should_compress(n, m, 2, 2)[0], shape
    assert not codec.compresses((1000,)) and not codec.compresses(())
    assert codec.rounds((64, 3072)) == 2 and codec.rounds((1000,)) == 1


@pytest.mark.parametrize("orth", ["gs", "qr"])
def test_powersgd_one_round_is_exact_on_low_rank_matrices(orth):
    # a fixed draw: about 1 % of random rank-2 matrices are conditioned badly enough that fp32
    # misses these tolerances (Gram-Schmidt's P'P off by up to 6e-5), which made the test flaky
    gen = torch.Generator().manual_seed(0)
    u, v = torch.randn(48, 2, generator=gen), torch.randn(2, 90, generator=gen)
    codec = make_codec(f"powersgd:rank=2,orth={orth}")
    msg = codec.encode(u @ v, seed=5)
    p = msg.arrays["p"]
    torch.testing.assert_close(p.t() @ p, torch.eye(2), atol=1e-5, rtol=0)
    torch.testing.assert_close(codec.decode(msg), u @ v, atol=1e-4, rtol=1e-4)


def test_powersgd_round_messages_cost_r_times_n_plus_m_floats():
    """Per step and factored layer a worker sends P (n x R) and Q (m x R): 4 R (n + m) bytes."""
    from psgrad.feedback import make_feedback

    memory = make_feedback("none", make_codec("powersgd:rank=2"))
    grad = torch.randn(64, 32, 3, 3)
    first = memory.encode("w", grad, seed=3)
    assert first.meta == {"round": 1} and first.arrays["p"].shape == (64, 2)
    p_hat = make_codec("powersgd:rank=2").reduce(1, {"p": first.arrays["p"] * 2}, 2)
    second = memory.advance("w", grad.shape, 1, p_hat)
    assert second.meta == {"round": 2} and second.arrays["q"].shape == (288, 2)
    for msg, floats in ((first, 64 * 2), (second, 288 * 2)):
        assert 4 * floats <= len(wire.dumps(msg)) <= 4 * floats + HEADER_SLACK


def test_powersgd_error_memory_keeps_what_the_approximation_missed():
    """e = M - P_hat Q^T after a step, and the next step's M is g + e (one worker: Q = M^T P_hat)."""
    from psgrad.feedback import make_feedback

    codec = make_codec("powersgd:rank=1")
    memory = make_feedback("none", codec)
    grad = torch.randn(20, 30)
    p = memory.encode("w", grad, seed=1).arrays["p"]
    reply1 = codec.reduce(1, {"p": p}, 1)
    q = memory.advance("w", grad.shape, 1, reply1).arrays["q"]
    reply2 = codec.reduce(2, {"q": q}, 1)
    applied = memory.finish("w", reply2)
    torch.testing.assert_close(applied, (reply1["p"] @ q.t()).reshape(-1))
    torch.testing.assert_close(memory.states["w"]["error"], grad.reshape(-1) - applied)
    torch.testing.assert_close(memory.states["w"]["q"], q)
    state = memory.state_dict()
    assert set(state) == {"round/w/error", "round/w/q"}  # nothing of an open round is kept


@pytest.mark.parametrize(
    "meta,arrays,problem",
    [
        ({"round": 3}, {"q": torch.zeros(288, 2)}, "round 3"),
        ({"round": 1}, {"q": torch.zeros(288, 2)}, "arrays"),
        ({"round": 2}, {"q": torch.zeros(287, 2)}, "expected"),
        ({"round": 1}, {"p": torch.full((64, 2), float("nan"))}, "NaN"),
    ],
)
def test_powersgd_refuses_malformed_round_messages(meta, arrays, problem):
    from psgrad.codecs import Message

    codec = make_codec("powersgd:rank=2")
    msg = Message("powersgd", dict(codec.params), (64, 32, 3, 3), "float32", arrays, meta=meta)
    with pytest.raises(ValueError, match=problem):
        codec.check(msg)
    with pytest.raises(wire.WireError):
        wire.loads(wire.dumps(msg))


def test_psgrad_codecs_list_names_every_codec_by_a_spec_that_builds_it():
    """``psgrad codecs --list`` answers "which names?" at once: one line a codec, its spec with
    the default parameters first, and no measurement."""
    from click.testing import CliRunner

    from psgrad.cli import main
    from psgrad.codecs import available_codecs, make_codec

    done = CliRunner().invoke(main, ["codecs", "--list"])
    assert done.exit_code == 0, done.output
    specs = [line.split()[0] for line in done.output.splitlines()]
    assert sorted(spec.split(":")[0] for spec in specs) == available_codecs()
    for spec in specs:
        make_codec(spec)
    assert "GB/s" not in done.output
    # an option beside --list would be ignored: refused, naming it (before, the list printed alone)
    done = CliRunner().invoke(main, ["codecs", "--list", "--codecs", "topk"])
    assert done.exit_code == 2 and "it takes no other option (got --codecs)" in done.output, done.output
