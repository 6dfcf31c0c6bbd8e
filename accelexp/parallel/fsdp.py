"""`FSDPSync`: replicas hold shards of one model — PyTorch's FSDP2 (`fully_shard`).

`parallelism=fsdp` is one device × FSDP, one process per device, started and joined like `ddp`
(torchrun, srun, a world a launcher made; `distributed.py`). Each worker stores 1/N of every
parameter, its gradient and its optimizer state (ZeRO-3); a unit's full parameters are
all-gathered just before its forward (and again before its backward when
`reshard_after_forward`), and gradients are reduce-scattered to their owners after the backward.

- `granularity: block`: every layer of the model's layer sequence that holds parameters
  (`accelexp.models.layer_sequence`: a ResNet's residual blocks, a ViT's encoder blocks) is its
  own FSDP unit, then the root (with what is left, e.g. vit_b_16's embedding and head); only
  one or two units are unsharded at a time. `model`: one unit, the whole model (ZeRO-3's memory
  only between steps).
- `reshard_after_forward`: free the gathered parameters after each unit's forward (less memory,
  one more all-gather in the backward pass); false keeps them until the backward (ZeRO-2-like).
- Mixed precision follows the run's `Precision` (its `cast_param_dtype` and `reduce_dtype`):
  bf16 (or fp16 for amp on CUDA) parameters in forward and backward with fp32 master weights and
  optimizer; gradients reduced in fp32 (`reduce_in_fp32: false` reduces them in the compute
  dtype). Under `bf16_true` the parameters are bf16 already (converted before sharding): nothing
  is cast for the forward, and the bf16 gradients are reduce-scattered in fp32 all the same
  (FSDP2 casts them up and their reduced shards back to bf16; `reduce_in_fp32: false`: in bf16,
  half the bytes). fp16 on CUDA uses the run's
  ordinary GradScaler: under FSDP2 gradients are DTensors, and GradScaler's inf check on them
  covers every shard. BatchNorm layers keep fp32 weights (FSDP1's default; bf16_true keeps
  them fp32 too): a unit's BatchNorms are one fp32 group, sharded just before the unit (FSDP2
  takes one dtype of parameters per unit).
- `cpu_offload`: parameters, gradients and optimizer state live in host memory, on CUDA only
  (refused before any worker starts on a run without a GPU: `rules.py`).
- Gradient accumulation: the micro-batches that only accumulate skip the reduce-scatter
  (`set_requires_gradient_sync(False)`).
- `speed.compile`: each layer of the model's layer sequence that holds parameters (a residual
  or encoder block, a CNN's layer) is compiled on its own before it is sharded, as torchtitan
  does; the FSDP hooks around it stay eager. CUDA graphs (`reduce-overhead`) are refused: FSDP
  frees and re-gathers the weights a graph would capture at fixed addresses. Under bf16/amp the
  fp32 BatchNorm groups' hooks break a compiled block's graph at each BatchNorm.
- Checkpoints: the training state is saved sharded (`checkpoint_sharded`): every worker writes
  its shards of the model and optimizer in parallel with `torch.distributed.checkpoint`
  (`accelexp.checkpoint.save_shards`), nothing is gathered, and a resume on another number of
  workers reshards them. The best weights (`best.pt`) are the model alone, gathered to rank 0
  (`full_state_dict`, offloaded to its CPU), so they load into a plain model in a single
  process; so does a `last.pt` written gathered before, broadcast from rank 0 and resharded.

On the CPU, Gloo runs FSDP2's all-gather and reduce-scatter (torch 2.11 and 2.14).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.modules.batchnorm import _BatchNorm

from accelexp import record
from accelexp.models import layer_sequence
from accelexp.parallel.config import FSDPConfig
from accelexp.parallel.distributed import TorchDistributed
from accelexp.precision.runtime import Precision

GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)
SCATTERED = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def own_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of the model's layer sequence that hold parameters and are its own modules: a
    view made for cutting (vit_b_16's embedding) runs outside the model's forward, so its
    weights stay with the root unit."""
    own = {id(module) for module in model.modules()}
    return [
        layer
        for _, layer in layer_sequence(model)
        if id(layer) in own and any(True for _ in layer.parameters())
    ]


