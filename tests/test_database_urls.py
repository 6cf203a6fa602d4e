"""Database URLs: secrets never shown, read commands never create, `db upgrade` never downgrades.

The secrets sit in the user information (``postgresql+psycopg://u:PASSWORD@host/db``), in a query
parameter (``?password=...``), or past an unencoded ``@`` that makes the URL ambiguous. Each is
given to the real ``sustain`` (``python -m agent``, each command in a process of its own forked
from a zygote that did the imports: see ``forked_sustain``) against a SQLite path and against the
real PostgreSQL, with a database name that does not exist so that the errors happen, and looked
for in everything the command prints or logs.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote

import pytest
from conftest import POSTGRES_SERVER, start_agent
from hypothesis import assume, given
from hypothesis import strategies as st
from sqlalchemy.engine import URL
from test_daemon import STARTUP_SECONDS, quick_env, ready

from agent.archive.database import ArchiveError, head_revision, open_engine, upgrade
from agent.config import database_url as urls

NO_ARCHIVE = "no sustain archive here: run `sustain db upgrade`"


# `python -m agent` without its start-up: most of a command's time (about a second of CPU, several
# seconds of a loaded machine's) is the imports of the interpreter, SQLAlchemy, Alembic, pydantic
# and psycopg, paid again by every command. A zygote process imports them once and forks a child
# per command, which runs the real `python -m agent` module (runpy, as -m does) with the command's
# arguments, environment, working directory and a fresh stdin, stdout and stderr (files, read back
# as subprocess.run's capture), and exits as the interpreter would: SystemExit's code, a
# traceback and 1 for an uncaught exception, atexit handlers run, non-daemon threads joined. What
# the interpreter reads only at its start (PYTHON*, LD_*, locale and TZ variables) is the
# zygote's: a command whose environment differs there runs as a real subprocess instead.

ZYGOTE = r"""
import atexit, json, os, runpy, sys, threading, traceback
for name in sys.argv[1:]:
    try:
        __import__(name)
    except ImportError:
        pass
requests = os.fdopen(os.dup(0), "r")
replies = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)
os.dup2(null, 1)
print("{}", file=replies, flush=True)
for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        requests.close()
        replies.close()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        create = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], create),
                                (2, request["stderr"], create)):
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        sys.argv = ["-m", *request["args"]]
        code = 0
        try:
            runpy.run_module("agent", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            if isinstance(exc.code, int):
                code = exc.code
            elif exc.code is not None:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        try:
            for thread in threading.enumerate():
                if thread is not threading.main_thread() and not thread.daemon:
                    thread.join()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF)
    print(json.dumps({"pid": pid}), file=replies, flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)
"""
# What the commands import, imported once by the zygote (a name that is gone is skipped).
ZYGOTE_PRELOAD = (
    "agent.cli.main",
    "agent.cli.fleet",
    "agent.cli.health",
    "agent.config.settings",
    "agent.archive.database",
    "agent.reports.capacity",
    "agent.drift.detect",
    "agent.daemon",
    "sqlalchemy.dialects.postgresql.psycopg",
    "sqlalchemy.dialects.sqlite.pysqlite",
)
_STARTUP_VARIABLES = ("PYTHON", "LD_", "LANG", "LC_", "TZ")


class _Zygote:
    """One zygote per test process, started at its first command, gone with the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._startup: dict[str, str] = {}
        self._pending = b""

    @staticmethod
    def _startup_of(env: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k.startswith(_STARTUP_VARIABLES)}

    def _reply(self, deadline: float | None) -> dict[str, int] | None:
        assert self._process is not None
        assert self._process.stdout is not None
        fd = self._process.stdout.fileno()
        while b"\n" not in self._pending:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise EOFError("the zygote ended")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        reply: dict[str, int] = json.loads(line)
        return reply

    def _start(self, env: Mapping[str, str]) -> None:
        self.close()
        self._process = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, *ZYGOTE_PRELOAD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(env),
        )
        self._startup = self._startup_of(env)
        self._pending = b""
        self._reply(time.monotonic() + 120)  # imported

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def run(
        self, args: tuple[str, ...], env: Mapping[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str] | None:
        """The command's result, or None where it must run as a real subprocess."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start(env)
            elif self._startup_of(env) != self._startup:
                return None
            assert self._process is not None
            assert self._process.stdin is not None
            directory = Path(tempfile.mkdtemp(prefix="sustain-zygote-"))
            try:
                out, err = directory / "stdout", directory / "stderr"
                request = {
                    "args": args,
                    "env": dict(env),
                    "cwd": os.getcwd(),
                    "stdout": str(out),
                    "stderr": str(err),
                }
                self._process.stdin.write(json.dumps(request).encode() + b"\n")
                self._process.stdin.flush()
                reply = self._reply(time.monotonic() + 120)
                assert reply is not None, "the zygote did not fork"
                pid = reply["pid"]
                done = self._reply(time.monotonic() + timeout)
                if done is None:
                    os.kill(pid, signal.SIGKILL)
                    self._reply(None)
                    raise subprocess.TimeoutExpired(
                        ["sustain", *args], timeout, out.read_text(), err.read_text()
                    )
                return subprocess.CompletedProcess(
                    ["sustain", *args], done["code"], out.read_text(), err.read_text()
                )
            finally:
                shutil.rmtree(directory, ignore_errors=True)


_ZYGOTE = _Zygote()
atexit.register(_ZYGOTE.close)


def forked_sustain(
    args: tuple[str, ...] | list[str], env: Mapping[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """`python -m agent ARGS` in the environment ``env`` (the whole of it), stdout and stderr
    captured as text: forked from the zygote, or a real subprocess where it must be."""
    done = _ZYGOTE.run(tuple(args), env, timeout)
    if done is not None:
        return done
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(env),
        check=False,
    )


def sustain(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """`python -m agent ARGS` as tests/test_security.py's ``sustain`` runs it (this process's
    environment without SUSTAIN_* and FAKENVML_*, plus ``env``), forked from the zygote."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    full_env.update(env or {})
    return forked_sustain(args, full_env, timeout)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single line of a refused command (exit 2, nothing on stdout, no traceback)."""
    assert result.returncode == 2, result
    assert result.stdout == "", result
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def missing_database() -> str:
    return f"sustain_missing_{uuid.uuid4().hex[:12]}"


# Parsing, redacting and scrubbing by structure.


@pytest.mark.parametrize(
    ("url", "secret", "shown"),
    [
        (
            "postgresql+psycopg://u:hunter2@db/x",
            "hunter2",
            "postgresql+psycopg://u:***@db/x",
        ),
        (
            "postgresql+psycopg://u@host/x?password=secret2",
            "secret2",
            "postgresql+psycopg://u@host/x?password=***",
        ),
        (
            "postgresql+psycopg://u@db/x?sslmode=require&SSLPassword=k3y-pass&connect_timeout=5",
            "k3y-pass",
            "postgresql+psycopg://u@db/x?SSLPassword=***&connect_timeout=5&sslmode=require",
        ),
        ("postgresql://u@db/x?PWD=abc123&pwd=def456", "abc123", None),
        ("postgresql://u@db/x?client_secret=cs-777", "cs-777", None),
        ("postgresql://u@db/x?access_token=tok-888", "tok-888", None),
        ("postgresql://u@db/x?passwd=pw-999", "pw-999", None),
        ("postgresql://u:p%40ss%2Fw0rd@db/x", "p@ss/w0rd", "postgresql://u:***@db/x"),
    ],
)
def test_redact_hides_the_password_and_password_like_parameters(
    url: str, secret: str, shown: str | None
) -> None:
    parsed = urls.parse(url)
    redacted = urls.redact(parsed)
    assert secret not in redacted
    assert quote(secret, safe="") not in redacted
    assert "***" in redacted
    if shown is not None:
        assert redacted == shown
    assert secret in urls.secrets(parsed)


def test_redact_keeps_what_is_not_secret() -> None:
    parsed = urls.parse("postgresql+psycopg://sustain@db:5432/fleet?sslmode=verify-full&sslkey=k")
    assert urls.redact(parsed) == (
        "postgresql+psycopg://sustain@db:5432/fleet?sslkey=k&sslmode=verify-full"
    )
    assert urls.secrets(parsed) == []


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://u:p@ss@127.0.0.1/x",  # the password holds an @
        "postgresql+psycopg://u:p@ss:w0rd@127.0.0.1:5432/x",  # ... and what looks like a port
        "postgresql+psycopg://us@er:pw@127.0.0.1/x",  # the user name holds an @
        "postgresql+psycopg://us@er@127.0.0.1/x",
    ],
)
def test_an_unencoded_at_sign_is_refused_with_a_hint(url: str) -> None:
    with pytest.raises(urls.DatabaseUrlError) as caught:
        urls.parse(url)
    message = str(caught.value)
    assert "%40" in message
    assert "127.0.0.1" not in message  # the URL is never echoed: its password has no known end
    assert urls.redact_text(url) is None


def test_an_encoded_at_sign_is_part_of_the_password() -> None:
    parsed = urls.parse("postgresql+psycopg://u:p%40ss@127.0.0.1/x")
    assert (parsed.password, parsed.host) == ("p@ss", "127.0.0.1")
    assert urls.parse("sqlite:////var/lib/sustain/a@b.db").database == "/var/lib/sustain/a@b.db"
    assert urls.parse("postgresql://u@db/x?options=a@b").host == "db"


def test_scrub_replaces_whole_tokens_only() -> None:
    """A password "p" once turned every "p" of an error message into "***"."""
    parsed = urls.parse("postgresql+psycopg://postgres:p@127.0.0.1/nope")
    message = 'database "nope" does not exist; password=p, user postgres'
    assert urls.scrub(message, parsed) == (
        'database "nope" does not exist; password=***, user postgres'
    )


def test_scrub_catches_the_encoded_and_escaped_forms() -> None:
    parsed = urls.parse("postgresql://u@db/x?password=o'k%20it%40")  # o'k it@
    assert urls.scrub("dsn: password='o\\'k it@' host=db", parsed) == "dsn: password='***' host=db"
    assert urls.scrub("url: u:o%27k%20it%40@db", parsed) == "url: u:***@db"
    assert urls.scrub("form: password=o%27k+it%40&", parsed) == "form: password=***&"


SKELETON = "postgresql+psycopg://user:***@db.example:5432/archive?sslmode=require&sslpassword=***"
MESSAGE = 'connection failed: password "{}" rejected'


@given(secret=st.text(min_size=4, max_size=40).filter(str.isprintable))
def test_any_password_round_trips_and_never_shows(secret: str) -> None:
    assume(secret not in SKELETON + MESSAGE)
    assume("*" not in secret)
    text = (
        f"postgresql+psycopg://user:{quote(secret, safe='')}@db.example:5432/archive"
        f"?sslmode=require&sslpassword={quote(secret, safe='')}"
    )
    parsed = urls.parse(text)
    assert parsed.password == secret
    assert parsed.query["sslpassword"] == secret
    assert urls.redact(parsed) == SKELETON
    assert urls.scrub(MESSAGE.format(secret), parsed) == MESSAGE.format("***")


def error_of(text: str) -> str:
    with pytest.raises(urls.DatabaseUrlError) as raised:
        urls.parse(text)
    return str(raised.value)


# What parse says of a bad URL: one of these lines, whatever the URL.
PARSE_ERRORS = {error_of("no scheme here"), error_of("postgresql://a@b@db.example/archive")}


@given(text=st.text(max_size=80))
def test_parse_gives_a_url_or_one_line_without_the_input(text: str) -> None:
    try:
        parsed = urls.parse(text)
    except urls.DatabaseUrlError as exc:
        message = str(exc)
        # Never a word of the input (a password, or where one was): one of the fixed lines. (It
        # asserted that the input was not in the message, which a draw of "data" broke: the
        # line says "database".)
        assert message in PARSE_ERRORS
        return
    assert isinstance(parsed, URL)
    urls.redact(parsed)


# Every output of every command: the password in user information, in a query parameter, and past
# an unencoded "@".

USERINFO_SECRET = "Zq7-userinfo"
QUERY_SECRET = "secret2"
AMBIGUOUS_SECRET = "p@ss-Wd9"  # written unencoded: "ss-Wd9" is what a naive redaction leaves


def leaky_urls(database: str) -> list[tuple[str, list[str]]]:
    """(URL, the strings that must never be shown) for a PostgreSQL database."""
    server = POSTGRES_SERVER.removeprefix("postgresql+psycopg://postgres@")
    return [
        (
            f"postgresql+psycopg://postgres:{USERINFO_SECRET}@{server}/{database}",
            [USERINFO_SECRET],
        ),
        (
            f"postgresql+psycopg://postgres@{server}/{database}?password={QUERY_SECRET}",
            [QUERY_SECRET],
        ),
        (
            f"postgresql+psycopg://postgres:{AMBIGUOUS_SECRET}@{server}/{database}",
            [AMBIGUOUS_SECRET, AMBIGUOUS_SECRET.split("@")[1]],
        ),
    ]


COMMANDS = [
    ("config", "show"),
    ("db", "current"),
    ("capacity",),
    ("drift",),
    ("stack", "history"),
]


@pytest.mark.parametrize("case", range(3), ids=["userinfo", "query", "unencoded-at"])
@pytest.mark.slow
def test_no_command_shows_the_password_of_a_database_that_fails(
    postgres_admin: object, tmp_path: Path, case: int
) -> None:
    url, secrets = leaky_urls(missing_database())[case]
    outputs = {}
    for command in COMMANDS:
        outputs[command] = sustain(*command, "--database", url)
    if case == 2:  # a malformed URL is a configuration error: the daemon exits 2
        outputs[("run",)] = sustain(
            "run", "--database", url, "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path)
        )
        outputs[("run", "env")] = sustain(
            "run",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            str(tmp_path),
            env={"SUSTAIN_ARCHIVE__DATABASE_URL": url},
        )
    else:  # a database out of reach is not: the daemon runs, retries and says why in its log
        for name, args, env in (
            ("run", ("--database", url), {}),
            ("run-env", (), {"SUSTAIN_ARCHIVE__DATABASE_URL": url}),
        ):
            agent = start_agent(tmp_path / name, *args, env=env)
            agent.wait_for("sustain_archive_up 0")
            code, _, err = agent.terminate()
            assert code == 0, err
            assert "does not exist" in err, err
            for secret in secrets:
                assert secret not in err, (name, err)
    config_file = tmp_path / "sustain.toml"
    config_file.write_text(f'[archive]\ndatabase_url = "{url}"\n')
    config_file.chmod(0o600)
    outputs[("config", "check")] = sustain("config", "check", str(config_file))
    for command, result in outputs.items():
        for secret in secrets:
            assert secret not in result.stdout + result.stderr, (command, result)
        if command == ("config", "check"):
            assert result.returncode == (2 if case == 2 else 0), result
        elif command != ("config", "show") or case == 2:
            line = one_error_line(result)
            if case == 2:
                assert "percent-encode an '@' in the user name or password as %40" in line
            else:
                assert "does not exist" in line, line
    if case != 2:
        assert "***" in outputs[("config", "show")].stdout


def test_the_password_p_leaves_the_rest_of_the_message_alone(postgres_admin: object) -> None:
    database = f"sustain_nope_{uuid.uuid4().hex[:8]}"
    server = POSTGRES_SERVER.removeprefix("postgresql+psycopg://postgres@")
    line = one_error_line(
        sustain(
            "db", "current", "--database", f"postgresql+psycopg://postgres:p@{server}/{database}"
        )
    )
    assert line == (
        f"sustain: error: cannot connect to database "
        f"postgresql+psycopg://postgres:***@{server}/{database}: "
        f'database "{database}" does not exist'
    )


def agent_log(tmp_path: Path, url: str) -> str:
    """What `sustain run` on ``url`` logs from its start to a clean stop (the stack's torch
    facts from the stand-in interpreter: the URL never reaches the probe children)."""
    agent = start_agent(tmp_path, "--database", url, env=quick_env(tmp_path))
    try:
        ready(agent)
        agent.wait_for("sustain_stack_info", timeout=STARTUP_SECONDS)  # a stop waits for it
    finally:
        code, _, log = agent.terminate()
    assert code == 0, log
    return log


@pytest.fixture
def migrated_postgres(postgres_url: str) -> str:
    engine = open_engine(postgres_url)
    try:
        upgrade(engine)
    finally:
        engine.dispose()
    return postgres_url


def test_no_command_shows_a_query_password_on_a_working_database(
    migrated_postgres: str, tmp_path: Path
) -> None:
    """Trust authentication ignores the password: every command succeeds and logs its archive."""
    url = f"{migrated_postgres}?password={QUERY_SECRET}"
    shown = sustain("config", "show", "--database", url)
    assert shown.returncode == 0, shown
    assert "password=***" in shown.stdout
    for command in COMMANDS[1:]:
        result = sustain(*command, "--database", url)
        assert result.returncode == 0, (command, result)
        assert QUERY_SECRET not in result.stdout + result.stderr, command
    log = agent_log(tmp_path, url)
    assert "password=***" in log  # the ready line names the archive, redacted
    assert QUERY_SECRET not in log


def test_no_command_shows_a_password_in_a_sqlite_url(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'absent' / 'sustain.db'}?password={QUERY_SECRET}"
    for command in COMMANDS[1:]:
        line = one_error_line(sustain(*command, "--database", url))
        assert NO_ARCHIVE in line, line
        assert "password=***" in line, line
    log = agent_log(tmp_path, url)
    assert "password=***" in log
    assert QUERY_SECRET not in log


# Read commands create nothing.

READ_COMMANDS = [
    ("db", "current"),
    ("capacity",),
    ("drift",),
    ("stack", "history"),
    ("stack", "show", "0123abcd"),
    ("stack", "diff", "0123abcd", "4567ef01"),
]


def tree(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` and a hash of its bytes."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.mark.parametrize("command", READ_COMMANDS, ids=" ".join)
def test_read_commands_on_a_missing_sqlite_path_create_nothing(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    path = tmp_path / "nowhere" / "sustain.db"
    line = one_error_line(sustain(*command, "--database", f"sqlite:///{path}"))
    assert line == f"sustain: error: {NO_ARCHIVE} (sqlite:///{path})"
    line = one_error_line(sustain(*command, "--data-dir", str(tmp_path / "data")))
    assert line == f"sustain: error: {NO_ARCHIVE} (sqlite:///{tmp_path / 'data' / 'sustain.db'})"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", READ_COMMANDS, ids=" ".join)
def test_read_commands_on_an_empty_file_say_there_is_no_archive(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    path = tmp_path / "sustain.db"
    path.write_bytes(b"")
    line = one_error_line(sustain(*command, "--database", f"sqlite:///{path}"))
    assert line == f"sustain: error: {NO_ARCHIVE} (sqlite:///{path})"
    assert tree(tmp_path) == {"sustain.db": hashlib.sha256(b"").hexdigest()}


def test_read_commands_on_a_never_migrated_postgresql_say_there_is_no_archive(
    postgres_url: str,
) -> None:
    for command in READ_COMMANDS:
        line = one_error_line(sustain(*command, "--database", postgres_url))
        assert line == f"sustain: error: {NO_ARCHIVE} ({postgres_url})", command


@pytest.fixture
def sqlite_archive(tmp_path: Path) -> Path:
    path = tmp_path / "archive" / "sustain.db"
    engine = open_engine(f"sqlite:///{path}")
    try:
        upgrade(engine)
    finally:
        engine.dispose()
    return path


def test_read_commands_leave_an_archive_as_it_was(sqlite_archive: Path) -> None:
    before = tree(sqlite_archive.parent)
    url = f"sqlite:///{sqlite_archive}"
    current = sustain("db", "current", "--database", url)
    assert current.stdout == f"{head_revision()}\n", current
    for command in READ_COMMANDS[1:4]:
        result = sustain(*command, "--database", url)
        assert result.returncode == 0, (command, result)
    assert tree(sqlite_archive.parent) == before


# db upgrade never downgrades.


def test_db_upgrade_refuses_a_downgrade(sqlite_archive: Path) -> None:
    url = f"sqlite:///{sqlite_archive}"
    head = head_revision()
    line = one_error_line(sustain("db", "upgrade", "--revision", "0003", "--database", url))
    assert line == (
        f"sustain: error: database {url} is at revision {head}, newer than 0003: "
        "sustain never downgrades the archive"
    )
    assert sustain("db", "current", "--database", url).stdout == f"{head}\n"
    same = sustain("db", "upgrade", "--revision", str(head), "--database", url)
    assert (same.returncode, same.stdout) == (0, f"database at revision {head}\n")


def test_db_upgrade_to_an_unknown_revision_is_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sustain.db'}"
    line = one_error_line(sustain("db", "upgrade", "--revision", "0099", "--database", url))
    assert line.startswith("sustain: error: unknown revision '0099': this sustain has 0001 to ")


def test_a_database_newer_than_this_sustain_is_one_line(sqlite_archive: Path) -> None:
    """An archive a newer agent migrated: Alembic's own error would be a traceback here."""
    url = f"sqlite:///{sqlite_archive}"
    with sqlite3.connect(sqlite_archive) as connection:
        connection.execute("UPDATE alembic_version SET version_num = '0999'")
    connection.close()
    engine = open_engine(url)
    try:
        for revision in ("head", "0003"):
            with pytest.raises(ArchiveError) as caught:
                upgrade(engine, revision)
            assert str(caught.value) == (
                f"database {url} is at revision 0999, which this sustain does not have "
                f"(its newest is {head_revision()}): upgrade sustain"
            )
    finally:
        engine.dispose()


