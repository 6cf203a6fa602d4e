"""Acceptance 4 of issue 18: long-term series. The real Prometheus scrapes the agent of the
end-to-end stack (tests/e2e_stack.py: fake NVML, two H100s, GPU 1 thermally throttled, short
probes, a seeded archive) with the shipped rules, and remote-writes everything to a real
VictoriaMetrics on 127.0.0.1, the way docs/deploy.md ("Long-term storage") sets it up. Then every
expression of every dashboard (panels, annotations, variables) and every recording and alerting
rule of deploy/prometheus/rules.yml is evaluated by VictoriaMetrics' Prometheus query API, instant
and over the stack's span: each is answered without error (MetricsQL accepts it) and returns data,
or is one of NO_DATA, whose reasons docs/deploy.md lists too.

The stack is the one tests/test_prometheus_e2e.py checks Prometheus on, started once for both
modules (fixture `e2e_stack`; the tests share the xdist group "e2e-stack", so that one worker
runs them all). Whichever module runs first waits for the stack's figures; the other finds them.

VictoriaMetrics is the long-term store checked for real because Debian packages it (a single
binary, no object store) and because its query language, MetricsQL, is the dialect most likely to
read a PromQL expression differently; Thanos Receive and Mimir take the same remote-write protocol.
Its `-search.latencyOffset` (30 s by default: the newest samples are hidden from queries) is set
to 1 s so that the test does not wait for it.
"""

from __future__ import annotations

import re
import subprocess
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml

# The stack's module is a plugin (pytest_plugins below) that this module imports first: its
# asserts are rewritten only if pytest is told before the import.
pytest.register_assert_rewrite("e2e_stack")
from e2e_stack import (  # noqa: E402
    GROUP,
    RULES,
    UUID0,
    UUID1,
    Stack,
    answered,
    api,
    load_queries,
    wait_for,
    wait_for_figures,
)
from test_dashboards import promtool  # noqa: E402

pytest_plugins = ["e2e_stack"]  # its fixture and hooks: one stack for this module and the other

ROOT = Path(__file__).resolve().parent.parent
DEPLOY_DOC = ROOT / "docs" / "deploy.md"

# Expressions that return nothing in this scenario, and why; docs/deploy.md repeats each name.
# Alerts only: each answers, over series that VictoriaMetrics holds, that all is well.
NO_DATA = {
    "alert SustainProbeThroughputBelowBaseline": "every result of the last 2 hours is part of "
    "the 7-day median it is compared with: needs days of history and a slower device",
    "alert SustainGpuPowerBrake": "no GPU of the scenario has its power brake asserted",
    "alert SustainGpuLost": "both GPUs answer NVML",
    "alert SustainProbesFailing": "no probe fails or times out (3 in 3 hours are needed)",
    "alert SustainProbeNodeCouplingLow": "needs 3 low node-wide runs in a row: the test lasts 2",
    "alert SustainDeviceDegraded": "both GPUs are unhealthy (pending row remaps), the CPU healthy",
    "alert SustainAgentDown": "the agent is up",
    "alert SustainSamplerStalled": "no sampler stalls",
    "alert SustainCollectorDown": "every collector reads",
    "alert SustainCollectorErrors": "no collector fails half its polls",
    "alert SustainArchiveSpoolBacklog": "the archive is reachable: nothing waits in the spool",
    "alert SustainArchiveWritesRejected": "the archive rejects no write",
    "alert SustainDeviceHealthUnknown": "every device of the scenario is sampled: none is unknown",
    "alert SustainArchiveWritesLost": "the spool takes every write: nothing is dropped",
    "alert SustainArchiveNotWriting": "the archive is open and writes: nothing waits for long",
}
# Series that exist only once something went wrong, which is why the alerts on them are quiet.
ABSENT_WHILE_WELL = {
    "sustain_collector_errors_total": "one series per collector and kind, from the first error",
    "sustain_archive_spool_oldest_timestamp_seconds": "absent while the spool is empty",
}
# A metric name in an expression: `sustain_*`, `up`, or a recorded series (level:metric:ops).
METRIC_NAME = re.compile(r"(?<![\w:\"])(?:sustain_\w+|[a-z_]+:\w+:\w+|up)(?![\w(])")
# A figure the latest probe run lacks comes with the next run, as in test_prometheus_e2e.py:
# what is empty gets a one-minute plan interval more.
RETRY_SECONDS = 65.0


