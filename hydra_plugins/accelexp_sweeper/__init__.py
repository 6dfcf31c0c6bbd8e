"""accelexp's sweeper as a Hydra plugin: Hydra's basic sweeper with `repeats=N` round-robin.

Hydra instantiates sweepers from its `hydra_plugins` package only; what the sweeper does lives in
`accelexp.sweeper` (`plan`), this is the plugin's shell and its config (`hydra/sweeper=repeat`).
"""

# no `from __future__ import annotations`: Hydra's plugin scan executes this module outside
# sys.modules, where dataclasses cannot resolve string annotations
import logging
import sys
from dataclasses import dataclass
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper, BasicSweeperConf
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.types import Override

log = logging.getLogger(__name__)


@dataclass
class RepeatSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins.accelexp_sweeper.RepeatSweeper"


ConfigStore.instance().store(
    group="hydra/sweeper", name="repeat", node=RepeatSweeperConf, provider="accelexp"
)


class RepeatSweeper(BasicSweeper):
    """The basic sweeper's jobs, each run `repeats` times, round after round."""

    def split_arguments(  # type: ignore[override]  # called on the instance by `sweep`
        self, overrides: list[Override], max_batch_size: int | None
    ) -> list[list[list[str]]]:
        from accelexp.sweeper import plan

        assert self.config is not None
        (jobs,) = BasicSweeper.split_arguments(overrides, None)
        jobs = plan(overrides, jobs, self.config)
        return list(BasicSweeper.split_overrides_to_chunks(jobs, max_batch_size))

    def sweep(self, arguments: list[str]) -> Any:
        from accelexp import outcome
        from accelexp.errors import ConfigError

        try:
            return super().sweep(arguments)
        except ConfigError as error:  # before any job ran: one message, exit 2
            log.error("%s", error)
            outcome.current_sweep_state().abort(outcome.FAILED)  # its parent run is open
            sys.exit(outcome.EXIT_BAD_INPUT)
