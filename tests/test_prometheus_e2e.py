"""Acceptance 1 of issue 7: the real Prometheus server on 127.0.0.1 scrapes a `sustain run` that
uses the fake NVML driver (two H100s, GPU 1 in HW thermal slowdown throughout) and probes on short
intervals; then every PromQL expression of every dashboard panel and every recording rule returns
data through Prometheus' HTTP API, and the thermal alert is pending or firing for GPU 1 only. The
DCGM bridge (deploy/prometheus/dcgm-bridge.yml) answers dcgm-exporter's dashboard as it is written.

The stack (the agent, Prometheus, and the VictoriaMetrics that tests/test_victoriametrics.py
reads) is tests/e2e_stack.py's, started once for both modules (fixture `e2e_stack`; the tests
share the xdist group "e2e-stack", so that one worker runs them all); its docstring describes the
scenario, the probe plan and the seeded archive. Panels and rules answer now, to an instant query,
as a stat panel asks. An annotation answers over the stack's span, as Grafana evaluates one over
the dashboard's time range: the stack changes early and once (its first stack, then the SDPA
backend of the first attention run), and `increase(...[5m]) > 0` then holds for five minutes
only, which a slow run on a loaded machine may outlast.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import yaml

# The stack's module is a plugin (pytest_plugins below) that this module imports first: its
# asserts are rewritten only if pytest is told before the import.
pytest.register_assert_rewrite("e2e_stack")
from e2e_stack import (  # noqa: E402
    GROUP,
    MODEL,
    RULES,
    THROUGHPUT,
    UUID0,
    UUID1,
    Stack,
    answered,
    api,
    load_queries,
    wait_for,
    wait_for_figures,
)

pytest_plugins = ["e2e_stack"]  # its fixture and hooks: one stack for this module and the other

# A figure the latest run lacks (a run that found no steady state all the same) comes back with a
# later run: what is empty gets two of the one-minute plan intervals more.
RETRY_SECONDS = 125.0


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
@pytest.mark.timeout(600)  # the stack's start, up to 300 s for the figures, 125 s of retries
def test_every_dashboard_query_and_rule_returns_data(e2e_stack: Stack) -> None:
    base = e2e_stack.prometheus
    wait_for_figures(e2e_stack, base)
    time.sleep(5)  # a few more evaluations of every rule group

    rules = yaml.safe_load(RULES.read_text())
    records = [r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r]
    assert records
    queries = load_queries()
    assert any(title.startswith("annotation: ") for _, title, _ in queries)
    wanted = [
        (f"{dashboard} / {title}: {expr}", expr, title.startswith("annotation: "))
        for dashboard, title, expr in queries
    ]
    wanted += [(f"recording rule {record}", record, False) for record in records]

    def empty(expr: str, annotation: bool) -> bool:
        return not answered(base, expr, e2e_stack.started if annotation else None)

    missing = [
        (name, expr, annotation) for name, expr, annotation in wanted if empty(expr, annotation)
    ]
    deadline = time.monotonic() + RETRY_SECONDS
    while missing and time.monotonic() < deadline:
        time.sleep(2)
        missing = [(n, e, a) for n, e, a in missing if empty(e, a)]
    names = [name for name, _, _ in missing]
    # On failure, what the probes did: tells a missing run from a missing figure.
    probes = (
        ""
        if not names
        else (
            f"\nthroughput: {api(base, 'query', query=THROUGHPUT)['result']}"
            f"\n{e2e_stack.agent_log(6000)}"
        )
    )
    assert not names, "no data:\n" + "\n".join(names) + probes

    # The thermal alert: pending or firing for the throttled GPU (1) only.
    alerts = [
        alert
        for alert in api(base, "alerts")["alerts"]
        if alert["labels"]["alertname"] == "SustainGpuThermalThrottling"
    ]
    assert alerts, e2e_stack.agent_log()
    assert {alert["labels"]["uuid"] for alert in alerts} == {UUID1}
    assert all(alert["state"] in ("pending", "firing") for alert in alerts)


def grafana_regex(values: list[str]) -> str:
    """A multi-value variable set to All, as Grafana writes it into a `=~` matcher: each value's
    regex characters escaped (twice: once for PromQL's string), joined in one group."""
    escaped = [re.sub(r"[$^*{}\[\]'+?.()|\\]", lambda m: "\\\\" + m.group(0), v) for v in values]
    return "(" + "|".join(escaped) + ")"


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
@pytest.mark.timeout(300)  # the stack's start, if this test runs first, and 120 s for an XID
def test_dcgm_dashboard_queries_over_the_bridge(e2e_stack: Stack) -> None:
    """deploy/prometheus/dcgm-bridge.yml: queries written the way dcgm-exporter's Grafana dashboard
    writes them (its Hostname and gpu variables, and the older instance one) return data for every
    bridged field of its default counters, in DCGM's units and with DCGM's labels."""
    base = e2e_stack.prometheus
    # The last to arrive.
    wait_for(e2e_stack, base, 'DCGM_FI_DEV_XID_ERRORS{gpu="1"} == 13', time.monotonic() + 120)
    bridge = yaml.safe_load((RULES.parent / "dcgm-bridge.yml").read_text())
    fields = [r["record"] for g in bridge["groups"] for r in g["rules"] if "DCGM_" in r["record"]]
    assert len(fields) >= 20

    # The dashboard's variables, resolved as Grafana resolves them: label values of FB_FREE.
    hosts = api(base, "label/Hostname/values", **{"match[]": "DCGM_FI_DEV_FB_FREE"})
    assert hosts == ["127.0.0.1"]
    hostname = grafana_regex(hosts)
    gpus = api(
        base, "label/gpu/values", **{"match[]": f'DCGM_FI_DEV_FB_FREE{{Hostname=~"{hostname}"}}'}
    )
    assert gpus == ["0", "1"]
    gpu = grafana_regex(gpus)
    instances = api(base, "label/instance/values", **{"match[]": "DCGM_FI_DEV_GPU_TEMP"})
    selector = f'{{Hostname=~"{hostname}", gpu=~"{gpu}"}}'
    by_instance = f'{{instance=~"{grafana_regex(instances)}", gpu=~"{gpu}"}}'

    def query(expr: str) -> list[Any]:
        result: list[Any] = api(base, "query", query=expr)["result"]
        assert result, f"no data: {expr}"
        return result

    labels = {}
    for field in fields:
        for expr in (
            f"max({field}{selector}) by (Hostname, gpu, UUID)",
            f"{field}{by_instance}",
            f"sum({field}{selector}) by (gpu)",
        ):
            assert {s["metric"]["gpu"] for s in query(expr)} == {"0", "1"}, expr
        for sample in query(f"{field}{selector}"):
            labels[(field, sample["metric"]["gpu"])] = sample["metric"]
    for (field, index), metric in labels.items():
        assert metric["UUID"] == (UUID0, UUID1)[int(index)], field
        assert metric["device"] == f"nvidia{index}", field
        assert metric["modelName"] == MODEL, field
        assert metric["Hostname"] == "127.0.0.1", field
        assert metric["DCGM_FI_DRIVER_VERSION"] == "550.54.15", field
        assert metric["pci_bus_id"].lower() == ("00000000:18:00.0", "00000000:2a:00.0")[int(index)]
        assert "uuid" not in metric, field

    # NVIDIA's panels as written, and the scenario's readings in DCGM's units.
    assert float(query(f"avg(DCGM_FI_DEV_GPU_TEMP{selector})")[0]["value"][1]) == 76.5
    power = query(f"sum(max(DCGM_FI_DEV_POWER_USAGE{selector}) by (gpu))")
    assert float(power[0]["value"][1]) == pytest.approx(700, rel=0.01)
    clocks = query(f"max(DCGM_FI_DEV_SM_CLOCK{selector} * 1000000) by (Hostname, UUID, gpu)")
    assert {s["metric"]["gpu"]: float(s["value"][1]) for s in clocks} == {"0": 1.41e9, "1": 1.1e9}
    for panel in ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"):
        query(f"max({panel}{selector}) by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)")
    expected = {
        "DCGM_FI_DEV_MEM_CLOCK": 2619,
        "DCGM_FI_DEV_MEMORY_TEMP": 70,
        "DCGM_FI_DEV_GPU_UTIL": 90,
        "DCGM_FI_DEV_MEM_COPY_UTIL": 40,
        "DCGM_FI_DEV_FB_USED": 1024,
        "DCGM_FI_DEV_FB_RESERVED": 528,
        "DCGM_FI_DEV_FB_FREE": 81920 - 528 - 1024,
        "DCGM_FI_DEV_PCIE_TX_THROUGHPUT": 1000,
        "DCGM_FI_DEV_PCIE_RX_THROUGHPUT": 2000,
        "DCGM_FI_PROF_PCIE_TX_BYTES": 1000 * 1000,
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 3,
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 1,
        "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0,
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": 12,
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.9,
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.6,
        "DCGM_FI_PROF_DRAM_ACTIVE": 0.55,
        "DCGM_FI_PROF_SM_OCCUPANCY": 0.45,
    }
    for field, value in expected.items():
        got = float(query(f'{field}{{gpu="0"}}')[0]["value"][1])
        assert got == pytest.approx(value, rel=1e-6), field
    xids = query(f"DCGM_FI_DEV_XID_ERRORS{selector}")
    assert {s["metric"]["gpu"]: float(s["value"][1]) for s in xids} == {"0": 79, "1": 13}
    energy = query('DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0"}')
    assert float(energy[0]["value"][1]) >= 5e6  # mJ: the scenario's 5000 J at least
