"""accelexp's entry point: compose a run with Hydra, then train, test and track it.

python run.py                                   # defaults: simple_cnn on Fashion-MNIST, fp32
python run.py precision=amp scheduler=onecycle  # pick group options
python run.py -m precision=fp32,amp             # a sweep: a parent MLflow run, a child per job
python run.py --help                            # groups, options and examples
"""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from accelexp import callbacks
from accelexp.config import register_configs
from accelexp.errors import AccelexpError

log = logging.getLogger("accelexp")
register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from accelexp.launch import launch  # torch loads after Hydra has parsed the command line
    from accelexp.parallel.world import current_world
    from accelexp.tracking.runs import RUN_ID_FILE, record_failure, run_tags

    hydra_cfg = HydraConfig.get()
    output_dir, overrides = hydra_cfg.runtime.output_dir, hydra_cfg.overrides.task
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        return launch(cfg, output_dir, overrides)["test_acc"]
    except Exception as error:
        ours = isinstance(error, AccelexpError)
        log.error("%s", error if ours else traceback.format_exc())
        first_rank = current_world().rank == 0  # under srun every task runs this function
        if first_rank and (in_sweep or (Path(output_dir) / RUN_ID_FILE).is_file()):
            tags = run_tags(cfg, cfg.parallelism.nprocs, overrides)
            record_failure(cfg, output_dir, traceback.format_exc(), tags)
        if in_sweep:
            return None  # the sweep goes on; its parent run ends FAILED and says which job
        if ours:
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
    if callbacks.failed_in_last_sweep:
        sys.exit(1)
