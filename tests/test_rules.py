"""The Prometheus rules (deploy/prometheus/rules.yml) against the real promtool and the docs.

- `promtool check rules` and `promtool test rules` on the unit tests in deploy/prometheus/tests;
  a missing promtool fails (it is never skipped): install Prometheus' promtool (Debian and Ubuntu:
  `apt-get install prometheus`) or point $PROMTOOL at one.
- Every alert has a test case in which it fires and one in which it is expected silent, and every
  recording rule is evaluated by a `promql_expr_test`.
- A CPU-only node's series (tests/cpu_node.yml) are expected to fire none of the alerts.
- Every metric a rule reads is in the catalogue (docs/metrics.md), with labels it has there.
- Every alert has a severity, a summary, a description and a runbook_url whose anchor is a
  section of docs/alerts.md; every recording rule is in that page's table.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests"
CATALOGUE = ROOT / "docs" / "metrics.md"
RUNBOOK = ROOT / "docs" / "alerts.md"

SEVERITIES = {"critical", "warning", "info"}
ANNOTATIONS = ("summary", "description", "runbook_url")
# Series Prometheus makes itself, with the labels rules may select on.
BUILTIN_SERIES = {"up": {"job", "instance"}}
# Labels every scraped series carries besides the exporter's own.
TARGET_LABELS = {"job", "instance"}
RUNBOOK_URL = re.compile(r"(?:^|/)docs/alerts\.md#([a-z0-9_-]+)$")
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")


def _load_yaml(path: Path) -> Any:
    """PyYAML (the `dev` extra) untyped: it ships no type information of its own."""
    yaml = importlib.import_module("yaml")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _promtool() -> str:
    override = os.environ.get("PROMTOOL")
    if override:
        if not os.access(override, os.X_OK):
            pytest.fail(f"PROMTOOL={override} is not an executable promtool")
        return override
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool not found: the Prometheus rules cannot be checked. Install it (Debian and "
            "Ubuntu: apt-get install prometheus; or the promtool binary of a Prometheus >= 2.42 "
            "release) on PATH, or set PROMTOOL to its path."
        )
    return path


def _run_promtool(*args: str) -> None:
    command = [_promtool(), *args]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
    )
    if done.returncode != 0:
        pytest.fail(
            f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}",
            pytrace=False,
        )


def _test_files() -> list[Path]:
    files = sorted(RULE_TESTS.glob("*.yml"))
    assert files, f"no promtool unit tests in {RULE_TESTS}"
    return files


@dataclass
class Rules:
    alerts: dict[str, dict[str, Any]] = field(default_factory=dict)
    records: dict[str, str] = field(default_factory=dict)  # name -> expression
    expressions: list[tuple[str, str]] = field(default_factory=list)  # (rule name, expression)


@cache
def _rules() -> Rules:
    rules = Rules()
    for group in _load_yaml(RULES)["groups"]:
        for rule in group["rules"]:
            expr = str(rule["expr"])
            if "alert" in rule:
                name = rule["alert"]
                assert name not in rules.alerts, f"alert {name} defined twice"
                rules.alerts[name] = rule
            else:
                name = rule["record"]
                assert name not in rules.records, f"recording rule {name} defined twice"
                rules.records[name] = expr
            rules.expressions.append((name, expr))
    return rules


@cache
def _catalogue() -> dict[str, set[str]]:
    """Metric name -> its labels, from the tables of docs/metrics.md."""
    families: dict[str, set[str]] = {}
    row = re.compile(r"^\| `(sustain_[a-z0-9_]+)` \|")
    for line in CATALOGUE.read_text(encoding="utf-8").splitlines():
        match = row.match(line)
        if match:
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            # name | type | unit | labels | source | interval | archived
            families[match.group(1)] = {label.strip() for label in cells[3].split(",") if label}
    assert len(families) > 50, f"could not read the catalogue tables of {CATALOGUE}"
    return families


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def _runbook_anchors() -> set[str]:
    text = RUNBOOK.read_text(encoding="utf-8")
    return {_github_anchor(match.group(1)) for match in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_promtool_check_rules() -> None:
    _run_promtool("check", "rules", str(RULES.relative_to(ROOT)))


@pytest.mark.slow  # every rule's promtool unit tests, ~20 s (left out of the quick tier)
def test_promtool_unit_tests() -> None:
    _run_promtool("test", "rules", *(str(path.relative_to(ROOT)) for path in _test_files()))


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    rules = _rules()
    fires: set[str] = set()
    silent: set[str] = set()
    tested_records: set[str] = set()
    problems: list[str] = []
    for path in _test_files():
        suite = _load_yaml(path)
        targets = {(path.parent / name).resolve() for name in suite.get("rule_files", [])}
        if RULES.resolve() not in targets:
            problems.append(f"{path.name}: rule_files does not load {RULES.relative_to(ROOT)}")
        for case in suite.get("tests", []):
            for check in case.get("alert_rule_test", []):
                name = check["alertname"]
                if name not in rules.alerts:
                    # promtool passes an expected-silent case of an alert that does not exist.
                    problems.append(f"{path.name}: {name} is not an alert of rules.yml")
                    continue
                expected = check.get("exp_alerts") or []
                if not expected:
                    silent.add(name)
                    continue
                fires.add(name)
                for alert in expected:
                    if not alert.get("exp_labels") or not alert.get("exp_annotations"):
                        problems.append(
                            f"{path.name}: {name} at {check['eval_time']} expects an alert "
                            "without checking its labels and annotations"
                        )
            for check in case.get("promql_expr_test", []):
                tested_records.update(
                    token
                    for token in IDENTIFIER.findall(STRING.sub("", check["expr"]))
                    if token in rules.records
                )
    for name in rules.alerts:
        if name not in fires:
            problems.append(f"{name}: no test case in which it fires")
        if name not in silent:
            problems.append(f"{name}: no test case in which it is expected silent")
    problems.extend(
        f"{name}: no promql_expr_test evaluates it"
        for name in rules.records
        if name not in tested_records
    )
    assert not problems, "\n".join(problems)


def test_a_cpu_only_node_is_expected_to_fire_no_alert() -> None:
    """cpu_node.yml feeds a CPU-only node's real series (no NVIDIA driver): every alert of
    rules.yml, those added later included, is expected silent there."""
    suite = _load_yaml(RULE_TESTS / "cpu_node.yml")
    checks = [check for case in suite["tests"] for check in case.get("alert_rule_test", [])]
    assert [check["alertname"] for check in checks if check.get("exp_alerts")] == []
    unchecked = set(_rules().alerts) - {check["alertname"] for check in checks}
    assert not unchecked, f"cpu_node.yml does not expect {sorted(unchecked)} silent"


def test_rules_read_catalogued_metrics_only() -> None:
    rules = _rules()
    catalogue = _catalogue()
    known = {**catalogue, **BUILTIN_SERIES}
    problems: list[str] = []
    for rule, expr in rules.expressions:
        # Label values (reasons, outcomes, ...) are strings; metric names never are.
        code = STRING.sub('""', expr)
        for token in IDENTIFIER.findall(code):
            if ":" in token:
                if token not in rules.records:
                    problems.append(f"{rule}: {token} is no recording rule of rules.yml")
            elif token.startswith("sustain_") and token not in catalogue:
                problems.append(f"{rule}: {token} is not in docs/metrics.md")
        # Any name followed by a selector or a range is a series: catalogued, built in or recorded.
        for match in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*[{\[]", code):
            name = match.group(1)
            if name not in known and name not in rules.records:
                problems.append(f"{rule}: reads {name}, which is neither catalogued nor recorded")
        # Label matchers on catalogued families name labels the family has.
        for match in SELECTOR.finditer(code):
            name, matchers = match.groups()
            if name not in known:
                continue
            for label in MATCHER.findall(matchers):
                if label not in known[name] | TARGET_LABELS:
                    problems.append(f"{rule}: {name} has no label {label} in docs/metrics.md")
    assert not problems, "\n".join(problems)


def test_alerts_have_severity_annotations_and_a_runbook_section() -> None:
    rules = _rules()
    anchors = _runbook_anchors()
    problems: list[str] = []
    for name, rule in rules.alerts.items():
        severity = (rule.get("labels") or {}).get("severity")
        if severity not in SEVERITIES:
            problems.append(f"{name}: severity {severity!r}, not one of {sorted(SEVERITIES)}")
        annotations = rule.get("annotations") or {}
        problems.extend(
            f"{name}: no {key} annotation" for key in ANNOTATIONS if not annotations.get(key)
        )
        url = annotations.get("runbook_url", "")
        match = RUNBOOK_URL.search(url)
        if match is None:
            problems.append(f"{name}: runbook_url {url!r} does not point to docs/alerts.md#...")
        elif match.group(1) != name.lower():
            problems.append(f"{name}: runbook_url anchor {match.group(1)} is not {name.lower()}")
        elif match.group(1) not in anchors:
            problems.append(f"{name}: docs/alerts.md has no section #{match.group(1)}")
    assert not problems, "\n".join(problems)


def test_runbook_documents_every_recording_rule_and_the_scrape_job() -> None:
    text = RUNBOOK.read_text(encoding="utf-8")
    missing = [name for name in _rules().records if f"`{name}`" not in text]
    assert not missing, f"docs/alerts.md does not list the recording rules {missing}"
    assert "job_name: sustain" in text, "docs/alerts.md does not show the scrape job `sustain`"
