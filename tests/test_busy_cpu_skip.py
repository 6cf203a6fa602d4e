"""A probe skipped on a busy CPU names the foreign processes that keep it busy, measured by the
scheduler's process table (collectors/processes.py) against a real busy process started here."""

from __future__ import annotations

import os
import re
import time

from test_processes import cpu_seconds, foreign_busy_process, parents

from agent.config.settings import ProbingSection
from agent.probes.devices import TelemetryCapture
from agent.probes.runner import CPU, ProbeRunner, ProbeSpec
from agent.probes.scheduler import ProbeScheduler
from agent.telemetry.store import TelemetryStore
from collectors.base import Reading, Sample
from collectors.processes import ProcessCpuMeter, process_tree


def test_a_busy_cpu_skip_names_the_foreign_process() -> None:
    store = TelemetryStore(64)
    now = time.time()
    for second in range(5):
        store.record(Sample("host", "host", now - second, (Reading("cpu_utilization_ratio", 0.9),)))
    scheduler = ProbeScheduler(
        ProbingSection(busy_cpu_utilization=0.5, duty_cycle=1.0),
        ProbeRunner(),
        store,
        TelemetryCapture(),
        (),
        1.0,
        processes=ProcessCpuMeter(),
    )
    spec = ProbeSpec("matmul", "fp32", "eager", 0.5, CPU)
    with foreign_busy_process() as foreign:
        before = cpu_seconds(foreign)
        started = time.monotonic()
        reason = scheduler.skip_reason(spec)
        rate = (cpu_seconds(foreign) - before) / (time.monotonic() - started)
    assert reason is not None
    head, _, top = reason.partition("; top: ")
    assert head == "CPU busy: mean utilization 90% over the last minute (threshold 50%)"
    named = [
        (int(pid), float(cpus))
        for pid, cpus in re.findall(r"pid (\d+) \S+ (\d+\.\d) CPUs(?:, |$)", top)
    ]
    assert 1 <= len(named) <= 3, reason
    assert all(pid not in process_tree(os.getpid(), parents()) for pid, _ in named)
    if foreign.pid not in {pid for pid, _ in named}:
        # Only when three other processes kept more CPU busy than it did.
        assert len(named) == 3, reason
        assert all(cpus >= rate - 0.1 for _, cpus in named), (reason, rate)
