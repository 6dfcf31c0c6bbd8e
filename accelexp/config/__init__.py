"""Configuration: the structured schema (`schema`, its keys declared with their help and what
they affect: `accelexp.keys`) registered for Hydra (`store`), the checks Hydra cannot do
(`validate`, and `resources` for this machine), the validated config as the schema's
dataclasses (`typed`: what `accelexp.train` hands the layers below), a run's identity
(`identity`: the keys it leaves out), what `conf/` offers (`catalog`) and the `--help` built
from it (`help`)."""

from accelexp.config.store import register_configs
from accelexp.config.typed import typed
from accelexp.config.validate import validate
from accelexp.errors import ConfigError
from accelexp.schema import Config

__all__ = ["Config", "ConfigError", "register_configs", "typed", "validate"]