def compile_layers(model: nn.Module, mode: str) -> int:
    """Each of `own_layers` but a lone BatchNorm compiled: its `forward` replaced by
    `torch.compile` of it, so the FSDP hooks that run around the forward (in the module's
    `__call__`) stay eager, as torchtitan keeps them by compiling blocks before sharding them;
    the layers between them (activations, pooling) stay eager. The module itself is unchanged,
    so are its state dict's names. Returns how many layers were compiled."""
    compiled = 0
    for layer in own_layers(model):
        if isinstance(layer, _BatchNorm) or layer is model:
            continue
        layer.forward = torch.compile(layer.forward, mode=mode)
        compiled += 1
    return compiled


def shard_units(
    units: Sequence[nn.Module],
    root: nn.Module,
    mesh,
    precision: Precision,
    *,
    reshard_after_forward: bool,
    reduce_in_fp32: bool = True,
    cpu_offload: bool = False,
) -> tuple[int, int]:
    """Each of `units` (a model's layers, in order), then `root` with what is left, made an
    FSDP2 unit sharded over `mesh`, in the run's `precision` (the module docstring's mixed
    precision and fp32 BatchNorm groups). Returns how many units and fp32 BatchNorm groups."""
    dtype = precision.compute_dtype  # the parameters' in forward and backward; None: fp32
    # None: the parameters are stored in the compute dtype already (bf16_true)
    cast = precision.cast_param_dtype
    options = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=cast, reduce_dtype=precision.reduce_dtype(reduce_in_fp32)
        ),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    # BatchNorm keeps fp32 weights, as FSDP1's MixedPrecision does by default: its running
    # statistics are fp32 buffers, and batch_norm takes low-precision inputs with fp32
    # weights and statistics, not bf16/fp16 weights with fp32 statistics
    norm_options = {**options, "mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float32)}
    count, norm_groups, grouped = 0, 0, set()
    for unit in [*units, root]:
        # under mixed precision or bf16_true, the unit's BatchNorms not yet in one are sharded
        # first, as one group that keeps fp32 weights (one all-gather)
        norms = [m for m in unit.modules() if isinstance(m, _BatchNorm) and m not in grouped]
        grouped.update(norms)
        if dtype is not None and norms and norms != [unit]:
            fully_shard(norms, **norm_options)
            norm_groups += 1
        fully_shard(unit, **(norm_options if isinstance(unit, _BatchNorm) else options))
        count += 1
    return count, norm_groups


class FSDPSync(TorchDistributed):
    cfg: FSDPConfig
    name = "fsdp"
    shards = True
    checkpoint_sharded = True
    compiles_units = True
    compiled = 0  # layers compiled before sharding (speed.compile)

    def start(self, device: torch.device, shape) -> None:
        super().start(device, shape)
        # the world's 1-D mesh, made once its process group is (with real tensors: a memory
        # forecast wraps the model in fake ones, accelexp.forecast)
        self.mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))

    def wrap(
        self, model: nn.Module, precision: Precision, compile_mode: str | None = None
    ) -> nn.Module:
        cfg = self.cfg
        if compile_mode:
            self.compiled = compile_layers(model, compile_mode)
        units = own_layers(model) if cfg.granularity == "block" else []
        self.units, self.norm_groups = shard_units(
            units,
            model,
            self.mesh,
            precision,
            reshard_after_forward=cfg.reshard_after_forward,
            reduce_in_fp32=cfg.reduce_in_fp32,
            cpu_offload=cfg.cpu_offload,
        )
        return model

    def describe(self) -> dict[str, int | str]:
        facts = {record.FSDP_UNITS: self.units, record.FSDP_FP32_NORM_GROUPS: self.norm_groups}
        return facts | ({record.FSDP_COMPILED_LAYERS: self.compiled} if self.compiled else {})

    @contextlib.contextmanager
    def backward_context(self, model: nn.Module, sync: bool):
        model.set_requires_gradient_sync(sync)
        yield

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        return get_model_state_dict(model, options=GATHERED)

    def load_model_state_dict(self, model: nn.Module, state: dict | None) -> None:
        set_model_state_dict(model, state or {}, options=SCATTERED)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return get_optimizer_state_dict(model, optimizer, options=GATHERED)

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict | None
    ) -> None:
        set_optimizer_state_dict(model, optimizer, state or {}, options=SCATTERED)

    def comm_advice(self) -> list[tuple[str, str]]:
        advice = [("parallelism=ddp", "the model fits in one device: no all-gathers at all")]
        if self.cfg.reshard_after_forward:
            advice.append(
                (
                    "parallelism.reshard_after_forward=false",
                    "keeps gathered parameters to the backward: one all-gather less per step",
                )
            )
        return advice
