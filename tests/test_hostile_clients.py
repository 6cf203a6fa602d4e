"""The exporter under hostile clients (issue 19): slow loris, a wrong-password flood, and a web
configuration that names a user twice. Real sockets on 127.0.0.1 against `sustain run`; each
load is bounded and stops by itself."""

from __future__ import annotations

import base64
import http.client
import json
import os
import resource
import secrets
import subprocess
import sys
import time
from pathlib import Path

import bcrypt
import pytest
from conftest import Running, start_agent
from test_daemon import STARTUP_SECONDS, quick_env
from test_database_urls import forked_sustain

from agent.exporter.server import AddressRateLimit, BasicAuth

QUIET = "[probing]\nenabled = false\n\n[drift]\nenabled = false\n"
USER = "prometheus"
PASSWORD = "scrape-Pw-7c0ffee"

# Opens COUNT half-open connections (a request line begun, never finished) and holds each until
# the server closes it, replacing each one closed with a new one, until every first connection
# is closed and at least SECONDS have gone by (or LIMIT, whatever happened): then it reports
# when each first connection was closed after its opening, and how many it held at the end.
SLOW_LORIS = """
import json, selectors, socket, sys, time
port, count = int(sys.argv[1]), int(sys.argv[2])
seconds, limit = float(sys.argv[3]), float(sys.argv[4])
selector = selectors.DefaultSelector()
opened = {}
first = set()
held_after = []
replaced = 0
refused = 0

def open_one():
    global refused
    sock = socket.socket()
    try:
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x")
    except OSError:
        refused += 1
        sock.close()
        return None
    sock.setblocking(False)
    opened[sock] = time.monotonic()
    selector.register(sock, selectors.EVENT_READ)
    return sock

started = time.monotonic()
for _ in range(count):
    first.add(open_one())
first.discard(None)
print(json.dumps({"opened": len(first)}), flush=True)
while time.monotonic() < started + limit:
    if not first and time.monotonic() >= started + seconds:
        break
    for key, _ in selector.select(0.2):
        sock = key.fileobj
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        if data:
            continue
        since = time.monotonic() - opened.pop(sock)
        if sock in first:
            first.discard(sock)
            held_after.append(since)
        else:
            replaced += 1
        selector.unregister(sock)
        sock.close()
        open_one()
held_after.sort()
summary = {
    "closed": len(held_after),
    "replacements_closed": replaced,
    "first": held_after[0],
    "median": held_after[len(held_after) // 2],
    "p95": held_after[len(held_after) * 95 // 100],
    "last": held_after[-1],
    "seconds": time.monotonic() - started,
}
summary.update(still_open=len(opened), never_closed=len(first), refused=refused)
print(json.dumps(summary))
"""


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 8192 if hard == resource.RLIM_INFINITY else min(8192, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _get(
    port: int, path: str, authorization: str | None = None, source: str = "", timeout: float = 30
) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=timeout, source_address=(source, 0) if source else None
    )
    try:
        connection.request("GET", path, headers={"Authorization": authorization or ""})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _agent(tmp_path: Path, toml: str) -> Running:
    config = tmp_path / "sustain.toml"
    config.write_text(toml + QUIET)
    config.chmod(0o600)
    running = start_agent(tmp_path, "--config", str(config), env=quick_env(tmp_path))
    running.wait_for("ok", timeout=STARTUP_SECONDS, path="/healthz")  # open with basic auth too
    return running


