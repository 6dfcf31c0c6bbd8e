"""Vision Transformers: our compact ViT and torchvision's vit_b_16 build for the data, cut at block
boundaries into pipeline stages that compute what the whole model computes, train under every
strategy, and refuse a patch that does not divide the image before anything trains.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import (
    output_of,
    speed_cfg,
)

from accelexp.config import ConfigError, typed, validate
from accelexp.errors import AccelexpError
from accelexp.models import build_model, layer_sequence
from accelexp.models.vit import SelfAttention, auto_patch_size
from accelexp.parallel.pipeline import Pipeline, split_layers
from accelexp.schema import TorchvisionViTConfig, ViTConfig
from accelexp.speed import SpeedSwitches

CPU = torch.device("cpu")
# a ViT of a second's training on 16px synthetic images (auto patch 4: 16 patches)


def vit(channels: int = 3, size: int = 16, **keys) -> nn.Module:
    torch.manual_seed(0)
    cfg = ViTConfig(
        **{"name": "vit_tiny", "patch_size": "auto", "dim": 32, "depth": 3, "heads": 2}
        | {"mlp_ratio": 4.0, "dropout": 0.0}
        | keys
    )
    return build_model(cfg, channels, 10, size)


def vit_b_16(channels: int = 3, size: int = 32, **keys) -> nn.Module:
    torch.manual_seed(0)
    cfg = TorchvisionViTConfig(**{"name": "vit_b_16", "pretrained": False} | keys)
    return build_model(cfg, channels, 10, size)


@pytest.fixture(scope="module")
def vit_b_16_rgb32() -> nn.Module:
    """vit_b_16 for 32px RGB images, in eval mode: 86M parameters, built once, only read."""
    return vit_b_16().eval()


def images(n: int = 8, channels: int = 3, size: int = 16) -> torch.Tensor:
    return torch.randn(n, channels, size, size, generator=torch.Generator().manual_seed(1))


# --- the models ----------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "patch"), [(28, 7), (32, 8), (16, 4), (224, 56), (13, 1)])
def test_auto_patch_size_leaves_sixteen_patches_where_the_size_allows(size, patch):
    assert auto_patch_size(size) == patch


@pytest.mark.parametrize("name", ["vit_tiny", "vit_small"])
@pytest.mark.parametrize(("channels", "size"), [(1, 28), (3, 32)], ids=["grey28", "rgb32"])
def test_the_configured_vits_keep_deit_widths_and_give_one_logit_per_class(
    compose_cfg, name, channels, size
):
    cfg = compose_cfg(f"model={name}", "model.depth=1")
    model = build_model(typed(cfg).model, channels, 7, size).eval()
    assert (cfg.model.dim, cfg.model.heads) == {"vit_tiny": (192, 3), "vit_small": (384, 6)}[name]
    patch = {28: 7, 32: 8}[size]
    assert model.embed.proj.kernel_size == model.embed.proj.stride == (patch, patch)
    assert model.embed.pos_embedding.shape == (1, 1 + (size // patch) ** 2, cfg.model.dim)
    with torch.no_grad():
        logits = model(images(2, channels, size))
    assert logits.shape == (2, 7) and torch.isfinite(logits).all()


def test_attention_is_softmax_attention_over_each_head():
    torch.manual_seed(0)
    attention = SelfAttention(dim=12, heads=3, dropout=0.0)
    x = torch.randn(2, 5, 12)
    q, k, v = attention.qkv(x).split(12, dim=-1)

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(2, 5, 3, 4).transpose(1, 2)

    weights = torch.softmax(heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(4), dim=-1)
    expected = attention.proj((weights @ heads(v)).transpose(1, 2).reshape(2, 5, 12))
    torch.testing.assert_close(attention(x), expected)


def test_dropout_acts_in_training_only():
    model = vit(dropout=0.5)
    x = images(4)
    model.train()
    assert not torch.equal(model(x), model(x))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)


def test_vit_b_16_is_resized_to_the_data():
    model = vit_b_16(channels=1, size=32).eval()
    assert model.conv_proj.in_channels == 1 and model.image_size == 32
    assert model.heads.head.out_features == 10
    assert model.encoder.pos_embedding.shape == (1, 1 + 4, 768)
    with torch.no_grad():
        assert model(images(2, 1, 32)).shape == (2, 10)


def test_vit_b_16_pretrained_is_refused_off_its_image_size_or_without_cached_weights(
    tmp_path, monkeypatch
):
    with pytest.raises(ConfigError, match=r"224x224 RGB.*model\.pretrained=false"):
        vit_b_16(size=32, pretrained=True)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    with pytest.raises(AccelexpError) as caught:
        vit_b_16(size=224, pretrained=True)
    assert str(tmp_path / "torch-home") in str(caught.value)
    assert "model.pretrained=false" in str(caught.value)


def test_channels_last_is_harmless_on_a_vit():
    """Its patch embedding is a convolution, so `speed.channels_last` may turn NHWC on."""
    model = vit().eval()
    switches = SpeedSwitches.resolve(speed_cfg(channels_last=True), CPU, model)
    x = images(4)
    with torch.no_grad():
        expected = model(x)
        nhwc = switches.prepare(copy.deepcopy(model))
        torch.testing.assert_close(nhwc(x.to(memory_format=switches.memory_format)), expected)


# --- cut at block boundaries ---------------------------------------------------------------


def test_the_layer_sequences_are_embedding_blocks_head_and_the_forward_pass(vit_b_16_rgb32):
    ours, theirs = vit(depth=3).eval(), vit_b_16_rgb32
    assert [name for name, _ in layer_sequence(ours)] == [
        "embed", "blocks.0", "blocks.1", "blocks.2", "head",
    ]  # fmt: skip
    names = [name for name, _ in layer_sequence(theirs)]
    assert names == ["embed", *(f"encoder.layers.{i}" for i in range(12)), "head"]
    for model, x in ((ours, images()), (theirs, images(2, 3, 32))):
        layers = nn.Sequential(*(layer for _, layer in layer_sequence(model)))
        with torch.no_grad():
            torch.testing.assert_close(layers(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_two_stage_pipelined_vit_computes_the_unsplit_outputs_and_gradients(chunks):
    model = vit(depth=4)
    reference = copy.deepcopy(model)
    parts, points = split_layers(model, 2)
    assert 1 < points[0] < 5  # between two blocks
    pipeline = Pipeline(model, parts, [CPU, CPU], chunks)
    x, y = images(8), torch.arange(8)
    out, expected = pipeline(x), reference(x)
    torch.testing.assert_close(out, expected)
    F.cross_entropy(out, y).backward()
    F.cross_entropy(expected, y).backward()
    for (key, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=key)


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_two_stage_pipelined_vit_b_16_computes_the_unsplit_outputs(chunks, vit_b_16_rgb32):
    model = vit_b_16_rgb32
    x = images(4, 3, 32)
    with torch.no_grad():
        expected = model(x)
        parts, _ = split_layers(model, 2)
        torch.testing.assert_close(Pipeline(model, parts, [CPU, CPU], chunks)(x), expected)
    assert parts[0].layer_names[0] == "embed" and parts[1].layer_names[-1] == "head"


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("model=vit_tiny", "model.patch_size=5", "data.image_size=28"),
            "model.patch_size=5 does not divide the 28x28 images of this data",
        ),
        (
            ("model=vit_tiny", "model.patch_size=3", "data=cifar10"),
            "model.patch_size=3 does not divide the 32x32 images",
        ),
        (
            ("model=vit_b_16", "data=fashion_mnist"),
            "model=vit_b_16 cuts images into 16x16 patches, but this data's images are 28x28",
        ),
        (
            ("model=vit_small", "model.heads=5"),
            "model.heads=5 does not divide model.dim=384",
        ),
        (("model=vit_tiny", "model.patch_size=0"), "model.patch_size=0 is not allowed"),
        (("model=vit_tiny", "model.depth=0"), "model.depth=0 is not allowed"),
    ],
)
def test_a_vit_that_cannot_be_built_is_a_config_error(compose_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_cfg(*overrides))


def test_a_patch_that_does_not_divide_the_image_stops_before_training(tmp_path, cli):
    result = cli(
        "model=vit_tiny", "model.patch_size=5", "data=fashion_mnist",
        f"mlflow.tracking_uri=sqlite:///{tmp_path}/m.db", tmp_path=tmp_path,
    )  # fmt: skip
    text = output_of(result)
    assert result.returncode == 2, text
    assert "model.patch_size=5 does not divide the 28x28 images" in text, text
    assert "model.patch_size=auto (here 7) or one of [1, 2, 4, 7, 14, 28]" in text, text
    assert "Traceback" not in text and "epoch 1" not in text and "Training" not in text
