"""accelexp's entry point: compose a run with Hydra, then train, test and track it.

python run.py                                   # defaults: simple_cnn on Fashion-MNIST, fp32
python run.py precision=amp scheduler=onecycle  # pick group options
python run.py -m precision=fp32,amp             # a sweep: one MLflow run per job
python run.py --help                            # groups, options and examples
"""

from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from accelexp.config import register_configs
from accelexp.errors import AccelexpError

log = logging.getLogger("accelexp")
register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from accelexp.launch import launch  # torch loads after Hydra has parsed the command line

    hydra_cfg = HydraConfig.get()
    try:
        metrics = launch(cfg, hydra_cfg.runtime.output_dir, hydra_cfg.overrides.task)
    except AccelexpError as error:
        log.error("%s", error)
        sys.exit(2)
    return metrics["test_acc"]


if __name__ == "__main__":
    main()
