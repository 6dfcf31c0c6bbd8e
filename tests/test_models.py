"""Every model builds for grey 28px and colour 32px data and returns (N, num_classes) logits."""

from __future__ import annotations

import pytest
import torch
from conftest import group_options

from accelexp.config import typed
from accelexp.errors import AccelexpError, ConfigError
from accelexp.models import MODELS, build_model

MODEL_NAMES = sorted(option for group, option in group_options() if group == "model")


def test_every_model_option_has_a_builder():
    assert set(MODEL_NAMES) == set(MODELS)


@pytest.mark.parametrize(("channels", "size"), [(1, 28), (3, 32)], ids=["grey28", "rgb32"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_gives_one_logit_per_class(compose_cfg, name, channels, size):
    torch.manual_seed(0)
    cfg = compose_cfg(f"model={name}")
    if name == "vit_b_16" and size % 16:  # 16 px patches: image sizes that 16 divides only
        with pytest.raises(ConfigError, match="multiple of 16"):
            build_model(typed(cfg).model, channels, 7, size)
        return
    model = build_model(typed(cfg).model, channels, 7, size).eval()
    with torch.no_grad():
        logits = model(torch.randn(2, channels, size, size))
    assert logits.shape == (2, 7)
    assert torch.isfinite(logits).all()


def test_small_images_get_the_3x3_stem_and_large_ones_keep_the_imagenet_stem(compose_cfg):
    cfg = compose_cfg("model=resnet18")
    small = build_model(typed(cfg).model, 1, 10, 28)
    assert small.conv1.in_channels == 1 and small.conv1.kernel_size == (3, 3)
    assert small.conv1.stride == (1, 1) and isinstance(small.maxpool, torch.nn.Identity)
    large = build_model(typed(cfg).model, 1, 10, 96).eval()
    assert large.conv1.in_channels == 1 and large.conv1.kernel_size == (7, 7)
    assert isinstance(large.maxpool, torch.nn.MaxPool2d)
    with torch.no_grad():
        assert large(torch.randn(1, 1, 96, 96)).shape == (1, 10)


def test_simple_cnn_trains_a_step(compose_cfg):
    cfg = compose_cfg("model=simple_cnn")
    model = build_model(typed(cfg).model, 3, 10, 16)
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_pretrained_without_cached_weights_is_a_clear_error(
    compose_cfg, tmp_path, monkeypatch, name
):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    cfg = compose_cfg(f"model={name}", "model.pretrained=true")
    with pytest.raises(AccelexpError) as caught:
        build_model(typed(cfg).model, 3, 10, 32)
    message = str(caught.value)
    assert "model.pretrained" in message
    assert str(tmp_path / "torch-home") in message  # where the weights were looked for
    assert "model.pretrained=false" in message  # what to type instead
