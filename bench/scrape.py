"""Scrape latency of /metrics: at rest, then under a load of 200 requests/s from threads.

Starts `sustain run` with the fake NVML driver (tests/fakenvml, built with gcc; --gpus fake H100s
in a steady scenario), the fixture sysfs tree for the host collector (so the exposition is the
same on every machine), and probing and drift off. At rest: --rest-requests sequential requests,
--rest-gap apart (1 s: as a Prometheus server's scrapes are, seconds apart, so that none is
answered from a rendering the exporter made for an earlier one). Under load: --threads threads
of http.client clients on one shared schedule of --rate requests/s for --seconds (a thread that
is behind sends at once, so the load offered never falls below what the agent answers); the
exporter speaks HTTP/1.0, so each request is a new connection. Latency is from sending the
request to the last byte of the body. Also reported: the achieved rate, the agent's CPU as % of
one core, and the worst sampler lag seen in the bodies.

    .venv/bin/python bench/scrape.py [--gpus 2] [--seconds 30] [--rate 200] [--rest-requests 60]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fakenvml.build import build  # noqa: E402  (tests/ is put on the path just above)

LAG_FAMILY = b"\nsustain_sampler_lag_seconds{"
LAG_LINE = re.compile(rb'^sustain_sampler_lag_seconds\{collector="([^"]+)"\} (\S+)$', re.MULTILINE)
TARGET_RATE = 200.0


def scenario(gpus: int) -> str:
    lines = ["set driver_version 550.54.15"]
    for index in range(gpus):
        lines += [
            f'device {index} name "NVIDIA H100 80GB HBM3" uuid GPU-{index:08d}-0000-0000-0000-0000',
            f"device {index} gpm_supported 1 max_sm_clock_mhz 1980 power_limit_mw 700000",
            f"at 0 {index} sm_clock_mhz 1410 power_mw 610000 gpu_temp_c 71 reasons 0x0",
            f"at 0 {index} gpu_util_pct 100 gpm_sm_occupancy_pct 45 gpm_dram_bw_util_pct 55",
        ]
    return "\n".join(lines) + "\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def lags(body: bytes) -> dict[str, float]:
    """The sampler lag of each collector in an exposition, read from its few lines only."""
    at = body.find(LAG_FAMILY)
    if at < 0:
        return {}
    return {m[1].decode(): float(m[2]) for m in LAG_LINE.finditer(body, at + 1, at + 1024)}


@dataclass
class Load:
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    worst_lag: dict[str, float] = field(default_factory=dict)
    body_bytes: int = 0
    elapsed: float = 0.0


def request(connection: http.client.HTTPConnection) -> tuple[int, bytes]:
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    return response.status, response.read()


def at_rest(port: int, count: int, gap: float) -> Load:
    load = Load()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for _ in range(count):
        sent = time.monotonic()
        status, body = request(connection)
        load.latencies.append(time.monotonic() - sent)
        if status != 200:
            load.errors.append(f"HTTP {status}")
        load.body_bytes = len(body)
        time.sleep(gap)
    connection.close()
    return load


def under_load(port: int, rate: float, seconds: float, threads: int) -> Load:
    load = Load()
    lock = threading.Lock()
    next_index = 0
    start = time.monotonic() + 0.05

    def due() -> float | None:
        nonlocal next_index
        with lock:
            at = start + next_index / rate
            next_index += 1
        return at if max(at, time.monotonic()) < start + seconds else None

    def client() -> None:
        latencies: list[float] = []
        errors: list[str] = []
        worst: dict[str, float] = {}
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        while (at := due()) is not None:
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            sent = time.monotonic()
            try:
                status, body = request(connection)
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                errors.append(repr(exc))
                continue
            latencies.append(time.monotonic() - sent)
            if status != 200:
                errors.append(f"HTTP {status}")
            for collector, lag in lags(body).items():
                worst[collector] = max(lag, worst.get(collector, 0.0))
        connection.close()
        with lock:
            load.latencies += latencies
            load.errors += errors
            for collector, lag in worst.items():
                load.worst_lag[collector] = max(lag, load.worst_lag.get(collector, 0.0))

    workers = [threading.Thread(target=client) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    load.elapsed = time.monotonic() - start
    return load


def quantiles_ms(latencies: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return cuts[49] * 1000, cuts[98] * 1000


def wait_ready(port: int, process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"agent exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
                body = reply.read()
            if b"sustain_gpu_power_watts{" in body and len(lags(body)) >= 2:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("agent not ready in time")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the load")
    parser.add_argument("--rate", type=float, default=TARGET_RATE, help="requests/s offered")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--rest-requests", type=int, default=60)
    parser.add_argument("--rest-gap", type=float, default=1.0, help="seconds between them")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        library = build(work / "lib")
        (work / "bench.scn").write_text(scenario(args.gpus))
        (work / "sustain.toml").write_text(
            "[agent]\n"
            'node = "bench-node"\n'
            "[host]\n"
            f'sysfs = "{ROOT / "tests" / "fixtures" / "host" / "sys"}"\n'
            "[probing]\n"
            "enabled = false\n"
            "[drift]\n"
            "enabled = false\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
        env |= {
            "LD_LIBRARY_PATH": str(library.parent),
            "FAKENVML_SCENARIO": str(work / "bench.scn"),
        }
        port = free_port()
        with (work / "agent.log").open("w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "agent", "run", "--config", str(work / "sustain.toml"),
                 "--listen", f"127.0.0.1:{port}", "--data-dir", str(work / "data")],
                stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=ROOT,
            )  # fmt: skip
        try:
            wait_ready(port, process)
            time.sleep(2)  # a few polls' worth of windows
            rest = at_rest(port, args.rest_requests, args.rest_gap)
            agent = psutil.Process(process.pid)
            cpu_before = sum(agent.cpu_times()[:2])
            loaded = under_load(port, args.rate, args.seconds, args.threads)
            agent_cpu = 100 * (sum(agent.cpu_times()[:2]) - cpu_before) / loaded.elapsed
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()

    rest_p50, rest_p99 = quantiles_ms(rest.latencies)
    load_p50, load_p99 = quantiles_ms(loaded.latencies)
    achieved = (len(loaded.latencies) + len(loaded.errors)) / loaded.elapsed
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, "
        f"Python {platform.python_version()}; "
        f"{args.gpus} fake GPUs, /metrics body {rest.body_bytes / 1024:.0f} KiB"
    )
    print("| condition | requests | rate | p50 | p99 | errors |")
    print("|---|---|---|---|---|---|")
    print(
        f"| at rest, sequential, {args.rest_gap:g} s apart | {len(rest.latencies)} "
        f"| {1 / args.rest_gap:g}/s "
        f"| {rest_p50:.1f} ms | {rest_p99:.1f} ms | {len(rest.errors)} |"
    )
    print(
        f"| under load, {args.threads} threads, {args.rate:g}/s offered for {args.seconds:g} s "
        f"| {len(loaded.latencies) + len(loaded.errors)} | {achieved:.1f}/s achieved "
        f"| {load_p50:.1f} ms | {load_p99:.1f} ms | {len(loaded.errors)} |"
    )
    worst = ", ".join(f"{c} {lag * 1000:.1f} ms" for c, lag in sorted(loaded.worst_lag.items()))
    print(f"agent CPU under load: {agent_cpu:.0f} % of one core; worst sampler lag: {worst}")
    result = {
        "gpus": args.gpus,
        "body_bytes": rest.body_bytes,
        "rest": {
            "requests": len(rest.latencies),
            "gap_s": args.rest_gap,
            "p50_ms": rest_p50,
            "p99_ms": rest_p99,
            "errors": len(rest.errors),
        },
        "load": {
            "threads": args.threads,
            "seconds": args.seconds,
            "offered_rps": args.rate,
            "achieved_rps": achieved,
            "requests": len(loaded.latencies) + len(loaded.errors),
            "p50_ms": load_p50,
            "p99_ms": load_p99,
            "errors": len(loaded.errors),
            "agent_cpu_percent": agent_cpu,
            "worst_lag_ms": {c: lag * 1000 for c, lag in loaded.worst_lag.items()},
        },
    }
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
