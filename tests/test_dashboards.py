"""The Grafana dashboards (grafana/dashboards/*.json) and their provisioning files.

Grafana itself is not run here. What is checked: the committed JSON is what grafana/build.py
writes; every dashboard parses, has a uid, a title and its template variables; every panel and
query takes its datasource from the ``datasource`` variable; every panel that shows data has a
query; every metric a query names is in docs/metrics.md (or is a recording rule of
deploy/prometheus/rules.yml) with the labels the catalogue gives it; and every expression is valid
PromQL by the real promtool. grafana/queries.py (``dashboard_queries()``) is what an end-to-end
test uses to run every query against a real Prometheus.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

Json = dict[str, Any]

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
PROVISIONING = GRAFANA / "provisioning"
CATALOGUE = ROOT / "docs" / "metrics.md"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39
GRID_WIDTH = 24
PANEL_TYPES = {"timeseries", "stat", "table", "state-timeline", "bargauge", "text", "row"}
NO_QUERY_PANELS = {"text", "row"}
TARGET_LABELS = {"instance", "job"}  # added by Prometheus to every scraped series
BUILT_INS = {"__rate_interval", "__interval", "__range"}

FILES = {
    "node.json": "sustain / Node",
    "probes.json": "sustain / Probes",
    "fleet.json": "sustain / Fleet",
    "stack-and-drift.json": "sustain / Stack and drift",
}
PROBE_VARIABLES = {
    "instance": "label_values(sustain_build_info, instance)",
    "device": 'label_values(sustain_probe_runs_total{instance=~"$instance"}, device)',
    "workload": 'label_values(sustain_probe_runs_total{instance=~"$instance"}, workload)',
    "precision": 'label_values(sustain_probe_runs_total{instance=~"$instance"}, precision)',
}
VARIABLES = {
    "node.json": {
        "instance": "label_values(sustain_build_info, instance)",
        "model": "label_values(sustain_gpu_info, name)",
        "device": 'label_values(sustain_gpu_info{instance=~"$instance", name=~"$model"}, device)',
    },
    "probes.json": PROBE_VARIABLES,
    "fleet.json": {
        "job": "label_values(sustain_build_info, job)",
        "model": 'label_values(sustain_gpu_info{job=~"$job"}, name)',
        "workload": 'label_values(sustain_probe_runs_total{job=~"$job"}, workload)',
        "precision": 'label_values(sustain_probe_runs_total{job=~"$job"}, precision)',
    },
    "stack-and-drift.json": PROBE_VARIABLES,
}
# What each dashboard is for (issue 7): the families it must show.
REQUIRED_METRICS = {
    "node.json": {
        "sustain_gpu_clock_max_hertz",
        "sustain_gpu_power_limit_watts",
        "sustain_gpu_temperature_threshold_celsius",
        "sustain_gpu_clock_event_reason_active_window_max",
        "sustain_gpu_utilization_window_mean_ratio",
        "sustain_probe_flops",
        "sustain_probe_bytes_per_second",
        "sustain_probe_tokens_per_second",
        "sustain_gpu_memory_used_bytes",
        "sustain_gpu_memory_total_bytes",
        "sustain_gpu_pcie_link_generation",
        "sustain_gpu_pcie_link_generation_max",
        "sustain_gpu_pcie_link_width",
        "sustain_gpu_pcie_link_width_max",
        "sustain_gpu_xid_errors_total",
        "sustain_gpu_healthy",
        "sustain_cpu_utilization_window_mean_ratio",
        "sustain_memory_used_bytes",
    },
    "probes.json": {
        "sustain_probe_flops",
        "sustain_probe_bytes_per_second",
        "sustain_probe_tokens_per_second",
        "sustain_probe_sustained_ratio",
        "sustain_probe_warmup_seconds",
        "sustain_probe_classification",
        "sustain_probe_slowdown_cause",
        "sustain_probe_flop_per_joule",
        "sustain_probe_bytes_per_joule",
        "sustain_probe_tokens_per_joule",
        "sustain_probe_latency_seconds",
        "sustain_probe_runs_total",
        "sustain_probe_duty_cycle_ratio",
    },
    "fleet.json": {
        "sustain_probe_flops",
        "sustain_probe_bytes_per_second",
        "sustain_probe_tokens_per_second",
        "sustain_gpu_info",
        "sustain_drift_fleet_ratio",
        "sustain_drift_fleet_outlier",
        "sustain_gpu_clock_event_reason_seconds_total",
        "sustain_stack_info",
    },
    "stack-and-drift.json": {
        "sustain_stack_changes_total",
        "sustain_probe_flops",
        "sustain_probe_bytes_per_second",
        "sustain_probe_tokens_per_second",
        "sustain_drift_last_change_ratio",
        "sustain_drift_last_change_timestamp_seconds",
        "sustain_stack_info",
        "sustain_drift_runs_total",
        "sustain_drift_last_run_timestamp_seconds",
    },
}

METRIC_NAME = re.compile(r"sustain_[a-z0-9_]+")
# A whole metric name: recording rules are named level:metric:operations (colons).
METRIC_TOKEN = re.compile(r"(?<![\w:])[a-zA-Z_:][a-zA-Z0-9_:]*")
QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
SELECTOR = re.compile(r"(?<![\w:])(?P<metric>[a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{(?P<matchers>[^}]*)\}")
MATCHER = re.compile(r'(?P<label>\w+)\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"')
GROUPING = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\((?P<labels>[^)]*)\)"
)
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
REGEX_MATCHER = re.compile(r'=~\s*"(?:[^"\\]|\\.)*"')
DURATION_VARIABLE = re.compile(r"\[\$(?:__rate_interval|__interval|__range)\]")


# --- helpers ----------------------------------------------------------------------------------


def _load_module(name: str) -> ModuleType:
    """grafana/<name>.py, loaded by path (grafana/ is not a package)."""
    path = GRAFANA / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"sustain_grafana_{name}", path)
    assert spec is not None, f"cannot load {path}"
    assert spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@functools.cache
def build_module() -> ModuleType:
    return _load_module("build")


@functools.cache
def queries_module() -> ModuleType:
    return _load_module("queries")


def dashboard_queries() -> list[tuple[str, str, str]]:
    """grafana/queries.py's dashboard_queries(): (dashboard, title, expr, variables replaced)."""
    found: list[tuple[str, str, str]] = queries_module().dashboard_queries()
    return found