@pytest.mark.slow
def test_slow_loris_is_closed_and_bounded_while_metrics_answer(tmp_path: Path) -> None:
    """2,000 half-open connections, each replaced when the agent closes it, until every one of
    the first 2,000 is closed (and at least three header timeouts have gone by): threads stay
    under the cap, the header timeout closes every connection and none before it, and /metrics
    keeps answering without waiting behind them."""
    _raise_fd_limit()
    cap, timeout = 64, 2.0
    running = _agent(
        tmp_path, f"[exporter]\nheader_timeout_seconds = {timeout}\nmax_connections = {cap}\n\n"
    )
    try:
        pid = running.process.pid
        for _ in range(5):  # the pool's threads for these few scrapes, then the baseline
            _get(running.port, "/metrics")
        baseline = _threads(pid)
        attacker = subprocess.Popen(
            [sys.executable, "-c", SLOW_LORIS, str(running.port), "2000", str(3 * timeout), "120"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert attacker.stdout is not None
        opened = json.loads(attacker.stdout.readline())["opened"]
        latencies: list[float] = []
        threads: list[int] = []
        while attacker.poll() is None:
            started = time.monotonic()
            status, _ = _get(running.port, "/metrics")
            latencies.append(time.monotonic() - started)
            assert status == 200
            threads.append(_threads(pid))
            time.sleep(0.05)
        report = json.loads(attacker.stdout.read())
    finally:
        running.terminate()

    latencies.sort()
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
    print(
        f"opened {opened}, closed {report['closed']} (after {report['first']:.2f}-"
        f"{report['last']:.2f} s, median {report['median']:.2f}, p95 {report['p95']:.2f}) and "
        f"{report['replacements_closed']} replacements in {report['seconds']:.1f} s, refused "
        f"{report['refused']}; threads {baseline} at rest, max {max(threads)}; /metrics p50 "
        f"{p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms over {len(latencies)}"
    )
    assert opened == 2000
    # Every first connection was closed by the agent, none before the header timeout. Times run
    # from the client's connect; the agent's clock starts at its accept, later for a connection
    # that waited in the listen backlog behind a burst of 2,000 reconnections (seconds on a
    # loaded machine: CI saw one accepted 10 s late), so only the earliest close, whose
    # connection was accepted at once, shows the timeout itself: not a longer one.
    assert report["never_closed"] == 0
    assert report["closed"] == 2000
    assert timeout - 0.5 <= report["first"] <= timeout + 5
    assert max(threads) <= baseline + cap
    # /metrics never waited behind the half-open connections (that would take a header timeout);
    # how much less than that depends on the CPU the machine leaves the agent: printed above.
    assert p50 < timeout / 2


@pytest.mark.slow
def test_wrong_password_flood_costs_little_and_right_passwords_pass(tmp_path: Path) -> None:
    """50 requests a second with new wrong passwords for 10 s, at bcrypt cost 10: the agent
    checks a few (a burst, then one a second from the address) and refuses the rest unchecked.
    Each check costs about 50 ms of CPU, so checking them all would take a core; the agent's CPU
    time over the flood is asserted (another process's load does not add to it), its sampler lag
    is printed and asserted only under 1 s (a loaded machine delays a sampler by itself)."""
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  {USER}: {hashed}\n")
    running = _agent(tmp_path, f'[exporter]\nweb_config_file = "{web}"\n\n')
    right = _basic(USER, PASSWORD)
    try:
        assert _get(running.port, "/metrics", right)[0] == 200  # a scraper, already known
        pid = running.process.pid
        statuses: dict[int, int] = {}
        lags: list[float] = []
        cpu_before, started = _cpu_seconds(pid), time.monotonic()
        for index in range(50 * 10):
            wait = started + index / 50 - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            status, _ = _get(running.port, "/metrics", _basic(USER, secrets.token_hex(8)))
            statuses[status] = statuses.get(status, 0) + 1
            if index % 50 == 0:
                status, body = _get(running.port, "/metrics", right)
                assert status == 200
                lags.extend(
                    float(line.rsplit(" ", 1)[1])
                    for line in body.decode().splitlines()
                    if line.startswith("sustain_sampler_lag_seconds")
                )
        elapsed = time.monotonic() - started
        cpu = (_cpu_seconds(pid) - cpu_before) / elapsed
        # A right password from an address that has not used its checks is checked and passes.
        fresh = _get(running.port, "/metrics", right, source="127.0.0.2")[0]
    finally:
        running.terminate()
    print(
        f"{sum(statuses.values())} wrong in {elapsed:.1f} s: {statuses}; agent CPU "
        f"{cpu:.1%} of a core; sampler lag max {max(lags) * 1000:.1f} ms"
    )
    assert set(statuses) <= {401, 429}
    assert cpu < 0.25
    assert max(lags) < 1.0
    assert fresh == 200


def test_duplicate_user_is_one_line_and_exit_2(tmp_path: Path) -> None:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(
        f"basic_auth_users:\n  {USER}: {hashed}\n  other: {hashed}\n  {USER}: {hashed}\n"
    )
    toml = tmp_path / "sustain.toml"
    toml.write_text(f'[exporter]\nweb_config_file = "{web}"\n\n{QUIET}')
    toml.chmod(0o600)
    checked = _sustain("config", "check", str(toml))
    assert checked.returncode == 2, checked
    (line,) = checked.stdout.splitlines()
    assert f"line 4: '{USER}' is given twice" in line, line
    ran = _sustain("run", "--config", str(toml), "--data-dir", str(tmp_path), "--listen", ":0")
    assert ran.returncode == 2, ran
    (line,) = ran.stderr.splitlines()
    assert f"'{USER}' is given twice" in line, line


def _sustain(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m agent ARGS`, forked from tests/test_database_urls.py's zygote."""
    return forked_sustain(args, os.environ)


def test_bcrypt_checks_are_rate_limited_per_address() -> None:
    """Burst 5, then new credentials from that address are "limited" without a check; known
    ones (right or wrong) and other addresses are not held up."""
    auth = BasicAuth({USER: bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4))}, 0.001)
    right = _basic(USER, PASSWORD)
    assert auth.verdict(right, "10.0.0.1") == "ok"
    wrong = [_basic(USER, f"wrong{index}") for index in range(5)]
    assert [auth.verdict(header, "10.0.0.1") for header in wrong[:4]] == ["wrong"] * 4
    assert auth.verdict(wrong[4], "10.0.0.1") == "limited"
    assert auth.verdict(wrong[0], "10.0.0.1") == "wrong"  # remembered: no check needed
    assert auth.verdict(right, "10.0.0.1") == "ok"  # remembered
    assert auth.verdict(wrong[4], "10.0.0.2") == "wrong"
    assert AddressRateLimit(1000.0, 1).take("a")