def test_db_upgrade_step_by_step(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sustain.db'}"
    first = sustain("db", "upgrade", "--revision", "0003", "--database", url)
    assert (first.returncode, first.stdout) == (0, "database at revision 0003\n"), first
    assert (
        sustain("db", "upgrade", "--database", url).stdout
        == f"database at revision {head_revision()}\n"
    )


# A missing driver.


def test_a_missing_psycopg_says_to_install_the_postgres_extra(tmp_path: Path) -> None:
    broken = tmp_path / "site" / "psycopg"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'psycopg'\", name='psycopg')\n"
    )
    env = {"PYTHONPATH": str(broken.parent)}
    url = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    for command in (("db", "current"), ("db", "upgrade"), ("capacity",)):
        line = one_error_line(sustain(*command, "--database", url, env=env))
        assert line == (
            f"sustain: error: cannot use database {url}: its driver psycopg is not installed "
            "(install sustain[postgres])"
        ), command


# `run` binds its port before it touches the database.


def test_run_reports_a_port_in_use_before_creating_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = sustain(
            "run",
            "--listen",
            f"127.0.0.1:{port}",
            "--data-dir",
            str(tmp_path / "data"),
            "--database",
            f"sqlite:///{tmp_path / 'nonexistent' / 'dir' / 'b.db'}",
        )
    line = one_error_line(result)
    assert line.startswith(f"sustain: error: cannot listen on 127.0.0.1:{port}: "), line
    assert list(tmp_path.iterdir()) == []
