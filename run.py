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
from omegaconf import DictConfig, OmegaConf

from accelexp import outcome, signals, startup
from accelexp.config import register_configs
from accelexp.config.help import register_help
from accelexp.errors import AccelexpError, ConfigError

log = logging.getLogger("accelexp")
register_configs()
register_help()  # the groups, options and keys `--help` lists


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | list[float] | None:
    from accelexp import forecast
    from accelexp.config.validate import (
        check_one_job_of_a_study,
        check_repeats_of_one_job,
        validate,
    )
    from accelexp.launch import launch  # torch loads after Hydra has parsed the command line
    from accelexp.lockstep import gate as lockstep_gate
    from accelexp.objective import sweeper_value
    from accelexp.parallel import run_label
    from accelexp.parallel.world import current_world
    from accelexp.tracking.credentials import PasswordInUriError
    from accelexp.tracking.life import RUN_ID_FILE, close_run, record_failure
    from accelexp.tracking.names import run_tags
    from accelexp.tracking.store import StoreFullError

    hydra_cfg = HydraConfig.get()
    output_dir = hydra_cfg.runtime.output_dir
    overrides = OmegaConf.to_container(hydra_cfg.overrides.task)  # as typed: ${...} unresolved
    try:  # user:password@ in the tracking URI: into the environment, out of all that is recorded
        overrides = outcome.keep_credentials_out(cfg.mlflow, overrides, output_dir)
    except PasswordInUriError as error:  # said here: Hydra would print the overrides, password too
        log.error("%s", error)
        sys.exit(outcome.EXIT_BAD_INPUT)
    in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
    in_lockstep = lockstep_gate.in_lockstep()  # a job a lockstep sweep started (run.py, not -m)
    # a reused run folder: the run recorded there is another job's, never this one's to close
    if not lockstep_gate.reincarnated():  # a lockstep job's next process: its own folder
        (Path(output_dir) / RUN_ID_FILE).unlink(missing_ok=True)
    try:
        if not (in_sweep or in_lockstep):
            check_one_job_of_a_study(hydra_cfg.sweeper.get("params") or {}, overrides)
            check_repeats_of_one_job(overrides)
        if cfg.estimate:  # the memory forecast, instead of training
            validate(cfg)
            print(forecast.report(cfg))
            return None
        return sweeper_value(cfg.objective, launch(cfg, output_dir, overrides))
    except KeyboardInterrupt as error:
        stop = signals.interruption(error)
        if current_world().rank == 0:  # its workers may have died before closing the run
            close_run(cfg.mlflow, output_dir, outcome.KILLED)
        outcome.current_sweep_state().abort(outcome.KILLED)
        log.warning(
            "Stopped by %s. The run is KILLED; what it logged is kept. Its last checkpoint is in "
            "%s/checkpoints: continue with the same command and resume=auto.",
            stop.name,
            output_dir,
        )
        sys.exit(outcome.exit_code(stop))
    except Exception as error:
        ours = isinstance(error, AccelexpError)
        log.error(
            "%s%s", error if ours else traceback.format_exc(), _resume_hint(error, output_dir)
        )
        first_rank = current_world().rank == 0  # under srun every task runs this function
        stored = not isinstance(error, StoreFullError)  # a full store takes no failure either
        recorded = in_sweep or in_lockstep or (Path(output_dir) / RUN_ID_FILE).is_file()
        if first_rank and stored and recorded:
            tags = run_tags(cfg, cfg.parallelism.nprocs, overrides)
            label = None if isinstance(error, ConfigError) else run_label(cfg.parallelism)
            record_failure(cfg, output_dir, traceback.format_exc(), tags, overrides, label)
        if in_sweep:
            return None  # the sweep goes on; its parent run ends FAILED and says which job
        # a lockstep job exits non-zero: its sweeper says which job failed, the others go on
        if ours:
            sys.exit(outcome.EXIT_BAD_INPUT)
        raise


def _resume_hint(error: Exception, output_dir: str) -> str:
    """For a store that stopped taking writes mid-run: how to continue, where a checkpoint is."""
    from accelexp.checkpoint import LAST
    from accelexp.tracking.store import TrackingUnavailableError

    last = Path(output_dir) / "checkpoints" / LAST
    if not isinstance(error, TrackingUnavailableError) or not last.is_file():
        return ""
    return (
        f" Once it takes writes again, continue from the last checkpoint ({last}) with the same "
        f"command and resume=auto."
    )


if __name__ == "__main__":
    outcome.exit_now(startup.run_main(main))
