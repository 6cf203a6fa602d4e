"""Fixtures shared by the test modules.

GPUs come from the fake NVML driver (tests/fakenvml), loaded into the test process once under
its SONAME so that pynvml's own dlopen of libnvidia-ml.so.1 finds it.

The archive is tested against the real thing on both supported backends: a SQLite file and the
PostgreSQL server that development and CI machines run at 127.0.0.1:5432 (trust authentication,
user ``postgres``, maintenance database ``test``). A missing server fails the PostgreSQL tests
instead of skipping them, so that a green run always means both backends were exercised.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from fakenvml.build import build
from hypothesis import HealthCheck, settings
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError

from agent.archive.database import open_engine, upgrade
from collectors.nvml.collector import NvmlCollector

# Property tests draw the same examples on every run (derandomize): the suite is green or red
# for the code, never for the draw, and without a per-example deadline a loaded machine fails
# nothing. ``HYPOTHESIS_PROFILE=explore`` draws new examples each run, for looking for bugs.
settings.register_profile(
    "suite", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("explore", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

POSTGRES_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
POSTGRES_MAINTENANCE_URL = f"{POSTGRES_SERVER}/test"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long tests (marked slow) first, in their own order: under pytest-xdist each worker
    takes one of them at the start and the short ones fill in around them, so the run is not
    left waiting on a long test that started last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _real_procfs() -> Iterator[None]:
    """``psutil.PROCFS_PATH`` is process-wide and a host collector built on a fixture tree moves
    it there: every test starts and ends with psutil reading the real /proc."""
    psutil.PROCFS_PATH = "/proc"
    yield
    psutil.PROCFS_PATH = "/proc"


@pytest.fixture(scope="session")
def postgres_admin() -> Iterator[Engine]:
    """An AUTOCOMMIT engine on the maintenance database, for CREATE and DROP DATABASE."""
    engine = create_engine(POSTGRES_MAINTENANCE_URL, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect():
            unreachable = None
    except OperationalError as exc:
        engine.dispose()
        unreachable = str(exc.orig).splitlines()[0]
    if unreachable is not None:  # failed outside the except block: no chained traceback
        pytest.fail(
            f"PostgreSQL is needed at {POSTGRES_MAINTENANCE_URL} and is unreachable: {unreachable}",
            pytrace=False,
        )
    yield engine
    engine.dispose()


@pytest.fixture
def postgres_url(postgres_admin: Engine) -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database made for this test (dropped after)."""
    name = f"sustain_test_{uuid.uuid4().hex[:16]}"
    with postgres_admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"{POSTGRES_SERVER}/{name}"
    finally:
        with postgres_admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of a new, empty database: a file in tmp_path, or a database made for this test."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'archive.db'}"
        return
    yield request.getfixturevalue("postgres_url")


@pytest.fixture
def archive_engine(database_url: str) -> Iterator[Engine]:
    """An engine on ``database_url`` migrated to the newest revision."""
    engine = open_engine(database_url)
    try:
        upgrade(engine)
        yield engine
    finally:
        engine.dispose()


@dataclass
class FakeGpus:
    """One running scenario: its epoch and time scale, and the clock the collector must use."""

    epoch: float
    scale: float

    def clock(self) -> float:
        return self.epoch + (time.time() - self.epoch) * self.scale

    def scenario_seconds(self, timestamp: float) -> float:
        return timestamp - self.epoch

    def sleep_until(self, scenario_seconds: float) -> None:
        delay = (self.epoch + scenario_seconds / self.scale) - time.time()
        if delay > 0:
            time.sleep(delay)


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake driver, built once and loaded into this process under its SONAME."""
    path = build(tmp_path_factory.mktemp("fakenvml"))
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return path


@pytest.fixture
def scenario(
    fake_nvml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str, float], tuple[FakeGpus, NvmlCollector]]]:
    """Start a scenario (text, time scale) and a collector on it; the collector is closed after
    the test, so that the next test's NVML init reads its own scenario."""
    collectors: list[NvmlCollector] = []

    def start(text: str, scale: float = 1.0) -> tuple[FakeGpus, NvmlCollector]:
        path = tmp_path / "scenario.scn"
        path.write_text(text)
        fake = FakeGpus(epoch=time.time(), scale=scale)
        monkeypatch.setenv("FAKENVML_SCENARIO", str(path))
        monkeypatch.setenv("FAKENVML_EPOCH", repr(fake.epoch))
        monkeypatch.setenv("FAKENVML_TIME_SCALE", repr(scale))
        collector = NvmlCollector(clock=fake.clock)
        collectors.append(collector)
        return fake, collector

    yield start
    for collector in collectors:
        collector.close()