def raw_queries() -> list[tuple[str, str, str]]:
    found: list[tuple[str, str, str]] = queries_module().raw_queries()
    return found


@functools.cache
def dashboards() -> dict[str, Json]:
    return {name: json.loads((DASHBOARDS / name).read_text(encoding="utf-8")) for name in FILES}


def panels(dashboard: Json) -> list[Json]:
    found: list[Json] = list(queries_module().panels(dashboard))
    return found


def variables(dashboard: Json) -> list[Json]:
    found: list[Json] = dashboard["templating"]["list"]
    return found


def own_annotations(dashboard: Json) -> list[Json]:
    """The dashboard's own annotation queries (Grafana's built-in one left out)."""
    return [item for item in dashboard["annotations"]["list"] if not item.get("builtIn")]


def annotation_expr(item: Json) -> str:
    expr: str = queries_module().annotation_expr(item)
    return expr


def references(text: str) -> list[str]:
    found: list[str] = queries_module().variable_references(text)
    return found


def exprs(dashboard: Json) -> list[tuple[str, str]]:
    """(where, expr) for every PromQL expression of a dashboard, variables left in."""
    found = []
    for variable in variables(dashboard):
        if variable["type"] == "query":
            selector = queries_module().variable_selector(variable)
            assert selector is not None, f"variable {variable['name']}: not label_values()"
            found.append((f"variable {variable['name']}", str(selector)))
    found += [(f"annotation {a['name']}", annotation_expr(a)) for a in own_annotations(dashboard)]
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            found.append((f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]))
    return found


