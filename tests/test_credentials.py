"""A tracking URI with `user:password@` works, and the password is written and printed nowhere.

A real `mlflow server` on 127.0.0.1 (it ignores basic auth, which is all this needs; the one
tests/test_outage.py starts, before its outage) takes a 2-worker run whose command line carries
`http://alice:s3cret-XYZ@...`; then every file of the run's folder, of the server's store and
artifacts, and the output is searched for the password. A sweep with a password in its server's
URI is tests/test_team_store.py's (a `run.py -m` process through its server). A small HTTP
server that does demand basic auth checks that the credentials are sent. A PostgreSQL store's
password in the URI is tested against a real database (its authentication needs it) in
tests/test_team_store.py.
"""

from __future__ import annotations

import base64
import http.server
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TINY_DATA, TINY_RUN, output_of, run_here
from mlflow import MlflowClient
from test_outage import outage  # noqa: F401 (a fixture: the server the run logs to)

from accelexp.parallel.world import free_port
from accelexp.tracking import credentials
from accelexp.tracking.names import where_to_look
from accelexp.tracking.store import TrackingUnavailableError, check_reachable

SECRET = "s3cret-XYZ"


# --- the URI's credentials -----------------------------------------------------------------


def test_split_takes_the_credentials_out_of_an_http_uri():
    assert credentials.split(f"http://alice:{SECRET}@127.0.0.1:5000") == (
        "http://127.0.0.1:5000",
        "alice",
        SECRET,
    )
    assert credentials.split("https://bob:p%40ss%3Aw@mlflow.example/api") == (
        "https://mlflow.example/api",
        "bob",
        "p@ss:w",
    )
    assert credentials.split("http://token@host:5000") == ("http://host:5000", "token", None)


def test_split_takes_the_credentials_out_of_a_postgresql_uri():
    assert credentials.split(f"postgresql+psycopg://u:{SECRET}@db:5432/mlflow") == (
        "postgresql+psycopg://db:5432/mlflow",
        "u",
        SECRET,
    )


@pytest.mark.parametrize(
    "uri", ["http://127.0.0.1:5000", "sqlite:///outputs/mlflow.db", "mysql://u:p@db/mlflow"]
)
def test_split_leaves_other_uris_whole(uri):
    assert credentials.split(uri) == (uri, None, None)


def test_redact_and_strip_hide_the_password_in_any_text():
    text = f"mlflow.tracking_uri=http://alice:{SECRET}@127.0.0.1:5000 precision=bf16"
    assert credentials.redact(text) == (
        "mlflow.tracking_uri=http://alice:***@127.0.0.1:5000 precision=bf16"
    )
    assert credentials.strip(text) == "mlflow.tracking_uri=http://127.0.0.1:5000 precision=bf16"
    assert credentials.redact("postgresql://u:pw@db:5432/x") == "postgresql://u:***@db:5432/x"
    database, passwordless = "postgresql+psycopg://u:pw@db/x", "mysql://u@db/x"
    assert credentials.strip(database) == "postgresql+psycopg://db/x"
    assert credentials.strip(passwordless) == passwordless  # no password, no variable: it stays
    untouched = "http://127.0.0.1:5000/#/experiments/1 sqlite:///a/b.db epochs=2"
    assert credentials.redact(untouched) == credentials.strip(untouched) == untouched


def test_the_credentials_go_to_mlflows_variables(monkeypatch):
    monkeypatch.delenv(credentials.USERNAME_ENV, raising=False)
    monkeypatch.delenv(credentials.PASSWORD_ENV, raising=False)
    assert credentials.use_uri_credentials("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert credentials.USERNAME_ENV not in os.environ
    clean = credentials.use_uri_credentials(f"http://alice:{SECRET}@127.0.0.1:5000")
    assert clean == "http://127.0.0.1:5000"
    assert os.environ[credentials.USERNAME_ENV] == "alice"
    assert os.environ[credentials.PASSWORD_ENV] == SECRET


def test_a_postgresql_password_goes_to_libpqs_variables(monkeypatch):
    monkeypatch.setenv("PGUSER", "")  # unset again after the test, as they were
    monkeypatch.setenv("PGPASSWORD", "")
    clean = credentials.use_uri_credentials(f"postgresql://u:{SECRET}@db/mlflow")
    assert clean == "postgresql://db/mlflow"
    assert (os.environ["PGUSER"], os.environ["PGPASSWORD"]) == ("u", SECRET)


@pytest.mark.parametrize(
    "uri", [f"mysql://u:{SECRET}@db/mlflow", f"mssql+pyodbc://u:{SECRET}@db/mlflow"]
)
def test_a_password_no_variable_carries_is_refused(uri):
    with pytest.raises(credentials.PasswordInUriError, match="PGPASSWORD") as error:
        credentials.use_uri_credentials(uri)
    assert SECRET not in str(error.value) and "u:***@db" in str(error.value)


def test_launched_workers_get_the_credentials_from_a_private_file_not_the_environment(
    monkeypatch,
):
    """horovodrun writes each variable it passes on into its workers' command lines (`ps`
    shows them to everyone): the launcher's environment carries only the file's name."""
    env = {"PGPASSWORD": "pw-0451", "PATH": "/bin"}
    with credentials.secrets_to_file(env):
        path = Path(env[credentials.SECRETS_FILE_ENV])
        assert "pw-0451" not in str(env)
        assert path.stat().st_mode & 0o777 == 0o600
        monkeypatch.setenv(credentials.SECRETS_FILE_ENV, str(path))  # as a worker's
        monkeypatch.setenv("PGPASSWORD", "")
        credentials.secrets_from_file()
        assert os.environ["PGPASSWORD"] == "pw-0451"
    assert not path.exists()  # the job's end removes it


def test_hydra_files_are_scrubbed(tmp_path):
    (tmp_path / ".hydra").mkdir()
    overrides = tmp_path / ".hydra" / "overrides.yaml"
    overrides.write_text(f"- mlflow.tracking_uri=http://alice:{SECRET}@127.0.0.1:5000\n")
    config = tmp_path / ".hydra" / "config.yaml"
    config.write_text("epochs: 1\n")
    uri = f"http://alice:{SECRET}@127.0.0.1:5000"
    assert credentials.scrub_hydra_files(tmp_path, uri) == [overrides]
    assert overrides.read_text() == "- mlflow.tracking_uri=http://alice:***@127.0.0.1:5000\n"
    assert config.read_text() == "epochs: 1\n"


def test_links_and_messages_carry_no_password():
    uri = f"http://alice:{SECRET}@127.0.0.1:5000"
    links = where_to_look(uri, "1", "abc")
    assert SECRET not in links and "alice" not in links
    assert "http://127.0.0.1:5000/#/experiments/1/runs/abc" in links
    assert SECRET not in where_to_look(f"postgresql://u:{SECRET}@db/mlflow", "1", "abc")
    with pytest.raises(TrackingUnavailableError) as error:
        check_reachable(f"http://alice:{SECRET}@127.0.0.1:{free_port()}", timeout_s=2)
    assert SECRET not in str(error.value) and "alice:***@" in str(error.value)


class _Guarded(http.server.BaseHTTPRequestHandler):
    """/health answers 200 only to alice with the right password, 401 to anyone else."""

    expected = "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode()

    def do_GET(self) -> None:  # http.server calls it by this name
        ok = self.headers.get("Authorization") == self.expected
        self.send_response(200 if ok else 401)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def guarded_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Guarded)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_the_health_check_sends_the_credentials(guarded_server, monkeypatch):
    monkeypatch.delenv(credentials.USERNAME_ENV, raising=False)
    monkeypatch.delenv(credentials.PASSWORD_ENV, raising=False)
    check_reachable(f"http://alice:{SECRET}@127.0.0.1:{guarded_server}")  # from the URI
    with pytest.raises(TrackingUnavailableError, match="Unauthorized"):
        check_reachable(f"http://127.0.0.1:{guarded_server}")
    monkeypatch.setenv(credentials.USERNAME_ENV, "alice")
    monkeypatch.setenv(credentials.PASSWORD_ENV, SECRET)
    check_reachable(f"http://127.0.0.1:{guarded_server}")  # from MLflow's variables


# --- a real run against a real server ---------------------------------------------------------


def files_with_secret(*folders: Path) -> list[str]:
    return [
        str(path)
        for folder in folders
        for path in folder.rglob("*")
        if path.is_file() and SECRET.encode() in path.read_bytes()
    ]


def secret_uri(base: str) -> str:
    return base.replace("http://", f"http://alice:{SECRET}@")


def run_with_a_password(base: str, folder: Path) -> list:
    """`python run.py` in this process (`run_here`) with `http://alice:<password>@` in its
    tracking URI: 2 DDP workers, started from files in the run's folder, the checkpoint logged;
    [its exit code, what it printed]. Run on tests/test_outage.py's server before its outage
    (one server start for both)."""
    result = run_here(
        None,
        f"mlflow.tracking_uri={secret_uri(base)}",
        "mlflow.experiment=single",
        "data=synthetic",
        *TINY_DATA,
        *TINY_RUN,
        "mlflow.log_checkpoint=true",
        "parallelism=ddp",  # two worker processes, started from files in the run's folder
        "parallelism.nprocs=2",
        tmp_path=folder,
    )
    return [result.returncode, output_of(result)]


