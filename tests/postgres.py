"""A throwaway PostgreSQL cluster for the tests of a team's tracking store (test_team_store.py).

`cluster()` runs Debian's own server binaries (`/usr/lib/postgresql/<version>/bin`, installed by
scripts/setup.sh): `initdb` into a new folder, the server on a free port of 127.0.0.1 with
password (SCRAM) authentication, one empty database, and `pg_ctl stop` after. Durability is off
(fsync, full-page writes, synchronous commit) and the buffers are small: a throwaway store starts
in about a second. PostgreSQL refuses to run as root, so as root (CI) the cluster is run as the
`postgres` system user (the Debian package's), its folder owned by it; otherwise as this user.
Every wait is bounded, and fails with the server's log.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from accelexp.parallel.world import free_port

DEBIAN_BINARIES = Path("/usr/lib/postgresql")
WAIT_S = 120  # a hang guard for initdb, start and stop, not a measure of speed
SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "fsync": "off",
    "full_page_writes": "off",
    "synchronous_commit": "off",
    "shared_buffers": "16MB",
    "max_connections": "50",
    "logging_collector": "off",
}


class NoPostgresError(RuntimeError):
    """PostgreSQL's server binaries are not installed."""


def binaries() -> Path:
    """The newest `/usr/lib/postgresql/<version>/bin` that has `initdb` and `pg_ctl`."""
    found = [
        folder / "bin"
        for folder in DEBIAN_BINARIES.glob("*")
        if (folder / "bin" / "initdb").is_file() and (folder / "bin" / "pg_ctl").is_file()
    ]
    if not found:
        raise NoPostgresError(
            f"PostgreSQL's server is not installed (no {DEBIAN_BINARIES}/<version>/bin/initdb): "
            f"run scripts/setup.sh as root, or `apt-get install postgresql`"
        )
    return max(found, key=lambda path: [int(n) for n in re.findall(r"\d+", path.parent.name)])


@dataclass(frozen=True)
class Cluster:
    port: int
    user: str
    password: str
    database: str
    log: Path

    def uri(self) -> str:
        """`postgresql+psycopg://user:password@127.0.0.1:port/database`."""
        return (
            f"postgresql+psycopg://{self.user}:{self.password}@127.0.0.1:{self.port}/"
            f"{self.database}"
        )


def _as_owner(owner: str | None, *command: str | Path) -> list[str]:
    """`command` run as `owner` (root's `runuser`), or as this user when `owner` is None."""
    command_line = [str(part) for part in command]
    return ["runuser", "-u", owner, "--", *command_line] if owner else command_line


def _run(command: list[str], log: Path, what: str) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_S)
    except subprocess.TimeoutExpired as error:
        said = log.read_text() if log.is_file() else ""
        raise RuntimeError(f"PostgreSQL's {what} took over {WAIT_S} s:\n{said[-3000:]}") from error
    if done.returncode != 0:
        said = log.read_text() if log.is_file() else ""
        raise RuntimeError(
            f"PostgreSQL's {what} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
            f"\n{said[-3000:]}"
        )


@contextlib.contextmanager
def cluster(user: str, password: str, database: str = "mlflow") -> Iterator[Cluster]:
    """A new PostgreSQL cluster on a free port of 127.0.0.1 whose superuser `user` logs in with
    `password`, holding the empty `database`; stopped and removed after. Its server is this
    process's child (its CPU time counts among the tests'), stopped by `pg_ctl stop`."""
    bin_dir = binaries()
    owner = "postgres" if os.geteuid() == 0 else None  # PostgreSQL refuses to run as root
    home = Path(tempfile.mkdtemp(prefix="accelexp-pg-"))  # not under pytest's root-only folder
    data, log, secret = home / "data", home / "server.log", home / "password"
    secret.write_text(password)
    if owner:
        record = pwd.getpwnam(owner)
        for path in (home, secret):
            os.chown(path, record.pw_uid, record.pw_gid)
    server = None
    try:
        _run(
            _as_owner(owner, bin_dir / "initdb", "-D", data, "-U", user, f"--pwfile={secret}",
                      "--auth=scram-sha-256", "--no-sync", "--no-instructions", "-E", "UTF8",
                      "--locale=C"),
            log, "initdb",
        )  # fmt: skip
        secret.unlink()
        port = free_port()
        settings = {**SETTINGS, "port": str(port), "unix_socket_directories": f"'{home}'"}
        with open(data / "postgresql.conf", "a") as conf:
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())
        with open(log, "a") as said:
            server = subprocess.Popen(
                _as_owner(owner, bin_dir / "postgres", "-D", data),
                stdout=said, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        found = Cluster(port, user, password, database, log)
        _create_database(found, server)
        yield found
    finally:
        if server is not None:
            _stop(server, owner, bin_dir, data)
        shutil.rmtree(home, ignore_errors=True)


def _create_database(cluster: Cluster, server: subprocess.Popen) -> None:
    """Wait for the server to take connections (as long as `WAIT_S`, failing with its log when
    it ends or never answers), then create the cluster's database."""
    import psycopg

    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            connection = psycopg.connect(
                host="127.0.0.1", port=cluster.port, user=cluster.user,
                password=cluster.password, dbname="postgres", autocommit=True,
                connect_timeout=10,
            )  # fmt: skip
            break
        except psycopg.OperationalError as error:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"PostgreSQL's server did not start ({error}):\n"
                    f"{cluster.log.read_text()[-3000:]}"
                ) from error
            time.sleep(0.1)
    with connection:
        connection.execute(f'CREATE DATABASE "{cluster.database}"')


def _stop(server: subprocess.Popen, owner: str | None, bin_dir: Path, data: Path) -> None:
    """Stop the server: fast (sessions ended, no waiting for clients), else immediate, else
    killed."""
    for mode in ("fast", "immediate"):
        if server.poll() is not None:
            return
        stop = _as_owner(owner, bin_dir / "pg_ctl", "stop", "-D", data, "-m", mode, "-w",
                         "-t", str(WAIT_S))  # fmt: skip
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(stop, capture_output=True, timeout=WAIT_S)
            server.wait(timeout=WAIT_S)
    if server.poll() is None:
        subprocess.run(_as_owner(owner, "pkill", "-KILL", "-F", data / "postmaster.pid"),
                       capture_output=True, timeout=WAIT_S)  # fmt: skip
        server.kill()
        server.wait(timeout=WAIT_S)
