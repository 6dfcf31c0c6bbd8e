"""Configuration: the structured schema (`schema`) and the checks Hydra cannot do (`validate`)."""

from accelexp.config.schema import Config, register_configs
from accelexp.config.validate import ConfigError, validate

__all__ = ["Config", "ConfigError", "register_configs", "validate"]
