"""Idle overhead of the daemon: CPU time as % of one core and peak RSS over a 60 s run.

Starts `sustain run` with the embedded defaults (host collector at 1 Hz, SQLite archive in a
temporary directory, rollups every minute), waits until it serves metrics, scrapes /metrics every
15 s as a Prometheus server would, and measures the process from then on for --seconds.
Targets (issue 2): at most 1 % of one core and at most 100 MB RSS.

    .venv/bin/python bench/overhead.py [--seconds 60]

The last line is `RESULT {json}` for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def peak_rss_bytes(pid: int) -> int:
    """VmHWM: the kernel's own high-water mark of the resident set, not a sampled guess."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM missing from /proc/PID/status")


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"agent exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if b"sustain_cpu_utilization_ratio " in response.read():
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("agent not ready in time")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--scrape-interval", type=float, default=15.0)
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUSTAIN_")}
    with tempfile.TemporaryDirectory() as data_dir:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agent",
                "run",
                "--listen",
                f"127.0.0.1:{port}",
                "--data-dir",
                data_dir,
                "--log-level",
                "warning",
            ],
            env=env,
        )
        try:
            wait_ready(url, process)
            proc = psutil.Process(process.pid)
            start_cpu = proc.cpu_times()
            started = time.monotonic()
            scrapes = 0
            while (elapsed := time.monotonic() - started) < args.seconds:
                with urllib.request.urlopen(url, timeout=5) as response:
                    response.read()
                scrapes += 1
                time.sleep(min(args.scrape_interval, max(0.0, args.seconds - elapsed)))
            end_cpu = proc.cpu_times()
            wall = time.monotonic() - started
            peak = peak_rss_bytes(process.pid)
            rss = proc.memory_info().rss
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=10)

    cpu = (end_cpu.user - start_cpu.user) + (end_cpu.system - start_cpu.system)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}"
    )
    print(f"window: {wall:.1f} s after start-up, {scrapes} scrapes of /metrics")
    print(f"cpu: {cpu:.2f} s = {100 * cpu / wall:.2f} % of one core (target <= 1 %)")
    print(f"rss: {rss / 2**20:.1f} MiB at the end, peak {peak / 2**20:.1f} MiB (target <= 100 MB)")
    print(f"exit code after SIGTERM: {code}")
    result = {
        "seconds": wall,
        "scrapes": scrapes,
        "cpu_seconds": cpu,
        "cpu_percent": 100 * cpu / wall,
        "rss_end_mib": rss / 2**20,
        "rss_peak_mib": peak / 2**20,
        "exit_code": code,
    }
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
