"""A private PgBouncer (Debian's package; tests/run.sh installs it) in front of the development
PostgreSQL, for tests/test_pgbouncer.py and bench/fleet_scale.py.

Its own ini and userlist in the caller's directory, a free port on 127.0.0.1, trust
authentication as the development server has it, every database of the server reachable under
its own name, and transaction pooling, as a fleet runs it (docs/scale.md). It is started as a
child of the caller and stopped by its pid; run as root it drops to ``nobody``, since PgBouncer
refuses to run as root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

PGBOUNCER = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/bin")
INSTALL_HINT = "apt-get install pgbouncer (Debian's package; tests/run.sh installs it)"
START_TIMEOUT_S = 10.0


class PgBouncerError(Exception):
    """PgBouncer is missing or did not start; the message says why (with its log)."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class PgBouncer:
    """One pgbouncer process; ``url(database)`` is the agent's URL through it."""

    def __init__(
        self,
        directory: Path,
        *,
        pool_mode: str = "transaction",
        default_pool_size: int = 10,
        max_client_conn: int = 100,
        server: tuple[str, int] = ("127.0.0.1", 5432),
    ) -> None:
        self.directory = directory
        self.pool_mode = pool_mode
        self.default_pool_size = default_pool_size
        self.max_client_conn = max_client_conn
        self.server = server
        self.port = 0
        self.log = directory / "pgbouncer.log"
        self._process: subprocess.Popen[bytes] | None = None

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _ini(self) -> Path:
        users = self.directory / "userlist.txt"
        users.write_text('"postgres" ""\n')
        host, port = self.server
        lines = [
            "[databases]",
            f"* = host={host} port={port}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {users}",
            f"pool_mode = {self.pool_mode}",
            f"default_pool_size = {self.default_pool_size}",
            f"max_client_conn = {self.max_client_conn}",
            "ignore_startup_parameters = extra_float_digits",
        ]
        if os.geteuid() == 0:
            lines.append("user = nobody")
        ini = self.directory / "pgbouncer.ini"
        ini.write_text("\n".join(lines) + "\n")
        return ini

    def start(self) -> None:
        if PGBOUNCER is None:
            raise PgBouncerError(f"pgbouncer is not installed: {INSTALL_HINT}")
        self.port = free_port()
        ini = self._ini()
        with self.log.open("wb") as log:
            self._process = subprocess.Popen(
                [PGBOUNCER, str(ini)], stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                break
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise PgBouncerError(f"pgbouncer did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> PgBouncer:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