def expressions() -> list[tuple[str, str]]:
    """(name, expr): every dashboard query (Grafana's variables set to All) and every rule."""
    found = [(f"{dashboard} / {title}", expr) for dashboard, title, expr in load_queries()]
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            kind = "recording rule" if "record" in rule else "alert"
            found.append((f"{kind} {rule.get('record') or rule['alert']}", rule["expr"]))
        for rule in group["rules"]:
            if "record" in rule:  # the recorded series, as the dashboards read it
                found.append((f"series {rule['record']}", rule["record"]))
    return found


@pytest.mark.slow
@pytest.mark.xdist_group(GROUP)
@pytest.mark.timeout(600)  # the stack's start, up to 300 s for the figures, 65 s of retries
def test_every_expression_answers_from_victoriametrics(e2e_stack: Stack) -> None:
    vm, prometheus = e2e_stack.victoria_metrics, e2e_stack.prometheus
    # What the slowest parts need (as in test_prometheus_e2e.py), arrived in VictoriaMetrics.
    wait_for(e2e_stack, vm, 'up{job="sustain"} == 1', time.monotonic() + 120)
    wait_for_figures(e2e_stack, vm, since_start=True)
    time.sleep(3)  # a few more rule evaluations and remote-write batches

    # The same series as Prometheus holds: one GPU family, label for label.
    def gpus(base: str) -> list[dict[str, str]]:
        found = api(base, "query", query="sustain_gpu_info")["result"]
        return sorted((sample["metric"] for sample in found), key=lambda m: m["uuid"])

    assert [gpu["uuid"] for gpu in gpus(vm)] == [UUID0, UUID1]
    assert gpus(vm) == gpus(prometheus)

    wanted = expressions()
    assert len(wanted) > 150
    undocumented = [name for name in NO_DATA if name not in dict(wanted)]
    assert not undocumented, f"NO_DATA names no expression: {undocumented}"

    # VictoriaMetrics answers without error (api() and query_range() check that); data now or
    # over the stack's span.
    missing = [(name, expr) for name, expr in wanted if not answered(vm, expr, e2e_stack.started)]
    deadline = time.monotonic() + RETRY_SECONDS
    while time.monotonic() < deadline and [name for name, _ in missing if name not in NO_DATA]:
        time.sleep(2)
        missing = [
            (name, expr) for name, expr in missing if not answered(vm, expr, e2e_stack.started)
        ]
    empty = [f"{name}: {expr}" for name, expr in missing if name not in NO_DATA]
    assert not empty, "no data in VictoriaMetrics:\n" + "\n".join(empty)

    # What returns nothing does so over series that are there: a condition that does not hold.
    for name, expr in missing:
        for metric in set(METRIC_NAME.findall(expr)) - set(ABSENT_WHILE_WELL):
            assert api(vm, "query", query=f"count({metric})")["result"], f"{name}: no {metric}"

    doc = DEPLOY_DOC.read_text()
    assert "Long-term storage (remote_write)" in doc
    assert not [name for name in NO_DATA if f"`{name}`" not in doc], "docs/deploy.md lacks these"


def test_the_documented_remote_write_configurations_are_valid(tmp_path: Path) -> None:
    """Each remote_write snippet of docs/deploy.md (Thanos, Mimir, VictoriaMetrics) is accepted by
    `promtool check config`, and they name the stores' remote-write paths."""
    doc = DEPLOY_DOC.read_text()
    section = doc[doc.index("## Long-term storage (remote_write)") :]
    section = section[: section.index("\n## ")]
    snippets = [
        block
        for block in re.findall(r"```yaml\n(.*?)```", section, re.S)
        if "remote_write" in block
    ]
    urls = [yaml.safe_load(snippet)["remote_write"][0]["url"] for snippet in snippets]
    assert [urllib.parse.urlsplit(url).path for url in urls] == [
        "/api/v1/receive",
        "/api/v1/push",
        "/api/v1/write",
    ]
    for index, snippet in enumerate(snippets):
        config = tmp_path / f"prometheus-{index}.yml"
        config.write_text(snippet)
        checked = subprocess.run(
            [promtool(), "check", "config", str(config)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr
