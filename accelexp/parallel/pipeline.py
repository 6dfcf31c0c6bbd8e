"""A model cut into stages over devices, fed GPipe-style with micro-batches, in one process.

`split_layers` cuts the model's layer sequence (`accelexp.models.layer_sequence`) into `stages`
contiguous parts, where the user says (`split_points`) or balanced by parameter count or by the
measured forward time of each layer. `Pipeline` runs them: each batch is cut into `chunks`
micro-batches, and at clock tick t stage k runs micro-batch t - k (GPipe's schedule), so on GPUs
stage k+1 works on micro-batch i while stage k works on i+1. `chunks: 1` is plain model
parallelism: the batch goes through the stages one after another, exactly the unsplit model.

Why not `torch.distributed.pipelining`: its schedules run one stage per process (rank) and pass
activations with send/recv, and `schedule.step(x, target=y)` owns the loss and the backward pass.
Here one process drives all of a replica's devices (the `model` strategy, and each worker of
`hybrid`), and the training loop keeps the loss, the GradScaler, gradient accumulation and the
metrics, as for every other strategy. In one process no scheduler machinery is needed: CUDA
launches kernels asynchronously, so issuing the work in clock order with non-blocking copies
between devices keeps every device busy, and autograd already runs each device's part of the
backward pass on a thread of its own. What is left is the loop in `Pipeline.forward`.

Semantics worth knowing: the stages are the model's own modules (no copies), so the model's
`state_dict` is unchanged and checkpoints load anywhere; the output returns to the first stage's
device, where the loop keeps the labels; with `chunks > 1` BatchNorm normalises each micro-batch
on its own and updates its running statistics once per micro-batch, as in GPipe.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn as nn

from accelexp.errors import ConfigError
from accelexp.models import layer_sequence
from accelexp.parallel.base import to_device


def balanced_split(weights: Sequence[float], stages: int) -> list[int]:
    """Split points (the first layer of stages 1..) minimising the heaviest stage.

    Ties go to the most even stages: the smallest sum of squared stage weights, then of squared
    layer counts, so weightless layers (activations, pooling) do not pile up in one stage.
    """
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[s][i]: (heaviest, sum of squared weights, of squared counts, split points) of
    # layers[:i] in s stages
    best: list[dict[int, tuple[float, float, int, list[int]]]] = [{0: (0.0, 0.0, 0, [])}]
    for s in range(1, stages + 1):
        row = {}
        for i in range(s, n - (stages - s) + 1):
            candidates = []
            for j in range(s - 1, i):
                if j not in best[s - 1]:  # layers[:j] cannot fill s - 1 stages
                    continue
                heaviest, squares, counts, points = best[s - 1][j]
                w = prefix[i] - prefix[j]
                candidates.append(
                    (max(heaviest, w), squares + w * w, counts + (i - j) ** 2, [*points, j])
                )
            row[i] = min(candidates)
        best.append(row)
    return best[stages][n][3][1:]  # the first stage starts at 0


def measured_layer_times(
    layers: Sequence[nn.Module], example: torch.Tensor, repeats: int = 3
) -> list[float]:
    """Median forward time of each layer on `example` (eval mode, no grad, state untouched)."""
    device = example.device
    modes = [layer.training for layer in layers]
    times: list[list[float]] = [[] for _ in layers]
    with torch.no_grad():
        for layer in layers:
            layer.eval()
        for _ in range(repeats + 1):  # the first pass warms up
            x = example
            for k, layer in enumerate(layers):
                _sync(device)
                start = time.perf_counter()
                x = layer(x)
                _sync(device)
                times[k].append(time.perf_counter() - start)
    for layer, mode in zip(layers, modes, strict=True):
        layer.train(mode)
    return [statistics.median(t[1:]) for t in times]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def split_layers(
    model: nn.Module,
    stages: int,
    split_points: Sequence[int] | None = None,
    balance: str = "params",
    example: torch.Tensor | None = None,
) -> tuple[list[Stage], list[int]]:
    """The model's layers cut into `stages` nn.Sequential parts, and the split points used."""
    named = layer_sequence(model)
    names = [name for name, _ in named]
    listing = ", ".join(f"{i}:{name}" for i, name in enumerate(names))
    if stages > len(named):
        raise ConfigError(
            f"parallelism.stages={stages}, but {type(model).__name__} has only {len(named)} "
            f"layers to split ({listing}). Use parallelism.stages<={len(named)}."
        )
    _check_covers(model, [layer for _, layer in named])
    if split_points is None:
        if balance == "compute":
            if example is None:
                raise ValueError("balance='compute' needs an example input to time the layers")
            weights = measured_layer_times([layer for _, layer in named], example)
        else:
            weights = [sum(p.numel() for p in layer.parameters()) for _, layer in named]
        split_points = balanced_split(weights, stages)
    split_points = list(split_points)
    if len(split_points) != stages - 1 or not all(0 < p < len(named) for p in split_points):
        raise ConfigError(
            f"parallelism.split_points={split_points} must be {stages - 1} layer indices in "
            f"1..{len(named) - 1} for {stages} stages (each index starts a stage); the layers of "
            f"{type(model).__name__} are: {listing}."
        )
    if split_points != sorted(set(split_points)):
        raise ConfigError(
            f"parallelism.split_points={split_points} must be strictly increasing, e.g. "
            f"{sorted(set(split_points))}."
        )
    bounds = [0, *split_points, len(named)]
    parts = [Stage(named[start:end]) for start, end in itertools.pairwise(bounds)]
    return parts, split_points


