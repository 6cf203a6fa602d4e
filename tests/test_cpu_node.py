"""A CPU-only node, which this machine is (no NVIDIA driver): a real `sustain run` stays quiet.

The NVML collector is absent, not down, and no error counter moves while the host collector
works. The alerting side of the same promise (none of the shipped alerts fires on such a node's
series) is the promtool test deploy/prometheus/tests/cpu_node.yml.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import fetch, start_agent
from prometheus_client.parser import text_string_to_metric_families

Series = tuple[str, tuple[tuple[str, str], ...]]


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


@pytest.mark.slow
def test_no_error_counter_moves_and_nvml_is_absent_for_a_minute(tmp_path: Path) -> None:
    """Acceptance 5: /metrics at start and 60 s later (past NVML's first retry)."""
    running = start_agent(tmp_path)
    try:
        first = samples(running.wait_ready())
        time.sleep(60)
        status, body = fetch(running.base + "/metrics")
        assert status == 200
        last = samples(body)
    finally:
        code, _, err = running.terminate()
    assert code == 0, err

    assert errors(last), "no error counter exposed: nothing was compared"
    moved = {
        series: (first.get(series, 0.0), value)
        for series, value in errors(last).items()
        if value != first.get(series, 0.0)
    }
    assert moved == {}, f"error counters moved in 60 s: {moved}"
    absent = {(("collector", "nvml"), ("reason", "library_not_found")): 1.0}
    for exposition in (first, last):
        assert named(exposition, "sustain_collector_up") == {(("collector", "host"),): 1.0}
        assert named(exposition, "sustain_collector_absent") == absent
    polls = named(last, "sustain_collector_polls_total")
    assert polls[(("collector", "nvml"),)] >= 55  # the loop ran all along, at 1 Hz
    assert err.count("NVML unavailable") == 1, err