@functools.cache
def catalogue() -> dict[str, frozenset[str]]:
    """Metric family -> its labels, from the tables of docs/metrics.md."""
    families: dict[str, frozenset[str]] = {}
    columns: list[str] = []
    for line in CATALOGUE.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            columns = []
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == "name":
            columns = cells
            continue
        match = re.fullmatch(r"`([a-zA-Z_:][a-zA-Z0-9_:]*)`", cells[0])
        if match and columns:
            labels = cells[columns.index("labels")] if "labels" in columns else ""
            families[match[1]] = frozenset(
                label.strip() for label in labels.split(",") if label.strip()
            )
    assert len(families) > 50, f"parsed only {len(families)} families from {CATALOGUE}"
    return families


@functools.cache
def recording_rules() -> frozenset[str]:
    """Names recorded by deploy/prometheus/rules.yml, if that file exists."""
    if not RULES.exists():
        return frozenset()
    text = RULES.read_text(encoding="utf-8")
    return frozenset(
        re.findall(r"""^\s*(?:-\s*)?record:\s*["']?([a-zA-Z_:][a-zA-Z0-9_:]*)""", text, re.M)
    )


def metric_names(expr: str) -> set[str]:
    """The metric names an expression uses: each whole name in which ``sustain_[a-z0-9_]+``
    occurs (a catalogue family, or a recording rule such as ``model:sustain_x:median``), label
    values left out."""
    return {
        token for token in METRIC_TOKEN.findall(QUOTED.sub('""', expr)) if METRIC_NAME.search(token)
    }


# label_replace(VECTOR, "DST", ...): a label the expression adds (the per-unit throughput
# families get their unit as a label this way, grafana/panels.py throughput()).
LABEL_REPLACE = re.compile(r'label_replace\([^()]*?,\s*"(\w+)"\s*,')


def known_labels(expr: str) -> set[str]:
    """Every label the series an expression selects can carry (recording rules: any), and
    those its label_replace calls add."""
    labels = set(TARGET_LABELS) | set(LABEL_REPLACE.findall(expr))
    for name in metric_names(expr):
        labels |= catalogue().get(name, frozenset())
    return labels


def uses_recording_rule(expr: str) -> bool:
    return any(name in recording_rules() for name in metric_names(expr))


def promtool() -> str:
    found = shutil.which("promtool") or (
        "/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None
    )
    if found is None:
        pytest.fail(
            "promtool is not installed: it validates every dashboard query as PromQL. Install "
            "Prometheus' promtool (Debian/Ubuntu: apt-get install prometheus; or the "
            "prometheus-*.tar.gz release) so that `promtool` is on PATH."
        )
    return found


