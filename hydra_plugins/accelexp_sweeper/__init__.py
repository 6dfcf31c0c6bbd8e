"""accelexp's sweepers as Hydra plugins: Hydra's basic sweeper with `repeats=N` round-robin
(`hydra/sweeper=repeat`, conf/default_sweeper.yaml's), and the autotune loop
(`hydra/sweeper=autotune`, chosen by `+experiment=autotune`).

Hydra instantiates sweepers from its `hydra_plugins` package only; what the sweepers do lives in
`accelexp.sweeper` (`plan`) and `accelexp.autotune` (`Autotune`); these are the plugins' shells
and their configs.
"""

# no `from __future__ import annotations`: Hydra's plugin scan executes this module outside
# sys.modules, where dataclasses cannot resolve string annotations
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper, BasicSweeperConf
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

log = logging.getLogger(__name__)


@dataclass
class RepeatSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins.accelexp_sweeper.RepeatSweeper"


ConfigStore.instance().store(
    group="hydra/sweeper", name="repeat", node=RepeatSweeperConf, provider="accelexp"
)


@dataclass
class AutotuneSweeperConf:
    _target_: str = "hydra_plugins.accelexp_sweeper.AutotuneSweeper"


ConfigStore.instance().store(
    group="hydra/sweeper", name="autotune", node=AutotuneSweeperConf, provider="accelexp"
)


def _refusing_bad_input(sweep: Any) -> Any:
    """`sweep()`, but a `ConfigError` raised before any job ran is one message, the sweep's
    parent run FAILED and exit 2."""
    from accelexp import outcome
    from accelexp.errors import ConfigError

    try:
        return sweep()
    except ConfigError as error:
        log.error("%s", error)
        outcome.current_sweep_state().abort(outcome.FAILED)  # its parent run is open
        sys.exit(outcome.EXIT_BAD_INPUT)


class RepeatSweeper(BasicSweeper):
    """The basic sweeper's jobs, each run `repeats` times, round after round."""

    def split_arguments(  # type: ignore[override]  # called on the instance by `sweep`
        self, overrides: list[Override], max_batch_size: int | None
    ) -> list[list[list[str]]]:
        from accelexp.sweeper import check_configurations, plan

        assert self.config is not None and self.hydra_context is not None
        loader = self.hydra_context.config_loader
        (configurations,) = BasicSweeper.split_arguments(overrides, None)
        self.configurations = configurations  # before repeats (`accelexp.lockstep.sweep`)
        jobs = plan(overrides, configurations, self.config)
        check_configurations(
            overrides,
            configurations,
            lambda job: loader.load_sweep_config(master_config=self.config, sweep_overrides=job),
        )
        return list(BasicSweeper.split_overrides_to_chunks(jobs, max_batch_size))

    def sweep(self, arguments: list[str]) -> Any:
        return _refusing_bad_input(lambda: self._sweep(arguments))

    def _sweep(self, arguments: list[str]) -> Any:
        """Hydra's basic sweep, or repeat by repeat: lockstep incarnations, or rounds until a
        precision target (`accelexp.lockstep.sweep`)."""
        from omegaconf import OmegaConf

        from accelexp.lockstep import sweep as by_repeat

        assert self.config is not None and self.hydra_context is not None
        if self.config.compare == "repeats" and self.config.precision_target is None:
            return BasicSweeper.sweep(self, arguments)
        by_repeat.check(self.config, str(self.config.hydra.launcher._target_))
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([*self._parse_config(), *arguments])
        self.split_arguments(overrides, None)  # refuses what a sweep cannot repeat
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        self.validate_batch_is_legal(self.configurations)
        from accelexp import outcome

        sweep = outcome.current_sweep_state().running  # its parent run, for the jobs and ratios
        return by_repeat.Repeats(
            self.config, self.configurations, self._launch, self._compose, sweep
        ).run()

    def _compose(self, overrides: list[str]) -> DictConfig:
        assert self.config is not None and self.hydra_context is not None
        return self.hydra_context.config_loader.load_sweep_config(self.config, overrides)

    def _launch(self, batch: list[list[str]], first: int) -> Any:
        self.validate_batch_is_legal(batch)
        results = self.launcher.launch(batch, initial_job_idx=first)
        for result in results:
            _ = result.return_value  # a job that raised: raise it here, as Hydra's sweep does
        return results