class Stage(nn.Sequential):
    """Consecutive layers of the model; `layer_names` keeps their names in the model."""

    def __init__(self, named: Sequence[tuple[str, nn.Module]]) -> None:
        # a module name cannot contain '.', as 'layer1.0' does
        super().__init__(OrderedDict((name.replace(".", "_"), layer) for name, layer in named))
        self.layer_names = [name for name, _ in named]

    @property
    def span(self) -> str:
        """Its first and last layer, e.g. 'layer1.0..layer2.3'."""
        first, last = self.layer_names[0], self.layer_names[-1]
        return first if first == last else f"{first}..{last}"


def _check_covers(model: nn.Module, layers: list[nn.Module]) -> None:
    """Every parameter and buffer of the model is in some layer: the split drops nothing."""
    inside = {id(t) for layer in layers for t in (*layer.parameters(), *layer.buffers())}
    missing = [
        name
        for name, t in (*model.named_parameters(), *model.named_buffers())
        if id(t) not in inside
    ]
    if missing:
        raise ConfigError(
            f"{type(model).__name__}'s layer sequence leaves out {missing[:3]}: it cannot be "
            f"split into stages."
        )


class Pipeline(nn.Module):
    """The stages on their devices; `forward` runs micro-batches through them in GPipe order."""

    def __init__(
        self,
        model: nn.Module,
        stages: list[Stage],
        devices: list[torch.device],
        chunks: int = 1,
    ) -> None:
        super().__init__()
        self.stages = nn.ModuleList(
            to_device(stage, device) for stage, device in zip(stages, devices, strict=True)
        )
        self.devices = devices
        self.chunks = chunks
        self.__dict__["module"] = model  # the user's model (not registered: no second copy)
        self.measure_saved = False  # count the next training forward's saved activations
        self.saved_bytes = [0] * len(stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        micro = list(x.tensor_split(min(self.chunks, len(x))))
        n = len(self.stages)
        counting = self.measure_saved and self.training and torch.is_grad_enabled()
        if counting:
            self.saved_bytes = [0] * n
            counted = {p.untyped_storage().data_ptr() for p in self.parameters()}
        for clock in range(len(micro) + n - 1):
            for k in range(max(0, clock - len(micro) + 1), min(clock + 1, n)):
                i = clock - k  # stage k, micro-batch i
                hooks = self._count_saved(k, counted) if counting else contextlib.nullcontext()
                with hooks:
                    out = self.stages[k](micro[i])
                # hand over at once: the copy queues behind this stage's work, not the next's
                micro[i] = out.to(self.devices[(k + 1) % n], non_blocking=True)
        self.measure_saved = self.measure_saved and not counting
        return micro[0] if len(micro) == 1 else torch.cat(micro)

    def _count_saved(self, stage: int, counted: set[int]) -> contextlib.AbstractContextManager:
        """Add the bytes of each new tensor that `stage` saves for backward to its count."""

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in counted:
                counted.add(storage.data_ptr())
                self.saved_bytes[stage] += storage.nbytes()
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)

    def stage_params(self) -> list[int]:
        return [sum(p.numel() for p in stage.parameters()) for stage in self.stages]

    def stage_layers(self) -> list[str]:
        return [stage.span for stage in self.stages]
