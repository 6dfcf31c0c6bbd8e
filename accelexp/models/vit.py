"""Vision Transformers: a compact ViT for small images, and torchvision's `vit_b_16`.

`ViT` is an `nn.Sequential` of its patch embedding, its encoder blocks and its head, so model
parallelism (`layer_sequence`) cuts it at block boundaries:

    embed      image -> patches (Conv2d, kernel = stride = patch) -> [cls] + patches + positions
    blocks.i   pre-norm: x + attention(norm(x)), then x + MLP(norm(x)); attention through
               `F.scaled_dot_product_attention` (flash / memory-efficient kernels where they run)
    head       final LayerNorm, the [cls] token, a linear layer to the classes

`patch_size: auto` picks the patch for the image size (`auto_patch_size`). torchvision's
`vit_b_16` is resized to the data (input channels, image size, classes); `vit_b16_layers` lists
it as the same three kinds of layer. A patch that does not divide the image is a `ConfigError`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig

from accelexp.errors import ConfigError
from accelexp.models.resnet import cached_weights
from accelexp.schema import ModelConfig, TorchvisionViTConfig, ViTConfig

if TYPE_CHECKING:
    import torchvision  # loaded where a model of its is built

# `auto` patch: the largest patch that divides the image and leaves at least this many patches.
# 16 patches (4x4: patch 7 for 28 px, 8 for 32 px) keep the sequence short, so attention and the
# MLPs cost ~3x less than with 49-64 patches; measured on Fashion-MNIST within the default run's
# CPU time, the shorter sequence trains more epochs and ends more accurate (docs/models.md).
AUTO_MIN_PATCHES = 16
VIT_B_16_PATCH = 16


def auto_patch_size(image_size: int) -> int:
    """The largest divisor of `image_size` that leaves at least `AUTO_MIN_PATCHES` patches."""
    fitting = [
        p
        for p in range(1, image_size + 1)
        if image_size % p == 0 and (image_size // p) ** 2 >= AUTO_MIN_PATCHES
    ]
    return max(fitting, default=1)


def patch_size_of(cfg: ViTConfig, image_size: int) -> int:
    """`model.patch_size` for images of `image_size` (`auto` resolved); `ConfigError` when it
    does not divide the image."""
    problem = patch_problem(cfg, image_size)
    if problem:
        raise ConfigError(problem)
    patch = cfg.patch_size
    return auto_patch_size(image_size) if patch in (None, "auto") else patch


def patch_problem(cfg: ModelConfig | DictConfig, image_size: int) -> str | None:
    """Why the ViT `cfg` (`model`) cannot cut images of `image_size` into patches; None if it can.

    `accelexp.config.validate` asks this before any training, where the image size is known (of
    the DictConfig: validation runs before the config is typed)."""
    if cfg.name == "vit_b_16":
        if image_size % VIT_B_16_PATCH == 0:
            return None
        return (
            f"model=vit_b_16 cuts images into 16x16 patches, but this data's images are "
            f"{image_size}x{image_size}: use data whose image size is a multiple of 16 (e.g. "
            f"data=cifar10, or data=synthetic data.image_size=224), or model=vit_tiny, whose "
            f"patch_size adapts to the image."
        )
    patch = getattr(cfg, "patch_size", None)  # a ViTConfig's
    whole = isinstance(patch, int) and patch >= 1 and image_size % patch == 0
    if patch in (None, "auto") or whole:
        return None
    divisors = [p for p in range(1, image_size + 1) if image_size % p == 0]
    return (
        f"model.patch_size={patch} does not divide the {image_size}x{image_size} images of this "
        f"data: a ViT cuts the image into whole patches. Use model.patch_size=auto (here "
        f"{auto_patch_size(image_size)}) or one of {divisors}."
    )


def heads_problem(dim: int, heads: int) -> str | None:
    """Why `heads` attention heads cannot share `dim` channels; None if they can."""
    if heads >= 1 and dim % heads == 0:
        return None
    return (
        f"model.heads={heads} does not divide model.dim={dim}: each head gets dim/heads "
        f"channels. Use model.heads in {[h for h in range(1, 17) if dim % h == 0]}, or a dim "
        f"that {heads} divides."
    )


class PatchEmbedding(nn.Module):
    """Non-overlapping patches projected to `dim`, a learned [cls] token in front, plus a learned
    position embedding: (N, C, H, W) -> (N, 1 + patches, dim)."""

    def __init__(
        self, in_channels: int, image_size: int, patch_size: int, dim: int, dropout: float
    ) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        patches = (image_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.zeros(1, 1 + patches, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)  # (N, patches, dim)
        cls = self.cls_token.expand(len(x), -1, -1)
        return self.dropout(torch.cat([cls, x], dim=1) + self.pos_embedding)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj_dropout(self.proj(y.transpose(1, 2).reshape(n, t, d)))


class Block(nn.Module):
    """Pre-norm transformer encoder block."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float) -> None:
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ClassHead(nn.Module):
    """Final LayerNorm, then the [cls] token to class logits."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x)[:, 0])


class ViT(nn.Sequential):
    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: int,
        patch_size: int,
        dim: int,
        depth: int,
        heads: int,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
    ) -> None:
        problem = heads_problem(dim, heads)
        if problem:
            raise ConfigError(problem)
        blocks = nn.Sequential(*(Block(dim, heads, mlp_ratio, dropout) for _ in range(depth)))
        super().__init__(
            OrderedDict(
                embed=PatchEmbedding(in_channels, image_size, patch_size, dim, dropout),
                blocks=blocks,
                head=ClassHead(dim, num_classes),
            )
        )
        self.apply(_init_weights)
        nn.init.trunc_normal_(self.embed.pos_embedding, std=0.02)
        nn.init.trunc_normal_(self.embed.cls_token, std=0.02)


def _init_weights(module: nn.Module) -> None:
    """ViT/DeiT's init: truncated normal (std 0.02) weights, zero biases."""
    if isinstance(module, nn.Linear | nn.Conv2d):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def build_vit(cfg: ViTConfig, in_channels: int, num_classes: int, image_size: int) -> ViT:
    return ViT(
        in_channels,
        num_classes,
        image_size,
        patch_size_of(cfg, image_size),
        cfg.dim,
        cfg.depth,
        cfg.heads,
        cfg.mlp_ratio,
        cfg.dropout,
    )


