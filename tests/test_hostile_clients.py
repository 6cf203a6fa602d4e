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
from conftest import Running, start_agent

from agent.exporter.server import AddressRateLimit, BasicAuth

QUIET = "[probing]\nenabled = false\n\n[drift]\nenabled = false\n"
USER = "prometheus"
PASSWORD = "scrape-Pw-7c0ffee"

# Holds CONNECTIONS half-open connections (a request line begun, never finished) for SECONDS,
# replacing each one the server closes, and reports when each was closed after its opening.
SLOW_LORIS = """
import json, selectors, socket, sys, time
port, count, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
selector = selectors.DefaultSelector()
opened = {}
held_after = []
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
        return
    sock.setblocking(False)
    opened[sock] = time.monotonic()
    selector.register(sock, selectors.EVENT_READ)

end = time.monotonic() + seconds
for _ in range(count):
    open_one()
print(json.dumps({"opened": len(opened)}), flush=True)
while time.monotonic() < end:
    for key, _ in selector.select(0.2):
        sock = key.fileobj
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        if data:
            continue
        held_after.append(time.monotonic() - opened.pop(sock))
        selector.unregister(sock)
        sock.close()
        if time.monotonic() < end - 1:
            open_one()
held_after.sort()
summary = {
    "closed": len(held_after),
    "first": held_after[0],
    "median": held_after[len(held_after) // 2],
    "p95": held_after[len(held_after) * 95 // 100],
    "last": held_after[-1],
}
print(json.dumps({**summary, "still_open": len(opened), "refused": refused}))
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
    port: int, path: str, authorization: str | None = None, source: str = ""
) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=5, source_address=(source, 0) if source else None
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
    running = start_agent(tmp_path, "--config", str(config))
    running.wait_for("ok", timeout=30, path="/healthz")  # open with basic auth too
    return running


def test_slow_loris_is_closed_and_bounded_while_metrics_answer(tmp_path: Path) -> None:
    """2,000 half-open connections for 30 s: threads stay under the cap, every connection is
    closed after the header timeout, and /metrics keeps answering quickly."""
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
            [sys.executable, "-c", SLOW_LORIS, str(running.port), "2000", "30"],
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
    p99 = latencies[int(len(latencies) * 0.99)]
    print(
        f"opened {opened}, closed {report['closed']} (after {report['first']:.2f}-"
        f"{report['last']:.2f} s, median {report['median']:.2f}, p95 {report['p95']:.2f}), "
        f"refused {report['refused']}; threads {baseline} at rest, max {max(threads)}; "
        f"/metrics p99 {p99 * 1000:.1f} ms over {len(latencies)}"
    )
    assert opened == 2000
    assert report["closed"] >= 2000  # every first connection, and replacements
    # Times run from the client's connect; the agent's clock starts at its accept, later for
    # a connection that waited in the listen backlog behind a burst of 2,000 reconnections
    # (seconds on a loaded machine: CI saw one accepted 10 s late). Never closed before the
    # timeout; most within a second or two of it.
    assert timeout - 0.5 <= report["first"]
    assert report["median"] <= timeout + 2
    assert report["p95"] <= timeout + 10
    assert max(threads) <= baseline + cap
    assert p99 < 0.05


def test_wrong_password_flood_costs_little_and_right_passwords_pass(tmp_path: Path) -> None:
    """50 requests a second with new wrong passwords for 30 s, at bcrypt cost 10."""
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
        for index in range(50 * 30):
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
    assert max(lags) < 0.1
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
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


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
