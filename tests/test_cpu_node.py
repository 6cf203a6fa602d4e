"""A CPU-only node, which this machine is (no NVIDIA driver): a real `sustain run` stays quiet.

The NVML collector is absent, not down, and no error counter moves while the host collector
works. The alerting side of the same promise (none of the shipped alerts fires on such a node's
series) is the promtool test deploy/prometheus/tests/cpu_node.yml.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import Running, fetch, start_agent
from prometheus_client.parser import text_string_to_metric_families
from test_daemon import STARTUP_SECONDS, ready

Series = tuple[str, tuple[tuple[str, str], ...]]

# NVML is looked for again after nvml.absent_retry_seconds (60 s by default), then after twice
# that, and so on: with 1 s, the agent looks again 1 s, 3 s and 7 s after its first try.
ABSENT_RETRY_SECONDS = 1.0
RETRIES = 3  # the looks after the first: the window ends after the third
WINDOW_SECONDS = ABSENT_RETRY_SECONDS * (2**RETRIES - 1)


def samples(exposition: str) -> dict[Series, float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


def errors(exposition: dict[Series, float]) -> dict[Series, float]:
    return {
        series: value
        for series, value in exposition.items()
        if series[0].endswith(("_errors_total", "_errors"))
    }


def named(exposition: dict[Series, float], name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: value for (series, labels), value in exposition.items() if series == name}


def nvml_polls(exposition: dict[Series, float]) -> float:
    return named(exposition, "sustain_collector_polls_total")[(("collector", "nvml"),)]


def later_exposition(running: Running, after: float, polls: float) -> dict[Series, float]:
    """/metrics once the wall clock has passed ``after`` and the NVML loop has polled twice more
    since then (so a poll that looked for NVML again is in it), or has ``polls`` polls."""
    deadline = time.monotonic() + 120
    since: float | None = None
    while time.monotonic() < deadline:
        status, body = fetch(running.base + "/metrics", timeout=10)
        assert status == 200
        exposition = samples(body)
        if time.time() > after:
            if since is None:
                since = nvml_polls(exposition)
            elif nvml_polls(exposition) >= max(since + 2, polls):
                return exposition
        time.sleep(0.2)
    pytest.fail("the NVML loop stopped polling")


@pytest.mark.slow
def test_no_error_counter_moves_and_nvml_is_absent_across_its_retries(tmp_path: Path) -> None:
    """Acceptance 5: /metrics at start and after NVML was looked for again three times (past
    its first retry, which the default puts a minute in; nvml.absent_retry_seconds brings it
    forward, the back-off is the same)."""
    running = start_agent(
        tmp_path,
        env={
            "SUSTAIN_NVML__ABSENT_RETRY_SECONDS": str(ABSENT_RETRY_SECONDS),
            "SUSTAIN_AGENT__LOG_LEVEL": "debug",  # each look again is a debug line
        },
    )
    try:
        first = samples(ready(running))
        # The first look was made by now (the loops start together; the host's took two polls).
        last = later_exposition(running, time.time() + WINDOW_SECONDS, nvml_polls(first) + 5)
        running.wait_for("sustain_stack_info{", timeout=STARTUP_SECONDS)  # a stop waits for it
    finally:
        code, _, err = running.terminate()
    assert code == 0, err

    assert errors(last), "no error counter exposed: nothing was compared"
    moved = {
        series: (first.get(series, 0.0), value)
        for series, value in errors(last).items()
        if value != first.get(series, 0.0)
    }
    assert moved == {}, f"error counters moved across NVML's retries: {moved}"
    absent = {(("collector", "nvml"), ("reason", "library_not_found")): 1.0}
    for exposition in (first, last):
        assert named(exposition, "sustain_collector_up") == {(("collector", "host"),): 1.0}
        assert named(exposition, "sustain_collector_absent") == absent
    # The loop ran all along (1 Hz), and NVML was looked for again, on its back-off, quietly:
    # one info line, then a debug line at each look.
    assert nvml_polls(last) >= nvml_polls(first) + 5
    lines = err.splitlines()
    info = [line for line in lines if "NVML unavailable" in line and "not an error" in line]
    assert len(info) == 1, err
    looks = [line for line in lines if "NVML unavailable" in line and "looked for again in" in line]
    assert len(looks) >= RETRIES, err
    assert [line.rsplit(" in ", 1)[1] for line in looks[:RETRIES]] == ["2 s", "4 s", "8 s"], looks
