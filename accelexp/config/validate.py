"""The checks Hydra's schema cannot express: choices and ranges, with messages a user can act on.

`validate(cfg)` raises one `ConfigError` listing every problem found, each naming the key, the
value and what is allowed, so a typo costs one run of `python run.py`, not an hour of training.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

from omegaconf import DictConfig, OmegaConf

from accelexp.errors import AccelexpError

PRECISIONS = ("fp32", "amp", "bf16")
DEVICES = ("auto", "cpu", "cuda")
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
OPTIMIZER_IMPLS = ("auto", "for_loop", "foreach", "fused")


class ConfigError(AccelexpError, ValueError):
    """A configuration value is not allowed; the message says which and what to type instead."""


def _rules() -> list[tuple[str, Callable[[Any], bool], str]]:
    positive = (lambda v: v > 0, "a number > 0")
    non_negative = (lambda v: v >= 0, "a number >= 0")
    at_least_one = (lambda v: v >= 1, "an integer >= 1")
    optional_at_least_one = (lambda v: v is None or v >= 1, "null or an integer >= 1")
    fraction = (lambda v: 0 <= v < 1, "a number in [0, 1)")
    auto_or_bool = (lambda v: v == "auto" or isinstance(v, bool), "auto, true or false")
    return [
        ("epochs", *at_least_one),
        ("max_steps_per_epoch", *optional_at_least_one),
        ("target_accuracy", lambda v: v is None or 0 < v <= 1, "null or a number in (0, 1]"),
        ("device", lambda v: v in DEVICES, f"one of {', '.join(DEVICES)}"),
        ("threads", *optional_at_least_one),
        ("log_every_n_steps", *at_least_one),
        ("data.batch_size", *at_least_one),
        ("data.eval_batch_size", *at_least_one),
        ("data.num_workers", *non_negative),
        ("data.val_fraction", *fraction),
        ("data.on_device", *auto_or_bool),
        ("data.num_train", *at_least_one),
        ("data.num_test", *at_least_one),
        ("data.image_size", lambda v: v >= 8, "an integer >= 8"),
        ("data.channels", *at_least_one),
        ("data.num_classes", lambda v: v >= 2, "an integer >= 2"),
        ("precision.name", lambda v: v in PRECISIONS, f"one of {', '.join(PRECISIONS)}"),
        ("precision.init_scale", *positive),
        ("precision.growth_interval", *at_least_one),
        ("parallelism.nprocs", *at_least_one),
        ("parallelism.accumulate_steps", *at_least_one),
        (
            "parallelism.lr_scaling",
            lambda v: v in ("linear", "sqrt", "none"),
            "linear, sqrt or none",
        ),
        ("parallelism.backend", lambda v: v in ("auto", "nccl", "gloo"), "auto, nccl or gloo"),
        ("parallelism.bucket_cap_mb", *positive),
        ("parallelism.comm_hook", lambda v: v in ("none", "fp16", "bf16"), "none, fp16 or bf16"),
        ("parallelism.compression", lambda v: v in ("none", "fp16"), "none or fp16"),
        ("parallelism.op", lambda v: v in ("average", "adasum"), "average or adasum"),
        (
            "parallelism.master_port",
            lambda v: v is None or 1 <= v <= 65535,
            "null or a port 1-65535",
        ),
        (
            "parallelism.devices",
            lambda v: v is None or (len(v) >= 1 and all(isinstance(d, str) or d >= 0 for d in v)),
            "null or a non-empty list of devices",
        ),
        ("parallelism.stages", *optional_at_least_one),
        ("parallelism.chunks", *at_least_one),
        ("parallelism.balance", lambda v: v in ("params", "compute"), "params or compute"),
        (
            "parallelism.split_points",
            lambda v: v is None or (all(b > a for a, b in pairwise(v)) and min(v, default=1) > 0),
            "null or strictly increasing layer indices >= 1, e.g. [4, 9]",
        ),
        ("parallelism.engine", lambda v: v in ("ddp", "horovod"), "ddp or horovod"),
        ("parallelism.devices_per_replica", *at_least_one),
        ("debug.raise_at_step", *at_least_one),
        ("speed.channels_last", *auto_or_bool),
        ("speed.compile", lambda v: v in COMPILE_MODES, f"one of {', '.join(COMPILE_MODES)}"),
        (
            "speed.optimizer_impl",
            lambda v: v in OPTIMIZER_IMPLS,
            f"one of {', '.join(OPTIMIZER_IMPLS)}",
        ),
        ("optimizer.lr", *positive),
        ("optimizer.weight_decay", *non_negative),
        ("optimizer.momentum", *fraction),
        ("optimizer.eps", *positive),
        (
            "optimizer.betas",
            lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
            "two numbers in [0, 1)",
        ),
        ("model.channels", lambda v: len(v) == 2 and all(c >= 1 for c in v), "two integers >= 1"),
        ("model.hidden", *at_least_one),
        ("model.widths", lambda v: len(v) >= 1 and all(w >= 1 for w in v), "integers >= 1"),
        ("model.dropout", *fraction),
        ("scheduler.warmup_epochs", *non_negative),
        ("scheduler.warmup_start_factor", lambda v: 0 < v <= 1, "a number in (0, 1]"),
        ("scheduler.step_size", *at_least_one),
        ("scheduler.gamma", lambda v: 0 < v <= 1, "a number in (0, 1]"),
        ("scheduler.min_lr_factor", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        ("scheduler.pct_start", lambda v: 0 < v < 1, "a number in (0, 1)"),
        ("scheduler.div_factor", *positive),
        ("scheduler.final_div_factor", *positive),
    ]


def validate(cfg: DictConfig) -> None:
    """Raise `ConfigError` naming every out-of-range value of a composed config."""
    problems = []
    for key, ok, allowed in _rules():
        value = OmegaConf.select(cfg, key, default="__absent__")
        if value == "__absent__":  # the chosen group option has no such key
            continue
        if isinstance(value, DictConfig | list) or OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
        if not ok(value):
            problems.append(f"  {key}={value!r} is not allowed: expected {allowed}.")
    if cfg.scheduler.warmup_epochs >= cfg.epochs and cfg.scheduler.warmup_epochs > 0:
        problems.append(
            f"  scheduler.warmup_epochs={cfg.scheduler.warmup_epochs} must be shorter than "
            f"epochs={cfg.epochs}."
        )
    problems += _pipeline_problems(cfg.parallelism, cfg.data.batch_size)
    if cfg.data.on_device is True and cfg.data.num_workers > 0:
        problems.append(
            f"  data.on_device=true gathers batches on the device, where loader worker processes "
            f"have nothing to do: use data.num_workers=0 (now {cfg.data.num_workers}), or "
            f"data.on_device=false to gather on the host with workers."
        )
    if problems:
        raise ConfigError(
            "Invalid configuration:\n" + "\n".join(problems) + "\n"
            "Fix the override(s) above, e.g. `python run.py data.batch_size=128`; "
            "`python run.py --cfg job` prints the composed config."
        )


def _pipeline_problems(parallelism: DictConfig, batch_size: int) -> list[str]:
    """Keys of `model` and `hybrid` that only make sense together."""
    if "chunks" not in parallelism:
        return []
    problems = []
    chunks, stages = parallelism.chunks, parallelism.stages
    if chunks >= 1 and (chunks > batch_size or batch_size % chunks):
        divisors = [c for c in range(1, min(batch_size, 64) + 1) if batch_size % c == 0]
        problems.append(
            f"  parallelism.chunks={chunks} does not cut data.batch_size={batch_size} into equal "
            f"micro-batches: use chunks in {divisors} or a batch size divisible by {chunks}."
        )
    split_points = parallelism.split_points
    if split_points is not None and stages is not None and len(split_points) != stages - 1:
        problems.append(
            f"  parallelism.split_points={list(split_points)} gives {len(split_points) + 1} "
            f"stages, but parallelism.stages={stages}: give {stages - 1} split point(s) or set "
            f"parallelism.stages={len(split_points) + 1}."
        )
    per_replica = parallelism.get("devices_per_replica")
    if per_replica and stages is not None and stages < per_replica:
        problems.append(
            f"  parallelism.stages={stages} is fewer than parallelism.devices_per_replica="
            f"{per_replica}: some devices would sit idle. Use stages>={per_replica} or null."
        )
    return problems
