"""The analysis of probe runs: the analysis child (`python -m agent.analysis`) and, live, a real
CPU matmul probe slowed by a competing process started halfway through (acceptance 3 of
issue 5, its last case: the CPU's clock does not drop, so the cause is not_clock_bound)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.config.settings import ProbingSection
from agent.exporter.metrics import AgentMetrics
from agent.probes.devices import TelemetryCapture
from agent.probes.runner import CPU, ProbeRun, ProbeRunner, ProbeSpec
from agent.probes.scheduler import ProbeScheduler
from agent.telemetry.sampler import SamplerLoop
from agent.telemetry.store import TelemetryStore
from collectors.host import HostCollector


def analysis_child(request: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.analysis"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_analysis_child_uses_the_main_phase_and_maps_indices_back() -> None:
    iterations = []
    t = 1000.0
    for round_ in range(60):  # one prefill, then five decode steps, 60 times
        iterations.append([t, t + 0.05, 512, "prefill"])
        t += 0.05
        for _ in range(5):
            step = 0.01 if round_ < 30 else 0.0125  # decode 20% slower from round 30
            iterations.append([t, t + step, 8, "decode"])
            t += step
    result = analysis_child({"iterations": iterations, "tolerance": 0.02})
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["phase"] == "decode"
    assert figures["classification"] == "slowdown"
    assert figures["n"] == 300
    start = figures["steady_start_index"]
    assert iterations[start][3] == "decode"
    assert abs(start - 30 * 6) <= 6  # in the run's own numbering, prefills included
    assert figures["steady_throughput"] == pytest.approx(8 / 0.0125, rel=0.01)


@pytest.mark.parametrize(
    "request_",
    [{"iterations": [[1.0, 0.5, 1.0, None]]}, {"nothing": []}, [1, 2]],
)
def test_analysis_child_bad_input_is_one_line_exit_2(request_: object) -> None:
    result = analysis_child(request_)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1


def burn(stop: threading.Event) -> None:
    """A process spinning on one core until ``stop``: the probe's two threads now share it."""
    hog = subprocess.Popen(
        [sys.executable, "-c", "import os\nos.sched_setaffinity(0, {1})\nwhile True: pass"]
    )
    stop.wait()
    hog.kill()
    hog.wait()


def slowed_probe() -> tuple[ProbeScheduler, ProbeRun]:
    """A 20 s fp32 matmul on the CPU; 12 s in, a process starts spinning on one of the two
    cores, which the probe's two threads then share."""
    store = TelemetryStore(1024)
    capture = TelemetryCapture()
    loop = SamplerLoop(HostCollector(), 1.0, sinks=(store.record, capture.record), stall_seconds=30)
    scheduler = ProbeScheduler(
        ProbingSection(duty_cycle=1.0), ProbeRunner(), store, capture, (loop,), 1.0
    )
    spec = ProbeSpec("matmul", "fp32", "eager", 20.0, CPU)
    stop = threading.Event()
    hog = threading.Timer(12.0, burn, args=(stop,))  # halfway: the child starts in ~2 s
    loop.start()
    hog.start()
    try:
        run = scheduler.run_one(spec, force=True)
    finally:
        stop.set()
        hog.cancel()
        loop.request_stop()
        loop.join(2)
    return scheduler, run


@pytest.mark.slow
def test_live_cpu_probe_slowed_by_a_competing_process_is_not_clock_bound() -> None:
    """Live: the OS shares the core unevenly now and then, and the contended regime may not
    settle within the run; one more attempt is allowed for that, never more."""
    for attempt in (1, 2):
        scheduler, run = slowed_probe()
        assert run.outcome == "ok", run.reason
        (result,) = scheduler.status().results.values()
        figures = result.analysis.figures
        if figures["classification"] == "slowdown" or attempt == 2:
            break
    assert figures["classification"] == "slowdown", (figures["reason"], figures["changepoints"])
    assert figures["sustained_ratio"] < 0.9, figures
    attribution = result.analysis.attribution
    assert attribution.cause == "not_clock_bound", attribution.reason
    assert len(run.telemetry) > 50  # the host at ~10 Hz while the probe ran


def test_inference_probe_exports_its_latency_percentiles() -> None:
    """A real CPU inference probe through the scheduler: the decode latency quantiles of its
    result line reach /metrics as sustain_probe_latency_seconds."""
    store = TelemetryStore(1024)
    capture = TelemetryCapture()
    loop = SamplerLoop(HostCollector(), 1.0, sinks=(store.record, capture.record), stall_seconds=30)
    scheduler = ProbeScheduler(
        ProbingSection(duty_cycle=1.0), ProbeRunner(), store, capture, (loop,), 1.0
    )
    # 8 s: at least the analysis minimum of 30 decode steps even when a loaded machine makes a
    # step take 0.15 s (a shorter run is insufficient, no longer ok).
    run = scheduler.run_one(ProbeSpec("inference", "fp32", "eager", 8.0, CPU, "small"), force=True)
    assert run.outcome == "ok", run.reason
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentMetrics(store, {}, lambda: [], 15.0, probes=scheduler.status))
    quantiles = {
        sample.labels["quantile"]: sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        if family.name == "sustain_probe_latency_seconds"
        for sample in family.samples
    }
    assert sorted(quantiles) == ["0.5", "0.9", "0.99"]
    assert 0 < quantiles["0.5"] <= quantiles["0.9"] <= quantiles["0.99"]
    assert quantiles["0.5"] == pytest.approx(run.result["latency_seconds"]["p50"])  # type: ignore[index]
