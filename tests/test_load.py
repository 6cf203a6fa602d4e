"""Load (issue 8): /metrics under 200 requests/s or more against a real `sustain run`.

The agent runs with the fake NVML driver (two H100s, a steady scenario), the fixture sysfs tree
for its host collector, and probing and drift off. Eight threads of this process request /metrics
on a shared schedule of 220 requests/s (a margin over the 200 asked for) for 10 s: each thread
takes the next due time, sleeps until it, and sends; a thread that is behind sends at once, so the
offered load never falls below what the agent can answer. Each thread keeps one http.client
connection, but the exporter (wsgiref) speaks HTTP/1.0 and closes after every response, so every
request is a new TCP connection and a new server thread: the connection count is printed.

Every response must be 200 with a body that prometheus_client's parser reads, and every body must
carry the sampler lag of every collector. Parsing a body costs more than rendering it, so the
threads only keep each body (zlib level 1) and the bodies are parsed after the load, in a process
pool, each distinct body once.

What a machine shared with other work cannot break is asserted; what it can is printed. The
capacity is the agent's CPU time per answered request, which another process's load does not
change: at most 5 ms, so that one core answers 200 requests/s. The achieved rate and the sampler
lag depend on the CPU the machine leaves the agent and this process (on a quiet machine: 200/s,
lag under 100 ms; bench/scrape.py measures both against those targets, docs/performance.md): the
lag is asserted only under 1 s, a sampler that the scrapes held up rather than one that waited
for a core. The scrape latency p50 and p99 (send to last byte) are printed with the agent's and
this process's CPU, whatever the outcome.
"""

from __future__ import annotations

import http.client
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from conftest import fetch, free_port
from prometheus_client.parser import text_string_to_metric_families
from test_daemon import STARTUP_SECONDS, quick_env

ROOT = Path(__file__).resolve().parent.parent
REQUIRED_RATE = 200.0
OFFERED_RATE = 220.0
SECONDS = 10.0
THREADS = 8
TARGET_LAG_SECONDS = 0.1  # on a quiet machine (bench/scrape.py): printed
MAX_LAG_SECONDS = 1.0  # on any machine: asserted
MAX_AGENT_CPU_PER_REQUEST = 1 / REQUIRED_RATE  # one core answers REQUIRED_RATE a second
COLLECTORS = {"host", "nvml"}
UUID0 = "GPU-00000000-1111-2222-3333-444444444444"
UUID1 = "GPU-55555555-6666-7777-8888-999999999999"

SCENARIO = f"""
set driver_version 550.54.15
device 0 name "NVIDIA H100 80GB HBM3" uuid {UUID0}
device 1 name "NVIDIA H100 80GB HBM3" uuid {UUID1}
""" + "".join(
    f"""
device {d} max_sm_clock_mhz 1980 power_limit_mw 700000 slowdown_temp_c 87 gpm_supported 1
at 0 {d} sm_clock_mhz 1410 power_mw 600000 gpu_temp_c 70 reasons 0x0 gpu_util_pct 90
at 0 {d} gpm_dram_bw_util_pct 55 gpm_sm_occupancy_pct 45 gpm_tensor_util_pct 60
"""
    for d in (0, 1)
)


@dataclass(frozen=True, slots=True)
class Response:
    sent: float  # seconds since the start of the load
    latency: float
    status: int  # 0: no HTTP response (the error says why)
    body: bytes = b""  # zlib-compressed
    error: str = ""


@dataclass
class Load:
    responses: list[Response] = field(default_factory=list)
    connections: int = 0
    elapsed: float = 0.0


