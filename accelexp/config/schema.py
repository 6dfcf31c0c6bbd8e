"""The schemas in Hydra's ConfigStore: each config group's options' dataclasses
(`accelexp.schema`; the `parallelism` group's from the strategy table, `accelexp.parallel`), by
the name `conf/`'s defaults lists find them under (`- /schema/<group>/<name>@_here_`)."""

from __future__ import annotations

from accelexp.parallel import STRATEGIES
from accelexp.precision import Name
from accelexp.schema import (
    AdamWConfig,
    AmpConfig,
    CosineConfig,
    MLPConfig,
    OneCycleConfig,
    PrecisionConfig,
    ResNetConfig,
    SchedulerConfig,
    SGDConfig,
    SimpleCNNConfig,
    StepLRConfig,
    StoredDataConfig,
    SyntheticDataConfig,
    TorchvisionViTConfig,
    ViTConfig,
)

SCHEMAS: dict[str, dict[str, type]] = {
    "model": {
        "simple_cnn": SimpleCNNConfig,
        "mlp": MLPConfig,
        "resnet": ResNetConfig,
        "vit": ViTConfig,
        "torchvision_vit": TorchvisionViTConfig,
    },
    "data": {"stored": StoredDataConfig, "synthetic": SyntheticDataConfig},
    "precision": {"precision": PrecisionConfig, Name.AMP.value: AmpConfig},
    "parallelism": {name: preset.schema for name, preset in STRATEGIES.items()},  # parallel's
    "optimizer": {"sgd": SGDConfig, "adamw": AdamWConfig},
    "scheduler": {
        "none": SchedulerConfig,
        "steplr": StepLRConfig,
        "cosine": CosineConfig,
        "onecycle": OneCycleConfig,
    },
}
