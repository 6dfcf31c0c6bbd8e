"""Numeric precision of a run: fp32, fp16 AMP with a GradScaler, bf16 autocast, bf16 weights
(`bf16_true`) or fp8 matmuls (`fp8`) — per device type.

Like Composer's `Precision`, one small object owns the autocast context and the loss scaling, so
the training loop says `with precision.autocast(): ...` and `precision.backward(loss)` and never
asks which precision it runs in. On a CPU, `amp` means bf16 autocast without a scaler (CPUs have
no fast fp16 path and bf16 needs no scaling); this is said once in the log.

This module is the one place that maps a `precision` option and a device type to dtypes: what
the model computes in (`compute_dtype`, `effective_name`; FSDP gathers its parameters in it),
what its parameters, gradients and optimizer state are stored in (`param_dtype`; its inputs are
cast to it: `cast_inputs`), what gradients are reduced in (`reduce_dtype`), and how the model is
made ready before a strategy wraps it (`prepare_model`). It is built once, on the device the
strategy chose, and owned by the strategy (`Strategy.precision`); the option's names, torch-free,
are the package's (`accelexp.precision.Name`).

- `bf16_true` (Lightning's "bf16-true"): the model is converted to bf16 before the strategy
  wraps it — weights, hence gradients and optimizer state, in bf16, no fp32 master copy — its
  inputs are cast to bf16, and nothing is autocast or scaled. Half the memory of the model's
  state, at some cost in accuracy (an update smaller than a weight's bf16 spacing is lost).
  BatchNorm layers stay fp32, where Lightning converts them too: bf16 BatchNorm runs in torch
  (on a CPU as on CUDA), but its running statistics move by `momentum` x (batch statistic -
  running) a step, which rounds to nothing in bf16 once that is under half a bf16 spacing (1/256
  at 1.0): they stop about five spacings short, 1-3 % off the fp32 statistics that evaluation
  normalises by (200 steps of N(0.3, 0.5²) on this CPU: mean 0.297, var 0.246 vs 0.300, 0.249).
  They are 2 x channels numbers a layer; batch_norm takes bf16 inputs with fp32 weights, as it
  does under autocast.
- `fp8`: torchao's float8 training (`torchao.float8.convert_to_float8_training`): every
  `nn.Linear` whose dimensions are multiples of 16 (what fp8 matmuls take) computes in fp8 with
  dynamic tensorwise scales, the rest under bf16 autocast; weights and optimizer state fp32. It
  needs fp8 tensor cores, a CUDA GPU of compute capability 8.9 or more (Ada, Hopper, Blackwell):
  refused elsewhere before any worker starts (`accelexp.precision.fp8_problem`, asked by
  `accelexp.config.resources`). torchao is imported only there.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from accelexp import record
from accelexp.errors import ConfigError
from accelexp.precision import Name, fp8_problem

log = logging.getLogger(__name__)

FP8_MULTIPLE = 16  # torchao's fp8 matmuls take dimensions that are multiples of 16


def float8_eligible(module: nn.Module, fqn: str = "") -> bool:
    """torchao's `module_filter_fn`: a linear layer whose in and out features are multiples of
    16 (fp8 matmuls refuse others); every other layer keeps its bf16 autocast."""
    return (
        isinstance(module, nn.Linear)
        and module.in_features % FP8_MULTIPLE == 0
        and module.out_features % FP8_MULTIPLE == 0
    )


def _convert(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every floating parameter and buffer of `model` but BatchNorm's in `dtype`, in place
    (memory format kept; a parameter shared by two modules stays shared). New parameters rather
    than `model.to(dtype)`: `Module.to` cannot swap the fake tensors of a memory forecast
    (`accelexp.forecast`, under FakeTensorMode) for their converted copies."""
    converted: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, _BatchNorm):
            continue
        for name, param in module._parameters.items():
            if param is None or not param.is_floating_point():
                continue
            if id(param) not in converted:
                tensor = param.detach().to(dtype)
                converted[id(param)] = nn.Parameter(tensor, requires_grad=param.requires_grad)
            module._parameters[name] = converted[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype)
    return model


