"""Configuration: the structured schema (`schema`), the checks Hydra cannot do (`validate`, and
`resources` for this machine), what `conf/` offers (`catalog`) and the `--help` built from it
(`help`)."""

from accelexp.config.schema import Config, register_configs
from accelexp.config.validate import validate
from accelexp.errors import ConfigError

__all__ = ["Config", "ConfigError", "register_configs", "validate"]
