"""Credentials in a URI (`http://user:password@host:5000`, `postgresql://u:pw@db/x`): used,
never written down.

A tracking URI's credentials move to the environment variables its client reads them from:
MLflow's `MLFLOW_TRACKING_USERNAME`/`MLFLOW_TRACKING_PASSWORD` for a tracking server (http(s)),
libpq's `PGUSER`/`PGPASSWORD` for a PostgreSQL store (`ENV_OF`). `use_uri_credentials` moves them
there (worker processes and a sweep's jobs inherit them) and hands back the URI without them, so
the config that is logged, saved and checkpointed never holds the password. A password in any
other URI (a MySQL or SQL Server store, `mlflow.artifact_location`) cannot move out of it: it is
refused (`PasswordInUriError`) with the ways to give it instead. What was recorded before that
(Hydra's `.hydra/*.yaml`, the command line's overrides) is cleaned with `scrub_hydra_files` and
`strip`; messages show URIs through `redact`.

Launched workers get these variables from a file, not from their launcher's environment:
horovodrun writes every variable it passes on into each worker's command line, which `ps` shows
to every user of the machine. `secrets_to_file` takes them out of the launcher's environment into
a file only this user can read, named by `ACCELEXP_SECRETS`; a worker reads it first
(`secrets_from_file`), and the job removes it when its workers are gone.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

from accelexp.errors import ConfigError

USERNAME_ENV = "MLFLOW_TRACKING_USERNAME"
PASSWORD_ENV = "MLFLOW_TRACKING_PASSWORD"
# (user, password) variables by a URI's scheme (`postgresql+psycopg` by `postgresql`)
ENV_OF = {
    "http": (USERNAME_ENV, PASSWORD_ENV),
    "https": (USERNAME_ENV, PASSWORD_ENV),
    "postgresql": ("PGUSER", "PGPASSWORD"),  # libpq's: psycopg and psycopg2 read them
    "postgres": ("PGUSER", "PGPASSWORD"),
}
HIDDEN = "***"
SECRETS_FILE_ENV = "ACCELEXP_SECRETS"
SECRET_VARIABLES = tuple(dict.fromkeys(name for pair in ENV_OF.values() for name in pair))

# scheme://user:password@ (any scheme: a database URI's password is hidden in messages too)
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^/\s@]*@")
# scheme://userinfo@ (any userinfo: `strip` drops it where ENV_OF carries the scheme's)
_ANY_USERINFO = re.compile(r"(?P<head>\b(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://)[^/\s@]*@")


class PasswordInUriError(ConfigError):
    """A URI holds a password that cannot be taken out of it and would be written down."""


def _env_of(uri: str) -> tuple[str, str] | None:
    return _env_of_scheme(urllib.parse.urlsplit(uri).scheme)


def _env_of_scheme(scheme: str) -> tuple[str, str] | None:
    """ENV_OF's variables for `scheme` (`postgresql+psycopg` by `postgresql`)."""
    return ENV_OF.get(scheme.lower().partition("+")[0])


def _userinfo(uri: str) -> tuple[str | None, str | None]:
    """(user, password) of `uri` as typed (percent-escapes kept), None where absent."""
    netloc = urllib.parse.urlsplit(uri).netloc
    if "@" not in netloc:
        return None, None
    user, has_password, password = netloc.rpartition("@")[0].partition(":")
    return user, password if has_password else None


def split(uri: str) -> tuple[str, str | None, str | None]:
    """`http://alice:s3cret@host:5000/x` -> ('http://host:5000/x', 'alice', 's3cret'),
    percent-escapes decoded, for the schemes whose credentials the environment carries
    (`ENV_OF`); other URIs, and those without credentials, come back whole."""
    user, password = _userinfo(uri)
    if _env_of(uri) is None or user is None:
        return uri, None, None
    parts = urllib.parse.urlsplit(uri)
    clean = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    return (
        clean,
        urllib.parse.unquote(user) or None,
        None if password is None else urllib.parse.unquote(password),
    )


def strip(text: str) -> str:
    """Drop the `user:password@` of every URI in `text` (a command-line override, say) whose
    credentials the environment carries: http(s), postgresql."""
    return _ANY_USERINFO.sub(
        lambda found: found["head"] if _env_of_scheme(found["scheme"]) else found[0], text
    )


