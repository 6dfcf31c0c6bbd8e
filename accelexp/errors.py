"""Errors the user can fix. `run.py` prints their message alone (no traceback) and exits 2."""


class AccelexpError(Exception):
    """Something in the user's config or machine is wrong; the message says what to do."""