def test_a_run_with_a_password_in_the_uri_works_and_keeps_it_nowhere(outage):  # noqa: F811
    """On a real `mlflow server` of a SQLite store: the run finishes, its params and tags carry
    the URI without the password, and no file of the run's folder or of the server's (its store,
    its artifacts, its logs) nor the output holds it. A sweep with a password in the server's URI
    is tests/test_team_store.py's (a `run.py -m` process)."""
    folder, built = outage
    code, text = built["password"]
    assert code == 0, text
    base = built["url"]
    client = MlflowClient(built["store"])  # the server's store, read after the server is gone
    (run,) = client.search_runs([client.get_experiment_by_name("single").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["mlflow.tracking_uri"] == base
    assert f"mlflow.tracking_uri={base}" in run.data.tags["overrides"]
    assert (folder / "password" / "job" / ".hydra" / "overrides.yaml").is_file()
    assert (folder / "password" / "job" / "workers" / "job.json").is_file()
    assert SECRET not in text
    assert files_with_secret(folder) == []  # the run's folder, the server's store and artifacts


# --- a database store -----------------------------------------------------------------------


def _said_once(text: str) -> bool:
    """One message: a single line that is not a warning, and no traceback."""
    lines = [line for line in text.splitlines() if line.strip()]
    return len(lines) == 1 and "Traceback" not in text


@pytest.mark.parametrize(
    "scheme, said",
    [
        ("postgresql+psycopg", "Cannot connect to the MLflow store postgresql+psycopg://127.0.0.1"),
        ("mysql", "PGPASSWORD or ~/.pgpass"),  # its driver reads the password from the URI only
    ],
    ids=["postgresql", "mysql"],
)
def test_a_database_uri_with_a_password_fails_at_once_and_keeps_it_nowhere(
    scheme, said, tmp_path, cli
):
    start = time.monotonic()
    result = cli(f"mlflow.tracking_uri={scheme}://u:{SECRET}@127.0.0.1:{free_port()}/db",
                 "data=synthetic", *TINY_DATA, *TINY_RUN, tmp_path=tmp_path)  # fmt: skip
    took = time.monotonic() - start
    text = output_of(result)
    assert result.returncode == 2, text
    assert said in text and _said_once(text), text
    assert took < 30, f"{took:.1f} s"  # a hang guard: it says so in seconds (MLflow: ~110 s)
    assert SECRET not in text
    assert (tmp_path / "job" / ".hydra" / "overrides.yaml").is_file()
    assert files_with_secret(tmp_path) == []


def test_a_password_in_the_artifact_location_is_refused(tmp_path, cli):
    result = cli(f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db",  # refused before it opens
                 f"mlflow.artifact_location=ftp://u:{SECRET}@127.0.0.1/artifacts",
                 "data=synthetic", *TINY_DATA, *TINY_RUN, tmp_path=tmp_path)  # fmt: skip
    text = output_of(result)
    assert result.returncode == 2, text
    assert "mlflow.artifact_location holds a password (ftp://u:***@" in text and _said_once(text)
    assert SECRET not in text
    assert files_with_secret(tmp_path) == []


def test_a_database_that_never_answers_is_said_within_the_timeout():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connects, never speaks
        uri = f"postgresql+psycopg://u:{SECRET}@127.0.0.1:{silent.getsockname()[1]}/db"
        start = time.monotonic()
        with pytest.raises(TrackingUnavailableError, match=r"no answer in 1 s") as error:
            check_reachable(uri, timeout_s=1)
    assert time.monotonic() - start < 10
    assert SECRET not in str(error.value) and "u:***@127.0.0.1" in str(error.value)


def test_a_job_that_fails_by_a_bug_prints_no_password(tmp_path, cli, monkeypatch):
    def bug(*args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr("accelexp.launch.launch", bug)  # Hydra then prints the job's overrides
    result = cli(f"mlflow.tracking_uri=postgresql+psycopg://u:{SECRET}@127.0.0.1:1/db",
                 "data=synthetic", *TINY_DATA, *TINY_RUN, tmp_path=tmp_path)  # fmt: skip
    text = output_of(result)
    assert result.returncode == 1 and "Error executing job with overrides" in text, text
    assert "u:***@127.0.0.1:1/db" in text and SECRET not in text
    assert files_with_secret(tmp_path) == []
