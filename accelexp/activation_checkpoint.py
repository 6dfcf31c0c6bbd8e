"""Activation checkpointing (`speed.activation_checkpointing`): fewer activations, more compute.

A checkpointed block keeps only its input from the forward pass and runs its forward again in
the backward pass to get what its gradients need — memory for compute, as torchtitan's
`distributed/activation_checkpoint.py` and Lightning's `activation_checkpointing_policy` do.

- The blocks are the model's repeated blocks on its layer sequence (`accelexp.models.
  layer_sequence`, the boundaries pipeline stages and FSDP units cut at): a ResNet's residual
  blocks, a ViT's encoder blocks. A model without such blocks (simple_cnn, mlp: one layer each)
  is refused: checkpointing a single layer keeps its input instead of its output, which saves
  nothing.
- `full`: every block. `selective` with `speed.selective_ac_option`: a number k checkpoints every
  k-th block (blocks k, 2k, … counted from 1, torchtitan's layer SAC); `op` checkpoints every
  block but keeps the outputs of its matmuls, attention and convolutions (torchtitan's op SAC:
  the costly ops are not run again, the cheap ones — norms, activations, additions — are).
- Applied in torchtitan's order: before `torch.compile` and before a strategy shards or wraps the
  model (`SpeedSwitches.prepare`). Each block is wrapped in torch's `CheckpointWrapper`, whose
  state-dict hooks keep the parameters' names, so checkpoints load into a model without it.
- BatchNorm: the forward run again in the backward would update a block's running statistics a
  second time; they are put back as the first forward left them (`_first_forward_statistics`).
  Gradients are the same as without checkpointing (tests/test_activation_checkpoint.py), up to
  the order of floating-point sums.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections import Counter
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from accelexp.errors import ConfigError
from accelexp.models import layer_sequence

MODES = ("none", "full", "selective")
OP = "op"  # speed.selective_ac_option=op: checkpoint by op, not by block
# the ops whose outputs op-selective checkpointing keeps (torchtitan's list, plus convolutions:
# a CNN's costly op); every other op of a block is run again in the backward
SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks in its layer sequence: layers that are its own modules, hold
    parameters, have layers inside them, and share their type with another layer."""
    own = {id(module) for module in model.modules()}
    layers = [
        layer
        for _, layer in layer_sequence(model)
        if id(layer) in own and any(True for _ in layer.children()) and _has_parameters(layer)
    ]
    kinds = Counter(map(_kind, layers))
    return [layer for layer in layers if kinds[_kind(layer)] > 1]


def _kind(layer: nn.Module) -> type:
    """A layer's type; a checkpointed block's is the block's (`apply` wrapped it)."""
    return type(getattr(layer, "_checkpoint_wrapped_module", layer))


def checkpointable(model: nn.Module) -> bool:
    """Whether `model` has blocks to checkpoint: the user's model, as a strategy's `unwrap`
    gives it back (its blocks checkpointed already, or sharded, or not); False for a model
    without a layer sequence."""
    try:
        return bool(blocks(model))
    except ConfigError:
        return False


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def chosen(model: nn.Module, mode: str, option: str) -> list[nn.Module]:
    """The blocks `mode` (and `option`, under `selective`: validated by `accelexp.config`)
    checkpoints; refuses a model without blocks."""
    if mode == "none":
        return []
    found = blocks(model)
    if not found:
        raise ConfigError(
            f"speed.activation_checkpointing={mode}, but {type(model).__name__} has no repeated "
            f"blocks to checkpoint (a ResNet's residual blocks, a ViT's encoder blocks): "
            f"checkpointing its single layers would save nothing. Use a ResNet or ViT model, or "
            f"speed.activation_checkpointing=none."
        )
    if mode == "selective" and option != OP:
        every = int(option)
        return [block for i, block in enumerate(found, start=1) if i % every == 0]
    return found


def apply(model: nn.Module, mode: str, option: str = "2") -> int:
    """Wrap the chosen blocks (`chosen`) in place; returns how many were wrapped."""
    targets = chosen(model, mode, option)
    # no context_fn at all unless by op: torch.compile cannot trace checkpoint's default one
    by_op = {"context_fn": _keep_costly_ops} if mode == "selective" and option == OP else {}
    where = {id(child): (parent, name) for parent in model.modules() for name, child in
             parent.named_children()}  # fmt: skip
    for block in targets:
        parent, name = where[id(block)]
        wrapped = checkpoint_wrapper(block, checkpoint_fn=functools.partial(_checkpointed, **by_op))
        setattr(parent, name, wrapped)
    return len(targets)


def _checkpointed(module: nn.Module, *args, **kwargs):
    """`checkpoint` of one block's forward; the forward run again in the backward leaves the
    block's BatchNorm statistics as the first one left them."""
    calls = itertools.count()

    def forward(*inner, **named):
        if torch.compiler.is_compiling() or next(calls) == 0:
            return module(*inner, **named)
        with _first_forward_statistics(module):
            return module(*inner, **named)

    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


@contextlib.contextmanager
def _first_forward_statistics(module: nn.Module) -> Iterator[None]:
    """The block's BatchNorms run with momentum 0 and without their batch count: the same ops
    as in the forward (op-selective checkpointing replays them in order), leaving the running
    statistics as they are."""
    norms = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    kept = [(norm.momentum, norm._buffers.get("num_batches_tracked")) for norm in norms]
    for norm in norms:
        norm.momentum, norm._buffers["num_batches_tracked"] = 0.0, None
    try:
        yield
    finally:
        for norm, (momentum, count) in zip(norms, kept, strict=True):
            norm.momentum, norm._buffers["num_batches_tracked"] = momentum, count


def _keep_costly_ops():
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