def check_rules(tmp_path: Path, named: list[tuple[str, str]]) -> subprocess.CompletedProcess[str]:
    """Run `promtool check rules` on one recording rule per (name, expr), one group each (so
    that an error names its group: the dashboard and panel)."""
    groups = [
        {"name": name, "rules": [{"record": f"dashboard_query_{i}", "expr": expr}]}
        for i, (name, expr) in enumerate(named)
    ]
    path = tmp_path / "dashboard-queries.rules.yml"
    # JSON is YAML: no quoting rules to get wrong.
    path.write_text(json.dumps({"groups": groups}, indent=1), encoding="utf-8")
    return subprocess.run(
        [promtool(), "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def yaml_pairs(path: Path) -> dict[str, list[str]]:
    """key -> values of the ``key: value`` lines of a simple YAML file (no YAML library in the
    development dependencies)."""
    pairs: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = re.match(r"^\s*(?:-\s+)?([A-Za-z_]\w*):\s*(.*?)\s*$", line.split(" #")[0])
        if match and not line.lstrip().startswith("#"):
            pairs.setdefault(match[1], []).append(match[2].strip("\"'"))
    return pairs


# --- the files --------------------------------------------------------------------------------


def test_committed_json_is_what_build_py_writes() -> None:
    rendered: dict[str, str] = build_module().render()
    assert sorted(rendered) == sorted(FILES)
    assert sorted(path.name for path in DASHBOARDS.iterdir()) == sorted(FILES), (
        "grafana/dashboards holds files grafana/build.py does not write"
    )
    stale = [
        name
        for name, content in rendered.items()
        if (DASHBOARDS / name).read_text(encoding="utf-8") != content
    ]
    assert not stale, f"out of date: {stale}; run `python grafana/build.py` and commit the JSON"


@pytest.mark.parametrize("name", sorted(FILES))
def test_dashboard_parses_with_uid_and_title(name: str) -> None:
    dashboard = json.loads((DASHBOARDS / name).read_text(encoding="utf-8"))
    assert isinstance(dashboard, dict)
    assert dashboard["title"] == FILES[name]
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", dashboard["uid"]), dashboard["uid"]
    assert dashboard["schemaVersion"] == SCHEMA_VERSION
    assert dashboard["id"] is None, "an id would clash on import; Grafana assigns it"
    assert "sustain" in dashboard["tags"]
    assert dashboard["panels"], "no panels"


def test_uids_and_titles_are_unique() -> None:
    boards = dashboards().values()
    assert len({board["uid"] for board in boards}) == len(FILES)
    assert len({board["title"] for board in boards}) == len(FILES)


# --- variables --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FILES))
def test_template_variables(name: str) -> None:
    declared = variables(dashboards()[name])
    by_name = {variable["name"]: variable for variable in declared}
    assert len(by_name) == len(declared), "a variable is declared twice"

    source = declared[0]
    assert source["name"] == "datasource", "the datasource variable comes first"
    assert source["type"] == "datasource"
    assert source["query"] == "prometheus"

    for variable_name, definition in VARIABLES[name].items():
        assert variable_name in by_name, f"missing variable {variable_name}"
        variable = by_name[variable_name]
        assert variable["type"] == "query"
        assert variable["datasource"] == DATASOURCE
        assert variable["definition"] == definition
        query = variable["query"]
        assert (query["query"] if isinstance(query, dict) else query) == definition
    assert set(by_name) == {"datasource", *VARIABLES[name]}

    # A variable's query may only use variables declared before it (Grafana resolves in order).
    seen: set[str] = set()
    for variable in declared:
        used = set(references(json.dumps(variable.get("query", ""))))
        assert used <= seen, f"variable {variable['name']} uses {used - seen} before they exist"
        seen.add(variable["name"])


@pytest.mark.parametrize("name", sorted(FILES))
def test_variables_used_are_declared_and_declared_are_used(name: str) -> None:
    dashboard = dashboards()[name]
    declared = {variable["name"] for variable in variables(dashboard)}
    texts = [expr for _, expr in exprs(dashboard)]
    texts += [str(panel.get("title", "")) for panel in panels(dashboard)]
    texts += [f"${panel['repeat']}" for panel in panels(dashboard) if panel.get("repeat")]
    texts += [json.dumps(panel.get("datasource", "")) for panel in panels(dashboard)]
    used = {ref for text in texts for ref in references(text)}
    assert used - declared - BUILT_INS == set(), "undeclared variables"
    assert declared - used - {"datasource"} == set(), "declared but never used"


@pytest.mark.parametrize("name", sorted(FILES))
def test_template_variables_only_in_regex_matchers(name: str) -> None:
    """Multi-value and "All" expand to a regex: a variable belongs in an ``=~`` matcher, and a
    built-in interval in a range ``[...]``."""
    for where, expr in exprs(dashboards()[name]):
        rest = DURATION_VARIABLE.sub("[1m]", REGEX_MATCHER.sub('=~""', expr))
        assert "$" not in rest, f"{name} {where}: {expr}"
        assert "[[" not in rest, f"{name} {where}: {expr}"


# --- panels -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FILES))
def test_datasource_by_variable_everywhere(name: str) -> None:
    dashboard = dashboards()[name]
    for panel in panels(dashboard):
        title = panel.get("title")
        if panel["type"] in NO_QUERY_PANELS:
            assert panel.get("datasource", DATASOURCE) == DATASOURCE, title
            assert not panel.get("targets"), f"{title}: a {panel['type']} panel with queries"
            continue
        assert panel.get("datasource") == DATASOURCE, title
        for target in panel["targets"]:
            assert target.get("datasource") == DATASOURCE, f"{title} {target.get('refId')}"
    for item in own_annotations(dashboard):
        assert item["datasource"] == DATASOURCE, item["name"]


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_data_panel_has_a_query(name: str) -> None:
    dashboard = dashboards()[name]
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    titles = [panel["title"] for panel in panels(dashboard) if panel["type"] != "row"]
    assert all(titles), "a panel without a title"
    assert len(titles) == len(set(titles)), "panel titles repeat"
    for panel in panels(dashboard):
        assert panel["type"] in PANEL_TYPES, f"{panel['title']}: type {panel['type']}"
        if panel["type"] in NO_QUERY_PANELS:
            continue
        targets = panel.get("targets", [])
        assert any(str(target.get("expr", "")).strip() for target in targets), panel["title"]
        ref_ids = [target["refId"] for target in targets]
        assert len(ref_ids) == len(set(ref_ids)), f"{panel['title']}: refIds repeat"


@pytest.mark.parametrize("name", sorted(FILES))
def test_layout_fits_the_grid_without_overlaps(name: str) -> None:
    boxes = []
    for panel in panels(dashboards()[name]):
        grid = panel["gridPos"]
        assert min(grid["x"], grid["y"]) >= 0, panel["title"]
        assert min(grid["w"], grid["h"]) >= 1, panel["title"]
        assert grid["x"] + grid["w"] <= GRID_WIDTH, panel["title"]
        boxes.append((panel["title"], grid))
    for i, (title, a) in enumerate(boxes):
        for other, b in boxes[i + 1 :]:
            apart = (
                a["x"] + a["w"] <= b["x"]
                or b["x"] + b["w"] <= a["x"]
                or a["y"] + a["h"] <= b["y"]
                or b["y"] + b["h"] <= a["y"]
            )
            assert apart, f"{title!r} overlaps {other!r}"


@pytest.mark.parametrize("name", sorted(FILES))
def test_annotations_are_prometheus_queries_on_existing_panels(name: str) -> None:
    dashboard = dashboards()[name]
    ids = {panel["id"] for panel in panels(dashboard)}
    for item in own_annotations(dashboard):
        assert annotation_expr(item).strip(), item["name"]
        assert item["target"]["expr"] == item["expr"], "two different expressions"
        assert set(item["filter"]["ids"]) <= ids, f"{item['name']}: filter names no panel"
        assert item["filter"]["ids"], f"{item['name']}: shown on no panel"


# --- metrics, labels, PromQL ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FILES))
def test_metric_names_are_in_the_catalogue(name: str) -> None:
    allowed = set(catalogue()) | recording_rules()
    unknown = {
        (where, metric)
        for where, expr in exprs(dashboards()[name])
        for metric in metric_names(expr)
        if metric not in allowed
    }
    assert not unknown, (
        f"metrics neither in {CATALOGUE.relative_to(ROOT)} nor recorded by "
        f"{RULES.relative_to(ROOT)}: {sorted(unknown)}"
    )
    for where, expr in exprs(dashboards()[name]):
        for selector in SELECTOR.finditer(expr):
            metric = selector["metric"]
            assert metric == "up" or metric in allowed, f"{where}: selects {metric}"


@pytest.mark.parametrize("name", sorted(FILES))
def test_labels_are_the_catalogues(name: str) -> None:
    """Matchers use labels the selected family has; by/on/without/group_left use labels one of
    the expression's families has (or Prometheus' instance and job)."""
    dashboard = dashboards()[name]
    for where, expr in exprs(dashboard):
        for selector in SELECTOR.finditer(expr):
            metric = selector["metric"]
            if metric in recording_rules():
                continue
            allowed = TARGET_LABELS | catalogue().get(metric, frozenset())
            for matcher in MATCHER.finditer(selector["matchers"]):
                assert matcher["label"] in allowed, f"{where}: {metric} has no {matcher['label']}"
        if uses_recording_rule(expr):
            continue
        known = known_labels(expr)
        for grouping in GROUPING.finditer(expr):
            labels = {label.strip() for label in grouping["labels"].split(",") if label.strip()}
            assert labels <= known, f"{where}: no such labels {labels - known} in {expr}"


@pytest.mark.parametrize("name", sorted(FILES))
def test_legends_tables_and_annotations_use_known_labels(name: str) -> None:
    dashboard = dashboards()[name]
    for panel in panels(dashboard):
        targets = panel.get("targets", [])
        known = set().union(*(known_labels(t["expr"]) for t in targets)) if targets else set()
        if any(uses_recording_rule(t["expr"]) for t in targets):
            continue
        for target in targets:
            legend = set(LEGEND_LABEL.findall(target.get("legendFormat", "")))
            assert legend <= known, f"{panel['title']}: legend uses {legend - known}"
        for transformation in panel.get("transformations", []):
            if transformation["id"] != "organize":
                continue
            shown = set(transformation["options"]["renameByName"])
            shown = {field for field in shown if not field.startswith("Value")}
            assert shown <= known, f"{panel['title']}: table shows unknown {shown - known}"
    for item in own_annotations(dashboard):
        known = known_labels(annotation_expr(item))
        used = set(LEGEND_LABEL.findall(item["titleFormat"] + item["textFormat"]))
        used |= {key for key in item["tagKeys"].split(",") if key}
        assert used <= known, f"annotation {item['name']}: {used - known}"
    for variable in variables(dashboard):
        if variable["type"] != "query":
            continue
        match = re.search(r",\s*(\w+)\s*\)\s*$", variable["definition"])
        assert match, variable["definition"]
        assert match[1] in known_labels(variable["definition"]), variable["definition"]


def test_every_expression_is_valid_promql(tmp_path: Path) -> None:
    named = [
        (f"{stem} / {title} / {i}", expr)
        for i, (stem, title, expr) in enumerate(dashboard_queries())
    ]
    assert len(named) > 50
    result = check_rules(tmp_path, named)
    assert result.returncode == 0, (
        f"promtool check rules failed (each group is `dashboard / panel / index`):\n"
        f"{result.stdout}\n{result.stderr}"
    )
    assert f"SUCCESS: {len(named)} rules found" in result.stdout, result.stdout


def test_promtool_rejects_a_broken_expression(tmp_path: Path) -> None:
    """The check above is not vacuous: a syntax error in one expression fails it."""
    result = check_rules(
        tmp_path,
        [("fine", "sum(up)"), ("broken", 'rate(sustain_probe_runs_total{device=~".*"}[1m]')],
    )
    assert result.returncode != 0
    assert "broken" in result.stdout + result.stderr


# --- what each dashboard shows ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FILES))
def test_dashboard_shows_what_it_is_for(name: str) -> None:
    used = {metric for _, expr in exprs(dashboards()[name]) for metric in metric_names(expr)}
    assert REQUIRED_METRICS[name] <= used, f"missing {REQUIRED_METRICS[name] - used}"


def test_node_dashboard_specifics() -> None:
    dashboard = dashboards()["node.json"]
    notes = [panel for panel in panels(dashboard) if panel["type"] == "text"]
    assert any(
        "utilization is not performance" in panel["options"]["content"].lower() for panel in notes
    )
    timelines = [panel for panel in panels(dashboard) if panel["type"] == "state-timeline"]
    assert any(
        "sustain_gpu_clock_event_reason_active" in target["expr"]
        and "{{reason}}" in target["legendFormat"]
        for panel in timelines
        for target in panel["targets"]
    ), "no per-reason throttle timeline"
    all_exprs = " ".join(expr for _, expr in exprs(dashboard))
    for needed in ('clock="sm"', 'clock="memory"', 'threshold="slowdown"', 'stat="steady"'):
        assert needed in all_exprs, needed


def test_probes_dashboard_specifics() -> None:
    all_exprs = [expr for _, expr in exprs(dashboards()["probes.json"])]
    assert any(
        'sustain_probe_latency_seconds{workload="inference", quantile=~"0.5|0.9|0.99"' in expr
        for expr in all_exprs
    )
    assert any('stat="peak"' in expr for expr in all_exprs)
    assert any('stat="steady"' in expr for expr in all_exprs)
    assert any("rate(sustain_probe_runs_total" in expr for expr in all_exprs)


def test_fleet_dashboard_specifics() -> None:
    all_exprs = [expr for _, expr in exprs(dashboards()["fleet.json"])]
    assert any(
        "sustain_probe_flops" in expr
        and "on (instance, uuid) group_left (name) sustain_gpu_info" in expr
        for expr in all_exprs
    ), "no capacity view joining steady throughput with the GPU model"
    assert any(
        "count by (driver_version, torch_version, cuda_driver_version) (sustain_stack_info" in expr
        for expr in all_exprs
    )
    assert any(expr.startswith("topk(") for expr in all_exprs), "no throttling hot spots"
    assert any(re.search(r"\bup\{", expr) for expr in all_exprs), "no agents up"


def test_stack_and_drift_dashboard_specifics() -> None:
    dashboard = dashboards()["stack-and-drift.json"]
    stack_annotations = [
        item
        for item in own_annotations(dashboard)
        if "sustain_stack_changes_total" in annotation_expr(item)
    ]
    assert stack_annotations, "stack changes are not annotations"
    throughput_panels = {
        panel["id"]
        for panel in panels(dashboard)
        if any("sustain_probe_flops" in t["expr"] for t in panel.get("targets", []))
    }
    assert throughput_panels <= set(stack_annotations[0]["filter"]["ids"])
    tables = [panel for panel in panels(dashboard) if panel["type"] == "table"]
    table_exprs = " ".join(t["expr"] for panel in tables for t in panel["targets"])
    assert "sustain_drift_last_change_ratio" in table_exprs
    assert "sustain_drift_last_change_timestamp_seconds" in table_exprs
    assert "sustain_stack_info" in table_exprs


# --- grafana/queries.py -----------------------------------------------------------------------


def test_dashboard_queries_cover_every_query_with_variables_replaced() -> None:
    found = dashboard_queries()
    assert all(isinstance(item, tuple) and len(item) == 3 for item in found)
    assert all(all(isinstance(part, str) and part for part in item) for item in found)
    expected = sum(len(exprs(dashboard)) for dashboard in dashboards().values())
    assert len(found) == expected
    for stem, title, expr in found:
        assert f"{stem}.json" in FILES
        assert "$" not in expr, f"{stem} {title}: {expr}"
        assert "[[" not in expr, f"{stem} {title}: {expr}"
    titles = {(stem, title) for stem, title, _ in found}
    for name, dashboard in dashboards().items():
        for panel in panels(dashboard):
            if panel.get("targets"):
                assert (name.removesuffix(".json"), panel["title"]) in titles
    # The raw ones are the same queries, variables left in.
    assert [(s, t) for s, t, _ in raw_queries()] == [(s, t) for s, t, _ in found]


def test_substitute_replaces_variables_and_intervals() -> None:
    substitute = queries_module().substitute
    expr = 'rate(x{a=~"$instance", b=~"${device}", c=~"[[model]]"}[$__rate_interval])'
    assert substitute(expr) == 'rate(x{a=~".*", b=~".*", c=~".*"}[1m])'
    assert substitute("max_over_time(x[$__range])") == "max_over_time(x[1h])"
    with pytest.raises(ValueError, match="__unknown"):
        substitute("x[$__unknown]")


# --- provisioning and documentation -----------------------------------------------------------


def test_provisioned_datasource() -> None:
    pairs = yaml_pairs(PROVISIONING / "datasources" / "prometheus.yaml")
    assert pairs["apiVersion"] == ["1"]
    assert pairs["type"] == ["prometheus"]
    assert pairs["uid"] == ["prometheus"]
    assert pairs["url"] == ["http://prometheus:9090"]
    for dashboard in dashboards().values():
        source = variables(dashboard)[0]
        assert source["current"]["value"] == "prometheus", "default is not the provisioned uid"


def test_provisioned_dashboards() -> None:
    pairs = yaml_pairs(PROVISIONING / "dashboards" / "sustain.yaml")
    assert pairs["apiVersion"] == ["1"]
    assert pairs["type"] == ["file"]
    assert pairs["folder"] == ["sustain"]
    assert pairs["path"] == ["/var/lib/grafana/dashboards/sustain"]


def test_readme_names_every_dashboard() -> None:
    readme = (GRAFANA / "README.md").read_text(encoding="utf-8")
    for name, title in FILES.items():
        assert name in readme, name
        assert title in readme, title