def generate(port: int, rate: float, seconds: float, threads: int) -> Load:
    """``threads`` keep-alive clients on one schedule of ``rate`` requests/s for ``seconds``."""
    load = Load()
    lock = threading.Lock()
    next_index = 0
    start = time.monotonic() + 0.05

    def due() -> float | None:
        nonlocal next_index
        with lock:
            at = start + next_index / rate
            next_index += 1
        # Stop at the end of the window even when behind: the load lasts ``seconds``.
        return at if max(at, time.monotonic()) < start + seconds else None

    def client() -> None:
        mine: list[Response] = []
        opened = 0
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        while (at := due()) is not None:
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if connection.sock is None:
                opened += 1  # http.client reconnects by itself after a closed response
            sent = time.monotonic()
            try:
                connection.request("GET", "/metrics")
                response = connection.getresponse()
                body = response.read()
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                mine.append(Response(sent - start, time.monotonic() - sent, 0, error=repr(exc)))
                continue
            latency = time.monotonic() - sent
            mine.append(Response(sent - start, latency, response.status, zlib.compress(body, 1)))
        connection.close()
        with lock:
            load.responses.extend(mine)
            load.connections += opened

    workers = [threading.Thread(target=client, name=f"load-{i}") for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    load.elapsed = time.monotonic() - start
    load.responses.sort(key=lambda response: response.sent)
    return load


def check_body(compressed: bytes) -> tuple[str, dict[str, float]]:
    """Parse one kept body: ("", sampler lag by collector), or (the parse error, {})."""
    lags: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(zlib.decompress(compressed).decode()):
            if family.name == "sustain_sampler_lag_seconds":
                lags.update((s.labels["collector"], s.value) for s in family.samples)
    except ValueError as exc:  # UnicodeDecodeError included
        return f"unparsable body: {exc}", {}
    return "", lags


def quantile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@pytest.fixture
def agent(fake_nvml: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """`sustain run` on the fake GPUs, probing and drift off; standard error in agent.log."""
    (tmp_path / "load.scn").write_text(SCENARIO)
    (tmp_path / "sustain.toml").write_text(
        textwrap.dedent(
            f"""
            [agent]
            node = "load-node"
            [host]
            sysfs = "{ROOT / "tests" / "fixtures" / "host" / "sys"}"
            [probing]
            enabled = false
            [drift]
            enabled = false
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    env |= quick_env(
        tmp_path,
        LD_LIBRARY_PATH=str(fake_nvml.parent),
        FAKENVML_SCENARIO=str(tmp_path / "load.scn"),
    )
    port = free_port()
    log_path = tmp_path / "agent.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", str(tmp_path / "sustain.toml"),
             "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "data")],
            stdout=subprocess.DEVNULL, stderr=log, env=env,
        )  # fmt: skip
    try:
        yield process, port, log_path
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_ready(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """GPU and host metrics served, and both sampler loops reporting their lag."""
    needles = [
        "sustain_gpu_power_watts{",
        "sustain_cpu_utilization_ratio ",
        *(f'sustain_sampler_lag_seconds{{collector="{c}"}}' for c in COLLECTORS),
    ]
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        assert process.poll() is None, f"agent exited {process.returncode}: {log.read_text()}"
        try:
            status, body = fetch(f"http://127.0.0.1:{port}/metrics", timeout=2)
        except OSError:
            status, body = 0, ""
        if status == 200 and all(needle in body for needle in needles):
            return
        time.sleep(0.2)
    pytest.fail(f"agent not ready in {STARTUP_SECONDS:g} s: {log.read_text()}")


@pytest.mark.slow
def test_metrics_under_200_requests_per_second(
    agent: tuple[subprocess.Popen[bytes], int, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    process, port, log = agent
    wait_ready(process, port, log)
    agent_process = psutil.Process(process.pid)
    own = psutil.Process()
    agent_cpu, own_cpu = agent_process.cpu_times(), own.cpu_times()

    load = generate(port, OFFERED_RATE, SECONDS, THREADS)

    agent_used = sum(agent_process.cpu_times()[:2]) - sum(agent_cpu[:2])
    own_used = sum(own.cpu_times()[:2]) - sum(own_cpu[:2])
    assert process.poll() is None, f"agent exited during the load: {log.read_text()}"

    responses = load.responses
    errors = [
        f"{r.sent:.2f} s: {r.error or f'HTTP {r.status}'}" for r in responses if r.status != 200
    ]
    kept = [r for r in responses if r.status == 200]
    parse_started = time.monotonic()
    # Identical bodies (an exporter that caches its rendering) are parsed once.
    distinct = list(dict.fromkeys(r.body for r in kept))
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        checks = dict(zip(distinct, pool.map(check_body, distinct, chunksize=16), strict=True))
    lag_by_collector: dict[str, list[float]] = {c: [] for c in COLLECTORS}
    for response in kept:
        error, lags = checks[response.body]
        if error:
            errors.append(f"{response.sent:.2f} s: {error}")
        elif missing := COLLECTORS - lags.keys():
            errors.append(f"{response.sent:.2f} s: no sampler lag for {sorted(missing)}")
        for collector, lag in lags.items():
            lag_by_collector.setdefault(collector, []).append(lag)

    parse_seconds = time.monotonic() - parse_started
    rate = len(responses) / load.elapsed
    latencies = [r.latency for r in kept]
    p50 = quantile(latencies, 50) * 1000 if len(latencies) > 1 else float("nan")
    p99 = quantile(latencies, 99) * 1000 if len(latencies) > 1 else float("nan")
    worst_lag = {c: max(lags, default=float("nan")) for c, lags in lag_by_collector.items()}
    with capsys.disabled():
        print(
            f"\nload: {len(responses)} requests in {load.elapsed:.1f} s = {rate:.1f} req/s "
            f"(offered {OFFERED_RATE:g}/s from {THREADS} threads, {load.connections} connections); "
            f"scrape latency p50 {p50:.1f} ms, p99 {p99:.1f} ms, max "
            f"{max(latencies, default=0) * 1000:.1f} ms; errors {len(errors)}; worst sampler lag "
            + ", ".join(
                f"{c} {worst_lag[c] * 1000:.1f} ms "
                f"({sum(lag >= TARGET_LAG_SECONDS for lag in lags)} of {len(lags)} bodies at "
                "100 ms or more)"
                for c, lags in sorted(lag_by_collector.items())
            )
            + f"; CPU: agent {100 * agent_used / load.elapsed:.0f} % "
            f"({agent_used / max(len(kept), 1) * 1000:.2f} ms a request), load generator "
            f"{100 * own_used / load.elapsed:.0f} % of one core ({os.cpu_count()} cores); "
            f"{len(distinct)} distinct bodies parsed in {parse_seconds:.0f} s after the load"
        )

    assert not errors, f"{len(errors)} bad responses, the first: {errors[:5]}"
    # The load was concurrent and went on: many requests a thread (the rate is printed).
    assert len(kept) >= 20 * THREADS, f"{len(kept)} responses in {load.elapsed:.1f} s"
    for collector, lag in worst_lag.items():
        assert lag < MAX_LAG_SECONDS, f"sampler lag of {collector} reached {lag * 1000:.0f} ms"
    per_request = agent_used / len(kept)
    assert per_request <= MAX_AGENT_CPU_PER_REQUEST, (
        f"the agent used {per_request * 1000:.2f} ms of CPU a request: one core answers "
        f"{1 / per_request:.0f}/s, {REQUIRED_RATE:g} asked ({rate:.1f} req/s achieved here)"
    )
