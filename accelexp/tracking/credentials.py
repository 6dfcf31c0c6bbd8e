"""Credentials in a tracking URI (`http://user:password@host:5000`): used, never written down.

MLflow takes a tracking server's basic-auth credentials from `MLFLOW_TRACKING_USERNAME` and
`MLFLOW_TRACKING_PASSWORD`; `use_uri_credentials` moves them there (worker processes and a sweep's
jobs inherit them) and hands back the URI without them, so the config that is logged, saved and
checkpointed never holds the password. What was recorded before that (Hydra's `.hydra/*.yaml`, the
command line's overrides) is cleaned with `scrub_hydra_files` and `strip`; messages show URIs
through `redact`.
"""

from __future__ import annotations

import base64
import os
import re
import urllib.parse
from pathlib import Path

USERNAME_ENV = "MLFLOW_TRACKING_USERNAME"
PASSWORD_ENV = "MLFLOW_TRACKING_PASSWORD"
HIDDEN = "***"

# scheme://user:password@ (any scheme: a database URI's password is hidden in messages too)
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^/\s@]*@")
# http(s)://userinfo@ : what MLflow can take from the environment instead
_HTTP_USERINFO = re.compile(r"(?P<head>\bhttps?://)[^/\s@]*@", re.IGNORECASE)


def split(uri: str) -> tuple[str, str | None, str | None]:
    """`http://alice:s3cret@host:5000/x` -> ('http://host:5000/x', 'alice', 's3cret'),
    percent-escapes decoded; other URIs, and http(s) ones without credentials, come back whole."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme.lower() not in ("http", "https") or "@" not in parts.netloc:
        return uri, None, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, has_password, password = userinfo.partition(":")
    clean = urllib.parse.urlunsplit(parts._replace(netloc=host))
    return (
        clean,
        urllib.parse.unquote(user) or None,
        urllib.parse.unquote(password) if has_password else None,
    )


def strip(text: str) -> str:
    """Drop the `user:password@` of every http(s) URI in `text` (a command-line override, say)."""
    return _HTTP_USERINFO.sub(r"\g<head>", text)


def redact(text: str) -> str:
    """Every URI's password in `text` shown as `***`: `http://alice:***@host:5000`."""
    return _USERINFO.sub(rf"\g<head>{HIDDEN}@", text)


def use_uri_credentials(uri: str) -> str:
    """Put the credentials of an http(s) tracking URI into MLflow's environment variables and
    return the URI without them; any other URI is returned as it is."""
    clean, user, password = split(uri)
    if user is not None:
        os.environ[USERNAME_ENV] = user
    if password is not None:
        os.environ[PASSWORD_ENV] = password
    return clean


def basic_auth_header(uri: str) -> dict[str, str]:
    """An HTTP basic-auth header from the URI's credentials, else from MLflow's variables."""
    _, user, password = split(uri)
    if user is None:
        user, password = os.environ.get(USERNAME_ENV), os.environ.get(PASSWORD_ENV)
    if not user:
        return {}
    token = base64.b64encode(f"{user}:{password or ''}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def scrub_hydra_files(folder: str | Path, uri: str) -> list[Path]:
    """Replace the password of `uri` by `***` in what Hydra wrote into `folder` before accelexp
    ran (`.hydra/*.yaml`, a sweep's `multirun.yaml`); returns the files changed."""
    _, _, password = split(uri)
    if not password:
        return []
    typed = urllib.parse.urlsplit(uri).netloc.rpartition("@")[0].partition(":")[2]
    secrets = sorted({typed, password}, key=len, reverse=True)
    folder = Path(folder)
    changed = []
    for path in [*sorted((folder / ".hydra").glob("*.yaml")), folder / "multirun.yaml"]:
        if not path.is_file():
            continue
        text = path.read_text()
        scrubbed = text
        for secret in secrets:
            scrubbed = scrubbed.replace(secret, HIDDEN)
        if scrubbed != text:
            path.write_text(scrubbed)
            changed.append(path)
    return changed
