"""Errors the user can fix. `run.py` prints their message alone (no traceback) and exits 2.

They live here, below every other module, so models, data, parallel code and the config
package raise them without importing one another.
"""


class AccelexpError(Exception):
    """Something in the user's config or machine is wrong; the message says what to do."""


class ConfigError(AccelexpError, ValueError):
    """A configuration value is not allowed; the message says which and what to type instead."""
