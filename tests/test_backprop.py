"""--accumulate, --clip-grad-norm and --amp: the step's gradient, without MPI."""

import copy

import pytest
import torch
from torch import nn

from psgrad.backprop import Backprop, LossScale
from psgrad.comm.protocol import Layer
from psgrad.config import RunConfig


def _setup(seed: int = 0, **options):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))
    images, labels = torch.randn(8, 12), torch.randint(0, 5, (8,))
    cfg = RunConfig(model="mlp", batch_size=8, **options)
    return (
        Backprop(cfg, model=model, loss_fn=nn.functional.cross_entropy, device=torch.device("cpu")),
        model,
        images,
        labels,
    )


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_accumulated_micro_batches_give_the_batch_gradient():
    one, model1, images, labels = _setup()
    loss1 = one.run(images, labels, lambda: None)
    four, model4, _, _ = _setup(accumulate=4)
    calls = []
    loss4 = four.run(images, labels, lambda: calls.append(1))
    torch.testing.assert_close(_grads(model4), _grads(model1))
    assert loss4 == pytest.approx(loss1, rel=1e-6) and calls == [1]


def test_hooks_may_send_only_in_the_last_micro_batch():
    backprop, model, images, labels = _setup(accumulate=3)
    seen = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(backprop.pushing))
    backprop.run(images, labels, lambda: None)
    assert seen == [False, False, True] and backprop.pushing


def test_clipping_bounds_the_whole_gradient_and_keeps_its_direction():
    backprop, model, images, labels = _setup(clip_grad_norm=0.05)
    backprop.run(images, labels, lambda: None)
    before = _grads(model).clone()
    params = dict(model.named_parameters())
    backprop.finish(params)
    after = _grads(model)
    assert float(after.norm()) == pytest.approx(0.05, rel=1e-4) and before.norm() > 0.05
    torch.testing.assert_close(after / after.norm(), before / before.norm())
    assert not backprop.hooks_may_send


def test_fp16_loss_scale_is_divided_away_and_adapts():
    plain, model32, images, labels = _setup()
    plain.run(images, labels, lambda: None)
    scaled, model16, _, _ = _setup(amp="fp16", on_nonfinite="skip")
    scaled.run(images, labels, lambda: None)
    params = dict(model16.named_parameters())
    layer = Layer(0, "0.weight", (16, 12), ("0.weight",), 0)
    assert scaled.scale.value == 2.0**16
    torch.testing.assert_close(scaled.gradient(params, layer), model32[0].weight.grad.reshape(-1), rtol=2e-2, atol=2e-3)
    scale = LossScale(True, interval=3)
    scale.update(True)
    assert scale.value == 2.0**15
    for _ in range(3):
        scale.update(False)
    assert scale.value == 2.0**16 and LossScale(False).value == 1.0


def test_bf16_autocast_trains_close_to_fp32():
    plain, model32, images, labels = _setup()
    loss32 = plain.run(images, labels, lambda: None)
    half, model16, _, _ = _setup(amp="bf16")
    loss16 = half.run(images, labels, lambda: None)
    assert loss16 == pytest.approx(loss32, rel=3e-2)
    assert torch.nn.functional.cosine_similarity(_grads(model16), _grads(model32), dim=0) > 0.99


@pytest.mark.parametrize(
    "options,fragment",
    [
        ({"amp": "fp16"}, "add --on-nonfinite skip"),
        ({"accumulate": 16, "batch_size": 8}, "--batch-size 8 is smaller"),
        ({"amp": "fp8"}, "--amp must be one of off, bf16, fp16"),
        ({"clip_grad_norm": -1.0}, "--clip-grad-norm must be >= 0"),
    ],
)
def test_bad_training_feature_options(options, fragment):
    with pytest.raises(ValueError, match=fragment.replace("-", "\\-")):
        RunConfig(**options).validate()


def test_inputs_need_not_be_one_tensor():
    """A model taking a dict (tabular + image parts, say) trains with micro-batches too."""

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 5), nn.Linear(6, 5)

        def forward(self, batch):
            return self.a(batch["a"]) + self.b(batch["b"][0])

    grads = []
    for k in (1, 2):
        torch.manual_seed(0)
        model = TwoInputs()
        torch.manual_seed(1)
        inputs = {"a": torch.randn(6, 4), "b": (torch.randn(6, 6),)}
        labels = torch.randint(0, 5, (6,))
        backprop = Backprop(
            RunConfig(batch_size=6, accumulate=k),
            model=model,
            loss_fn=nn.functional.cross_entropy,
            device=torch.device("cpu"),
        )
        backprop.run(inputs, labels, lambda: None)
        grads.append(_grads(model))
    torch.testing.assert_close(grads[1], grads[0])


def test_each_run_starts_in_training_mode_with_fresh_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))
    backprop = Backprop(
        RunConfig(model="mlp", batch_size=8),
        model=model,
        loss_fn=nn.functional.cross_entropy,
        device=torch.device("cpu"),
    )
    images, labels = torch.randn(8, 12), torch.randint(0, 5, (8,))
    backprop.run(images, labels, lambda: None)
    model[1].eval()  # a module left in eval mode while the root trains
    reference = copy.deepcopy(model).train()
    nn.functional.cross_entropy(reference(images), labels).backward()
    for param in model.parameters():
        param.grad = torch.full_like(param, 1000.0)  # a stale gradient the run must not add to
    means = model[1].running_mean.clone()
    backprop.run(images, labels, lambda: None)
    assert all(module.training for module in model.modules())
    assert not torch.equal(model[1].running_mean, means)  # BatchNorm took the batch's statistics
    torch.testing.assert_close(_grads(model), _grads(reference))


class _Recorder(nn.Module):
    """A small convolutional model that records whether each input it saw was channels-last."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc, self.seen = nn.Conv2d(3, 4, 3, 2, 1), nn.Linear(4, 5), []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last))
        return self.fc(self.conv(x).mean((2, 3)))


@pytest.mark.parametrize("name, channels_last", [("auto", True), ("channels-last", True), ("contiguous", False)])
def test_memory_format_sets_the_image_layout_and_not_the_gradient(name, channels_last):
    """auto on the CPU is channels-last; the gradient is the contiguous one up to rounding."""
    grads = []
    for fmt in (name, "contiguous"):
        torch.manual_seed(0)
        model = _Recorder()
        backprop = Backprop(
            RunConfig(batch_size=6, accumulate=2, memory_format=fmt), model=model, loss_fn=nn.functional.cross_entropy,
            device=torch.device("cpu"),
        )  # fmt: skip
        torch.manual_seed(1)
        backprop.run(torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,)), lambda: None)
        grads.append(_grads(model))
        if fmt == name:
            assert model.seen == [channels_last, channels_last]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_memory_format_auto_is_contiguous_off_the_cpu_and_other_names_are_refused():
    from psgrad.models.layout import memory_format

    assert memory_format("auto", torch.device("cuda")) == torch.contiguous_format
    assert memory_format("channels-last", torch.device("cuda")) == torch.channels_last
    with pytest.raises(ValueError, match="--memory-format must be one of auto, channels-last, contiguous"):
        RunConfig(memory_format="nhwc").validate()