# The probe interpreter of tests whose probes target fake GPUs: it writes down the GPUs it was
# given (CUDA_VISIBLE_DEVICES) and its arguments, one JSON line per child, then runs the real
# workload on the CPU (``--device cuda:N`` becomes ``--device cpu``).
CPU_WRAPPER = """#!{python}
import json, os, sys
with open({log!r}, "a") as out:
    out.write(json.dumps({{"gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "argv": sys.argv[1:]}}))
    out.write("\\n")
args = ["cpu" if arg.startswith("cuda") else arg for arg in sys.argv[1:]]
os.execv({python!r}, [{python!r}, *args])
"""


def cpu_wrapper(directory: Path) -> tuple[Path, Path]:
    """The wrapper interpreter in ``directory`` and the file its JSON lines go to."""
    log = directory / "children.jsonl"
    wrapper = directory / "probe-python"
    wrapper.write_text(CPU_WRAPPER.format(python=sys.executable, log=str(log)))
    wrapper.chmod(0o755)
    return wrapper, log


def wrapped_runs(log: Path) -> list[dict[str, Any]]:
    """The wrapper's lines of `workloads run` children, in order."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [entry for entry in map(json.loads, lines) if "run" in entry["argv"]]


# A `sustain run` process as an operator starts it, for the end-to-end tests.


# Ports for the servers a test starts come from below the kernel's ephemeral range (32768 and
# up here), one block per xdist worker: an outgoing connection anywhere on the machine cannot take
# a port between the check and the server's bind, and two workers never hand out the same one.
_PORT_BLOCK = 1000
_PORT_BASE = 20000
_next_port = 0


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # gw0, gw1, ...; absent without xdist
    return int(worker.removeprefix("gw")) if worker.removeprefix("gw").isdigit() else 0


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on, from this worker's own block."""
    global _next_port  # noqa: PLW0603 - one counter per test process
    base = _PORT_BASE + (_worker_index() % 12) * _PORT_BLOCK
    for _ in range(_PORT_BLOCK):
        port = base + _next_port % _PORT_BLOCK
        _next_port += 1
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or a connection of an earlier test in TIME_WAIT
            return port
    raise RuntimeError(f"no free port in {base}..{base + _PORT_BLOCK - 1}")


def fetch(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@dataclass
class Running:
    """A running agent: its process, exporter port and data directory."""

    process: subprocess.Popen[str]
    port: int
    data_dir: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_for(self, needle: str, timeout: float = 60.0, path: str = "/metrics") -> str:
        """Wait until ``path`` (/metrics) contains ``needle``; returns the body."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                _, err = self.process.communicate()
                pytest.fail(f"agent exited {self.process.returncode}: {err}")
            try:
                status, body = fetch(self.base + path, timeout=2)
            except OSError:
                time.sleep(0.2)
                continue
            if status == 200 and needle in body:
                return body
            time.sleep(0.2)
        pytest.fail(f"agent did not serve {needle!r} within {timeout} s")

    def wait_ready(self) -> str:
        """Host metrics within 15 s of start (utilization needs two polls)."""
        return self.wait_for("sustain_cpu_utilization_ratio ")

    def terminate(self, signum: int = signal.SIGTERM) -> tuple[int, float, str]:
        started = time.monotonic()
        self.process.send_signal(signum)
        # Generous: an agent on a loaded machine may take its time to stop; a test that holds
        # it to a bound measures that itself from the duration returned.
        _, err = self.process.communicate(timeout=60)
        return self.process.returncode, time.monotonic() - started, err


def start_agent(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Running:
    """`sustain run` on a free port with its data in ``tmp_path``; the environment is this
    process's without SUSTAIN_* and FAKENVML_* variables, plus ``env``."""
    port = free_port()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    full_env.update(env or {})
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent",
            "run",
            "--listen",
            f"127.0.0.1:{port}",
            "--data-dir",
            str(tmp_path),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
    )
    return Running(process, port, tmp_path)


# A private PostgreSQL instance that a test may stop and start (database outages).


@dataclass
class PrivatePostgres:
    directory: Path
    port: int

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str) -> None:
        command = ["pg_ctl", "-D", str(self.directory / "data"), *args]
        subprocess.run(_as_postgres(command), check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1"
        self._ctl("-o", options, "-l", str(self.directory / "log"), "-w", "start")

    def stop(self) -> None:
        self._ctl("-m", "fast", "-w", "stop")


def _as_postgres(command: list[str]) -> list[str]:
    # initdb and postgres refuse to run as root; CI runs the tests as root.
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *command]
    return command


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    if shutil.which("initdb") is None or shutil.which("pg_ctl") is None:
        pytest.fail("initdb and pg_ctl (PostgreSQL server binaries) are needed on PATH")
    # Not under pytest's tmp_path: its parents are private to root, and the server runs as
    # postgres when the tests run as root.
    directory = Path(tempfile.mkdtemp(prefix="sustain-pg-"))
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres", "postgres")
    subprocess.run(
        _as_postgres(["initdb", "-D", str(directory / "data"), "-A", "trust", "-U", "postgres"]),
        check=True,
        capture_output=True,
        timeout=120,
    )
    server = PrivatePostgres(directory, free_port())
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            server.stop()
        shutil.rmtree(directory, ignore_errors=True)