class Precision:
    def __init__(
        self,
        name: str,
        device: torch.device,
        init_scale: float = 65536.0,
        growth_interval: int = 2000,
    ) -> None:
        self.name = Name(name)  # an unknown name fails here, naming itself
        self.device_type = device.type
        # what the model computes in; None: fp32
        self.compute_dtype: torch.dtype | None = {
            Name.FP32: None,
            Name.BF16: torch.bfloat16,
            Name.AMP: torch.float16 if device.type == "cuda" else torch.bfloat16,
            Name.BF16_TRUE: torch.bfloat16,
            Name.FP8: torch.bfloat16,  # what fp8 matmuls leave: the rest, under autocast
        }[name]
        # what parameters, gradients and optimizer state are stored in (the inputs are cast to
        # it); BatchNorm's stay fp32 (module docstring)
        self.param_dtype = torch.bfloat16 if name == Name.BF16_TRUE else torch.float32
        # what autocast computes in: None, no autocast (fp32, and bf16_true: already bf16)
        self.autocast_dtype = None if name == Name.BF16_TRUE else self.compute_dtype
        self.scaler: torch.amp.GradScaler | None = None
        self._scaler_keys = {"init_scale": init_scale, "growth_interval": growth_interval}
        if self.autocast_dtype is torch.float16:
            self.scaler = torch.amp.GradScaler(
                device.type, init_scale=init_scale, growth_interval=growth_interval
            )
        if name == Name.AMP and device.type != "cuda":
            log.info("precision=amp on %s: bf16 autocast without a GradScaler", device.type)

    @classmethod
    def from_config(cls, cfg: Any, device: torch.device) -> Precision:
        """From the `precision` config group's option, typed (`accelexp.schema.PrecisionConfig`,
        which imports this package's names: not imported back here): its name, and the
        GradScaler's keys where the option has them (`AmpConfig`)."""
        scaler = {
            key: getattr(cfg, key) for key in ("init_scale", "growth_interval") if hasattr(cfg, key)
        }
        return cls(cfg.name, device, **scaler)

    @property
    def effective_name(self) -> str:
        """The option this run really computes in: `bf16` for `amp` on a CPU, else `name`."""
        half = self.autocast_dtype is torch.bfloat16 and self.name == Name.AMP
        return Name.BF16 if half else self.name

    @property
    def cast_param_dtype(self) -> torch.dtype | None:
        """What parameters are cast to for forward and backward (FSDP's `param_dtype`): the
        compute dtype where they are stored in another; None where they compute as stored."""
        return None if self.compute_dtype in (None, self.param_dtype) else self.compute_dtype

    def reduce_dtype(self, in_fp32: bool) -> torch.dtype:
        """The dtype sharded gradients are reduced in (FSDP's `reduce_dtype`): fp32 when asked
        or when computing in fp32, else the compute dtype (bf16_true: its gradients' own)."""
        return torch.float32 if in_fp32 or self.compute_dtype is None else self.compute_dtype

    def describe(self) -> dict[str, str]:
        """What the run logs of its dtypes (params): `param_dtype`, e.g. bfloat16."""
        return {record.PARAM_DTYPE: str(self.param_dtype).removeprefix("torch.")}

    # --- the model and its inputs -----------------------------------------------------------
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The model as this precision trains it, before a strategy places and wraps it:
        bf16_true's in bf16 (BatchNorm in fp32), fp8's linear layers converted to torchao's
        Float8Linear; as it is otherwise."""
        if self.name == Name.BF16_TRUE:
            return _convert(model, self.param_dtype)
        if self.name == Name.FP8:
            return self._to_float8(model)
        return model

    def cast_inputs(self, images: torch.Tensor) -> torch.Tensor:
        """A batch as the model takes it: in `param_dtype` (bf16_true's bf16), else as it is
        (autocast casts inside the model)."""
        if self.param_dtype is torch.float32 or not images.is_floating_point():
            return images
        return images.to(self.param_dtype)

    def _to_float8(self, model: nn.Module) -> nn.Module:
        capabilities = []
        if self.device_type == "cuda":
            capabilities = [
                torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())
            ]
        problem = fp8_problem(self.device_type, capabilities)
        if problem:  # refused before any worker starts; a process given such a world ends here
            raise ConfigError(problem)
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError as error:
            raise ConfigError(
                f"precision=fp8 needs torchao, which is not importable here ({error}): "
                f"`pip install 'torchao>=0.14'`, or use precision=bf16."
            ) from error
        eligible = [name for name, m in model.named_modules() if float8_eligible(m)]
        convert_to_float8_training(
            model, config=Float8LinearConfig(), module_filter_fn=float8_eligible
        )
        linear = sum(isinstance(m, nn.Linear) for m in model.modules())
        log.info(
            "precision=fp8: %d of %d linear layers compute in fp8 (%s); the rest in bf16",
            len(eligible), linear, ", ".join(eligible) or "none",
        )  # fmt: skip
        return model

    # --- the step -----------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the forward pass and the loss run in."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale, once they are complete (after a manual
        sync such as Horovod's `optimizer.synchronize()`) and before clipping or `step`; without
        a scaler, nothing to do."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the optimizer, skipping steps with inf/nan gradients when scaling."""
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def agree_on_overflow(self, group=None) -> None:
        """Ranks that each hold a part of the model (a pipeline's stages, `stages_per_rank`)
        decide together whether a step overflowed: the GradScaler becomes FSDP's
        `ShardedGradScaler` (the same settings), whose inf check is summed over `group` (None:
        the world) in `unscale_`, so every rank skips the same steps and keeps the same scale.
        Each rank's scale is made now: the ranks that compute no loss never `scale` one."""
        if self.scaler is None:
            return
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        self.scaler = ShardedGradScaler(self.device_type, process_group=group, **self._scaler_keys)
        self.scaler.scale(torch.zeros((), device=self.device_type))

    def grad_scale(self) -> float | None:
        return self.scaler.get_scale() if self.scaler else None

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's `state_dict()` back into the scaler (nothing without one or it)."""
        if self.scaler and state:
            self.scaler.load_state_dict(state)