def redact(text: str) -> str:
    """Every URI's password in `text` shown as `***`: `http://alice:***@host:5000`."""
    return _USERINFO.sub(rf"\g<head>{HIDDEN}@", text)


def use_uri_credentials(uri: str) -> str:
    """Put the credentials of a tracking URI into the environment variables its client reads
    (`ENV_OF`) and return the URI without them; a URI without credentials is returned as it is.
    Raises `PasswordInUriError` for a password no variable can carry (a MySQL store, say)."""
    env = _env_of(uri)
    if env is None:
        if _userinfo(uri)[1] is not None:
            raise PasswordInUriError(
                f"mlflow.tracking_uri holds a password ({redact(uri)}), which its database "
                f"driver reads only from the URI, so it would be written into the run's records. "
                f"Give it another way: a PostgreSQL store takes it from PGPASSWORD or ~/.pgpass "
                f"(postgresql://USER@HOST/DB); or serve this store with `mlflow server "
                f"--backend-store-uri URI` and set mlflow.tracking_uri=http://HOST:5000 with "
                f"{USERNAME_ENV} and {PASSWORD_ENV}."
            )
        return uri
    clean, user, password = split(uri)
    if user is not None:
        os.environ[env[0]] = user
    if password is not None:
        os.environ[env[1]] = password
    return clean


def refuse_password(key: str, uri: str | None) -> None:
    """Raise `PasswordInUriError` when `uri` (the value of `key`) holds a password; for URIs that
    MLflow stores as they are (`mlflow.artifact_location`, kept with the experiment)."""
    if uri and _userinfo(uri)[1] is not None:
        raise PasswordInUriError(
            f"{key} holds a password ({redact(uri)}), which MLflow would store with the "
            f"experiment and its runs. Use a location whose credentials come from elsewhere "
            f"(s3:// with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, sftp:// with an SSH key) or "
            f"leave it null."
        )


def basic_auth_header(uri: str) -> dict[str, str]:
    """An HTTP basic-auth header from the URI's credentials, else from MLflow's variables."""
    _, user, password = split(uri)
    if user is None:
        user, password = os.environ.get(USERNAME_ENV), os.environ.get(PASSWORD_ENV)
    if not user:
        return {}
    token = base64.b64encode(f"{user}:{password or ''}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def scrub_hydra_files(folder: str | Path, *uris: str | None) -> list[Path]:
    """Replace the passwords of `uris` (any scheme) by `***` in what Hydra wrote into `folder`
    before accelexp ran (`.hydra/*.yaml`, a sweep's `multirun.yaml`); returns the files changed."""
    secrets: set[str] = set()
    for uri in uris:
        typed = _userinfo(uri)[1] if uri else None
        if typed:
            secrets |= {typed, urllib.parse.unquote(typed)}
    if not secrets:
        return []
    folder = Path(folder)
    changed = []
    for path in [*sorted((folder / ".hydra").glob("*.yaml")), folder / "multirun.yaml"]:
        if not path.is_file():
            continue
        text = path.read_text()
        scrubbed = text
        for secret in sorted(secrets, key=len, reverse=True):
            scrubbed = scrubbed.replace(secret, HIDDEN)
        if scrubbed != text:
            path.write_text(scrubbed)
            changed.append(path)
    return changed


@contextlib.contextmanager
def secrets_to_file(env: dict[str, str]) -> Iterator[None]:
    """Move `env`'s credential variables (`SECRET_VARIABLES`) into a file readable by this user
    only, named by `env[SECRETS_FILE_ENV]`, for the block (workers started inside it read it);
    the file is removed at its end. Nothing to move: nothing written."""
    found = {name: env.pop(name) for name in SECRET_VARIABLES if name in env}
    if not found:
        yield
        return
    handle, path = tempfile.mkstemp(prefix="accelexp-secrets-")  # mode 0600
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(found, file)
        env[SECRETS_FILE_ENV] = path
        yield
    finally:
        Path(path).unlink(missing_ok=True)


def secrets_from_file() -> None:
    """In a launched worker: the credential variables its job moved into a file, back into this
    process's environment."""
    path = os.environ.pop(SECRETS_FILE_ENV, None)
    if path:
        os.environ.update(json.loads(Path(path).read_text()))