class AutotuneSweeper(Sweeper):
    """Runs `accelexp.autotune.Autotune` from the command line's configuration: each batch of
    its jobs through the configured launcher, each job read back as its MLflow run."""

    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.launcher: Any = None
        self.job_index = 0

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> Any:
        return _refusing_bad_input(lambda: self._sweep(arguments))

    def _sweep(self, arguments: list[str]) -> Any:
        from omegaconf import OmegaConf

        from accelexp.autotune import Autotune
        from accelexp.autotune.path import ARTIFACTS, console, publish
        from accelexp.errors import ConfigError

        assert self.config is not None and self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        parsed = parser.parse_overrides(arguments)
        if any(o.get_key_element().lstrip("+~") == "repeat_index" for o in parsed):
            raise ConfigError("repeat_index is set by autotune for each round: leave it out.")
        swept = [o.input_line for o in parsed if o.is_sweep_override()]
        if swept:
            raise ConfigError(
                f"autotune starts from one configuration, and {' '.join(swept)} sweeps: give "
                f"it one value, or sweep without +experiment=autotune."
            )
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        uri = self.config.mlflow.tracking_uri
        loop = Autotune(
            self.config,
            arguments,
            run_jobs=self._run_jobs,
            composes=self._composes,
            tag_run=lambda run_id, tags: _set_tags(uri, run_id, tags),
            on_round=lambda path: publish(path, uri, sweep_dir / ARTIFACTS),
        )
        path = loop.run()
        log.info("%s", console(path, sweep_dir / ARTIFACTS))
        return path

    def _run_jobs(self, batch: list[list[str]]) -> list[Any]:
        """Run `batch` through the launcher; each job's MLflow run (None: it left none)."""
        from accelexp.tracking.life import RUN_ID_FILE
        from accelexp.tracking.query import run_record

        assert self.config is not None
        self.validate_batch_is_legal(batch)
        if self.config.compare == "lockstep":  # the batch's jobs live at once, taking turns
            output_dirs = self._lockstep(batch)
        else:
            returns = self.launcher.launch(batch, initial_job_idx=self.job_index)
            output_dirs = []
            for job in returns:
                _ = job.return_value  # a job that raised: raise it here, as Hydra's sweepers do
                output_dirs.append(Path(job.hydra_cfg.hydra.runtime.output_dir))
        self.job_index += len(batch)
        runs = []
        for output_dir in output_dirs:
            run_id = output_dir / RUN_ID_FILE
            uri = self.config.mlflow.tracking_uri
            runs.append(
                run_record(uri, run_id.read_text().strip(), histories=True)
                if run_id.is_file()
                else None
            )
        return runs

    def _lockstep(self, batch: list[list[str]]) -> list[Path]:
        """`batch` as one lockstep incarnation (`accelexp.lockstep.sweep`); its jobs' folders."""
        from accelexp import outcome
        from accelexp.lockstep import sweep as by_repeat

        assert self.config is not None and self.hydra_context is not None

        def compose(overrides: list[str]) -> DictConfig:
            assert self.config is not None and self.hydra_context is not None
            return self.hydra_context.config_loader.load_sweep_config(self.config, overrides)

        by_repeat.check(self.config, str(self.config.hydra.launcher._target_))
        configs = [by_repeat.job_config(compose, job) for job in batch]
        shared = by_repeat.shared_process(self.config.lockstep.process, configs)
        ends = by_repeat.incarnation(
            self.config, batch, self.job_index, compose, outcome.current_sweep_state().running,
            shared, by_repeat.names(batch, batch),
        )  # fmt: skip
        return [end.output_dir for end in ends]

    def _composes(self, overrides: list[str]) -> str:
        """What keeps `overrides` from composing, "" when they compose."""
        try:
            self.validate_batch_is_legal([overrides])
        except Exception as error:
            return str(error).strip().splitlines()[0]
        return ""


def _set_tags(uri: str, run_id: str, tags: Any) -> None:
    from accelexp.tracking.query import set_tags

    set_tags(uri, run_id, tags)