# --- torchvision's vit_b_16 -------------------------------------------------------------------


def build_vit_b_16(
    cfg: TorchvisionViTConfig, in_channels: int, num_classes: int, image_size: int
) -> torchvision.models.VisionTransformer:
    """torchvision's ViT-B/16 for `image_size` images of `in_channels` channels and the data's
    classes. ImageNet weights (`pretrained`) only from torch's hub cache, and only at 224 px with
    3 channels, where every weight fits; the head always starts from scratch."""
    problem = patch_problem(cfg, image_size)
    if problem:
        raise ConfigError(problem)
    weights = None
    if cfg.pretrained:
        if image_size != 224 or in_channels != 3:
            raise ConfigError(
                f"model.pretrained=true loads ViT-B/16 weights made for 224x224 RGB images, but "
                f"this data has {in_channels}x{image_size}x{image_size} images: use "
                f"model.pretrained=false or 224 px RGB data."
            )
        weights = cached_weights("vit_b_16")
    import torchvision  # here, not at import: it loads torch._dynamo (1.3 s a process)

    model = torchvision.models.vit_b_16(weights=weights, image_size=image_size)
    if in_channels != 3:
        hidden = model.hidden_dim
        model.conv_proj = nn.Conv2d(
            in_channels, hidden, kernel_size=VIT_B_16_PATCH, stride=VIT_B_16_PATCH
        )
    head = nn.Linear(model.hidden_dim, num_classes)
    nn.init.zeros_(head.weight)  # torchvision's init of the classification head
    nn.init.zeros_(head.bias)
    model.heads = nn.Sequential(OrderedDict(head=head))
    return model


class _VitB16Embedding(nn.Module):
    """conv_proj, the class token and the position embedding of a torchvision ViT, as one layer
    (its own parameters, shared: the model's state dict is unchanged)."""

    def __init__(self, model: torchvision.models.VisionTransformer) -> None:
        super().__init__()
        self.conv_proj = model.conv_proj
        self.class_token = model.class_token
        self.pos_embedding = model.encoder.pos_embedding
        self.dropout = model.encoder.dropout
        self.hidden_dim = model.hidden_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = len(x)
        x = self.conv_proj(x).reshape(n, self.hidden_dim, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        return self.dropout(x + self.pos_embedding)


class _VitB16Head(nn.Module):
    def __init__(self, model: torchvision.models.VisionTransformer) -> None:
        super().__init__()
        self.ln = model.encoder.ln
        self.heads = model.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads(self.ln(x)[:, 0])


def vit_b16_layers(model: torchvision.models.VisionTransformer) -> list[tuple[str, nn.Module]]:
    """A torchvision ViT's forward as a sequence: embedding, each encoder layer, norm + head."""
    layers = [(f"encoder.layers.{i}", layer) for i, layer in enumerate(model.encoder.layers)]
    return [("embed", _VitB16Embedding(model)), *layers, ("head", _VitB16Head(model))]
