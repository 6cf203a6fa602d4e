"""The house defaults of the sustain dashboards: every board module builds from these.

One place for what must not differ between boards: the datasource reference, template variables,
target and field defaults, legends, the grid layout, the dashboard links and the probe selectors.
A change here changes every dashboard; grafana/build.py writes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Json = dict[str, Any]

SCHEMA_VERSION = 39
GRID_WIDTH = 24
DATASOURCE: Json = {"type": "prometheus", "uid": "${datasource}"}
# The uid grafana/provisioning/datasources/prometheus.yaml gives its datasource: the default choice.
PROVISIONED_DATASOURCE_UID = "prometheus"
TAG = "sustain"


# --- queries and panels ---------------------------------------------------------------------


@dataclass(frozen=True)
class Q:
    """One PromQL target: a range query for graphs, ``instant`` for tables, stats and gauges."""

    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False


def _targets(queries: Sequence[Q]) -> list[Json]:
    targets = []
    for index, query in enumerate(queries):
        target: Json = {
            "datasource": dict(DATASOURCE),
            "editorMode": "code",
            "expr": query.expr,
            "instant": query.instant,
            "legendFormat": query.legend or "__auto",
            "range": not query.instant,
            "refId": chr(ord("A") + index),
        }
        if query.table:
            target["format"] = "table"
        targets.append(target)
    return targets


def thresholds(*steps: tuple[float | None, str]) -> Json:
    """Absolute thresholds; the first step's value is None (the base colour)."""
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


def value_map(entries: dict[str, tuple[str, str]]) -> list[Json]:
    """Value -> (text, colour) mappings."""
    return [
        {
            "type": "value",
            "options": {
                value: {"color": color, "index": index, "text": text}
                for index, (value, (text, color)) in enumerate(entries.items())
            },
        }
    ]


def reference_line(ref_id: str, color: str = "red") -> Json:
    """Override: the series of query ``ref_id`` is a limit, drawn dashed in one colour."""
    return {
        "matcher": {"id": "byFrameRefID", "options": ref_id},
        "properties": [
            {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
            {"id": "color", "value": {"fixedColor": color, "mode": "fixed"}},
            {"id": "custom.fillOpacity", "value": 0},
        ],
    }


def by_name(name: str, *properties: tuple[str, Any]) -> Json:
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [{"id": key, "value": value} for key, value in properties],
    }


def by_ref(ref_id: str, *properties: tuple[str, Any]) -> Json:
    return {
        "matcher": {"id": "byFrameRefID", "options": ref_id},
        "properties": [{"id": key, "value": value} for key, value in properties],
    }


def _field_defaults(
    unit: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    decimals: int | None = None,
    steps: Json | None = None,
    mappings: list[Json] | None = None,
    color: Json | None = None,
    custom: Json | None = None,
) -> Json:
    defaults: Json = {
        "color": color or {"mode": "palette-classic"},
        "mappings": mappings or [],
        "thresholds": steps or thresholds((None, "green")),
        "unit": unit,
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    if decimals is not None:
        defaults["decimals"] = decimals
    if custom is not None:
        defaults["custom"] = custom
    return defaults


def _panel(
    kind: str,
    title: str,
    description: str,
    queries: Sequence[Q],
    *,
    defaults: Json,
    options: Json,
    overrides: Iterable[Json] = (),
    transformations: Iterable[Json] = (),
) -> Json:
    panel: Json = {
        "datasource": dict(DATASOURCE),
        "description": description,
        "fieldConfig": {"defaults": defaults, "overrides": list(overrides)},
        "options": options,
        "targets": _targets(queries),
        "title": title,
        "type": kind,
    }
    transformations = list(transformations)
    if transformations:
        panel["transformations"] = transformations
    return panel


LEGEND = {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True}
TABLE_LEGEND = {
    "calcs": ["lastNotNull", "min", "max"],
    "displayMode": "table",
    "placement": "bottom",
    "showLegend": True,
}
HIDDEN_FIELDS = ("Time", "__name__", "job", "instance", "uuid", "Value")
REDUCE_LAST = {"calcs": ["lastNotNull"], "fields": "", "values": False}


def timeseries(
    title: str,
    description: str,
    queries: Sequence[Q],
    *,
    unit: str,
    minimum: float | None = None,
    maximum: float | None = None,
    steps_after: bool = False,
    points: bool = False,
    bars: bool = False,
    stacked: bool = False,
    table_legend: bool = False,
    overrides: Iterable[Json] = (),
) -> Json:
    """Lines over time; ``steps_after`` for per-run values (they hold until the next run)."""
    custom = {
        "axisPlacement": "auto",
        "drawStyle": "bars" if bars else "line",
        "fillOpacity": 60 if bars else 0,
        "gradientMode": "none",
        "lineInterpolation": "stepAfter" if steps_after else "linear",
        "lineWidth": 1,
        "pointSize": 5,
        "showPoints": "always" if points else "never",
        "spanNulls": False,
        "stacking": {"group": "A", "mode": "normal" if stacked else "none"},
        "thresholdsStyle": {"mode": "off"},
    }
    return _panel(
        "timeseries",
        title,
        description,
        queries,
        defaults=_field_defaults(unit, minimum=minimum, maximum=maximum, custom=custom),
        options={
            "legend": TABLE_LEGEND if table_legend else LEGEND,
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        overrides=overrides,
    )


def stat(
    title: str,
    description: str,
    queries: Sequence[Q],
    *,
    unit: str = "none",
    steps: Json | None = None,
    mappings: list[Json] | None = None,
    text_mode: str = "auto",
    color_mode: str = "value",
    decimals: int | None = None,
) -> Json:
    """The latest value of each series, one box each."""
    return _panel(
        "stat",
        title,
        description,
        queries,
        defaults=_field_defaults(
            unit,
            steps=steps,
            mappings=mappings,
            decimals=decimals,
            color={"mode": "thresholds"},
        ),
        options={
            "colorMode": color_mode,
            "graphMode": "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": REDUCE_LAST,
            "showPercentChange": False,
            "textMode": text_mode,
            "wideLayout": True,
        },
    )


def bargauge(
    title: str,
    description: str,
    queries: Sequence[Q],
    *,
    unit: str,
    minimum: float | None = None,
    maximum: float | None = None,
    steps: Json | None = None,
) -> Json:
    """One horizontal bar per series (instant queries)."""
    return _panel(
        "bargauge",
        title,
        description,
        queries,
        defaults=_field_defaults(
            unit, minimum=minimum, maximum=maximum, steps=steps, color={"mode": "thresholds"}
        ),
        options={
            "displayMode": "gradient",
            "maxVizHeight": 300,
            "minVizHeight": 16,
            "minVizWidth": 8,
            "namePlacement": "auto",
            "orientation": "horizontal",
            "reduceOptions": REDUCE_LAST,
            "showUnfilled": True,
            "sizing": "auto",
            "valueMode": "color",
        },
    )


def state_timeline(
    title: str,
    description: str,
    queries: Sequence[Q],
    *,
    mappings: list[Json],
    overrides: Iterable[Json] = (),
) -> Json:
    """One band per series, coloured by the mapped state."""
    return _panel(
        "state-timeline",
        title,
        description,
        queries,
        defaults=_field_defaults(
            "none",
            mappings=mappings,
            color={"mode": "thresholds"},
            custom={
                "fillOpacity": 80,
                "hideFrom": {"legend": False, "tooltip": False, "viz": False},
                "lineWidth": 0,
            },
        ),
        options={
            "alignValue": "left",
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False},
            "mergeValues": True,
            "rowHeight": 0.9,
            "showValue": "never",
            "tooltip": {"mode": "single", "sort": "none"},
        },
        overrides=overrides,
    )


def table(
    title: str,
    description: str,
    queries: Sequence[Q],
    *,
    columns: dict[str, str],
    unit: str = "none",
    overrides: Iterable[Json] = (),
    sort_by: str | None = None,
    descending: bool = True,
    decimals: int | None = None,
) -> Json:
    """Instant queries as one table.

    ``columns`` maps the fields to show, in order, to their header: labels by name, the value of
    query X as ``Value #X`` (``Value`` when there is one query). Several queries are merged on
    their labels, so give them the same label set (aggregate ``by`` the same labels).
    """
    queries = [Q(q.expr, q.legend, instant=True, table=True) for q in queries]
    transformations: list[Json] = []
    if len(queries) > 1:
        transformations.append({"id": "merge", "options": {}})
    transformations.append(
        {
            "id": "organize",
            "options": {
                # includeByName is Grafana 11's; excludeByName hides the usual rest on 10.
                "excludeByName": {name: True for name in HIDDEN_FIELDS if name not in columns},
                "includeByName": dict.fromkeys(columns, True),
                "indexByName": {name: index for index, name in enumerate(columns)},
                "renameByName": dict(columns),
            },
        }
    )
    options: Json = {
        "cellHeight": "sm",
        "footer": {"countRows": False, "fields": "", "reducer": ["sum"], "show": False},
        "showHeader": True,
    }
    if sort_by is not None:
        options["sortBy"] = [{"desc": descending, "displayName": sort_by}]
    return _panel(
        "table",
        title,
        description,
        queries,
        defaults=_field_defaults(
            unit,
            decimals=decimals,
            color={"mode": "thresholds"},
            custom={"align": "auto", "cellOptions": {"type": "auto"}, "inspect": False},
        ),
        options=options,
        overrides=overrides,
        transformations=transformations,
    )


def text(title: str, content: str) -> Json:
    return {
        "options": {
            "code": {"language": "plaintext", "showLineNumbers": False, "showMiniMap": False},
            "content": content,
            "mode": "markdown",
        },
        "title": title,
        "type": "text",
    }


# --- variables and annotations --------------------------------------------------------------


def datasource_variable() -> Json:
    return {
        "current": {
            "selected": False,
            "text": "Prometheus",
            "value": PROVISIONED_DATASOURCE_UID,
        },
        "hide": 0,
        "includeAll": False,
        "label": "Data source",
        "multi": False,
        "name": "datasource",
        "options": [],
        "query": "prometheus",
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
        "type": "datasource",
    }


def query_variable(
    name: str,
    label: str,
    definition: str,
    *,
    multi: bool = True,
    all_value: str | None = ".*",
    numeric: bool = False,
) -> Json:
    """A label_values() variable. ``all_value`` None: "All" is the list of values itself."""
    variable: Json = {
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if multi else {},
        "datasource": dict(DATASOURCE),
        "definition": definition,
        "hide": 0,
        "includeAll": multi,
        "label": label,
        "multi": multi,
        "name": name,
        "options": [],
        "query": {
            "qryType": 1,
            "query": definition,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,
        "regex": "",
        "skipUrlSync": False,
        "sort": 3 if numeric else 1,
        "type": "query",
    }
    if multi and all_value is not None:
        variable["allValue"] = all_value
    return variable


BUILT_IN_ANNOTATION: Json = {
    "builtIn": 1,
    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
    "enable": True,
    "hide": True,
    "iconColor": "rgba(0, 211, 255, 1)",
    "name": "Annotations & Alerts",
    "type": "dashboard",
}


def annotation(
    name: str,
    expr: str,
    *,
    color: str,
    title: str,
    text_format: str,
    tag_keys: str,
    value_is_time: bool = False,
) -> Json:
    """A Prometheus annotation: an event wherever the query returns a value above 0, or, with
    ``value_is_time``, at the time (milliseconds) the query's value holds. ``panels`` is filled
    in by the dashboard from the panels that ask for it."""
    return {
        "datasource": dict(DATASOURCE),
        "enable": True,
        "expr": expr,
        "filter": {"exclude": False, "ids": []},
        "hide": False,
        "iconColor": color,
        "name": name,
        "step": "60s",
        "tagKeys": tag_keys,
        "target": {"expr": expr, "interval": "60s", "refId": "Anno"},
        "textFormat": text_format,
        "titleFormat": title,
        "useValueForTime": value_is_time,
    }


def stack_change_annotation(instance_matcher: str) -> Json:
    # increase(), not changes(): an agent restart resets the counter, which changes() would mark.
    return annotation(
        "Stack changes",
        f"increase(sustain_stack_changes_total{{{instance_matcher}}}[5m]) > 0",
        color="orange",
        title="Stack changed",
        text_format="{{instance}}: the stack probes run on changed (sustain / Stack and drift)",
        tag_keys="instance",
    )


# --- the dashboard --------------------------------------------------------------------------


class Board:
    """Panels placed left to right, top to bottom, on Grafana's 24-column grid.

    Positions and panel ids follow the order of the calls: a board module adds its rows in the
    order they appear on the page."""

    def __init__(self, uid: str, title: str, description: str, variables: list[Json]) -> None:
        self.uid = uid
        self.title = title
        self.description = description
        self.variables = variables
        self.panels: list[Json] = []
        self.annotations: list[Json] = []
        self._annotated: list[int] = []
        self._x = 0
        self._y = 0
        self._line_height = 0

    def _newline(self) -> None:
        if self._x:
            self._y += self._line_height
        self._x = 0
        self._line_height = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": self._y},
                "id": len(self.panels) + 1,
                "panels": [],
                "title": title,
                "type": "row",
            }
        )
        self._y += 1

    def add(self, panel: Json, w: int, h: int, *, annotated: bool = False, **extra: Any) -> None:
        """Place ``panel`` (``w`` columns by ``h`` rows); ``annotated``: the dashboard's
        annotations show on it (and only on the panels that ask)."""
        if self._x + w > GRID_WIDTH:
            self._newline()
        panel_id = len(self.panels) + 1
        self.panels.append(
            {**panel, "gridPos": {"h": h, "w": w, "x": self._x, "y": self._y}, "id": panel_id}
            | extra
        )
        if annotated:
            self._annotated.append(panel_id)
        self._x += w
        self._line_height = max(self._line_height, h)

    def to_json(self) -> Json:
        annotations = [BUILT_IN_ANNOTATION]
        for item in self.annotations:
            annotations.append({**item, "filter": {"exclude": False, "ids": self._annotated}})
        return {
            "annotations": {"list": annotations},
            "description": self.description,
            "editable": True,
            "fiscalYearStartMonth": 0,
            "graphTooltip": 1,
            "id": None,
            "links": [
                {
                    "asDropdown": True,
                    "icon": "external link",
                    "includeVars": False,
                    "keepTime": True,
                    "tags": [TAG],
                    "targetBlank": False,
                    "title": "sustain dashboards",
                    "tooltip": "",
                    "type": "dashboards",
                    "url": "",
                }
            ],
            "panels": self.panels,
            "refresh": "1m",
            "schemaVersion": SCHEMA_VERSION,
            "tags": [TAG],
            "templating": {"list": self.variables},
            "time": {"from": "now-24h", "to": "now"},
            "timepicker": {},
            "timezone": "",
            "title": self.title,
            "uid": self.uid,
            "version": 1,
            "weekStart": "",
        }


# --- probe series (sustain / Probes, sustain / Stack and drift) ----------------------------

# Throughput has one family per unit (sustain_probe_flops, sustain_probe_bytes_per_second,
# sustain_probe_tokens_per_second: docs/metrics.md). A panel over every probe takes the three
# together, each with its unit as a `unit` label for the legends, tables and `by` clauses; the
# workloads have one unit each, so no aggregation by workload mixes them.
THROUGHPUT_UNITS = (
    ("sustain_probe_flops", "FLOP/s"),
    ("sustain_probe_bytes_per_second", "B/s"),
    ("sustain_probe_tokens_per_second", "tokens/s"),
)
WORK_PER_JOULE_UNITS = (
    ("sustain_probe_flop_per_joule", "FLOP/J"),
    ("sustain_probe_bytes_per_joule", "B/J"),
    ("sustain_probe_tokens_per_joule", "tokens/J"),
)


def throughput(*matchers: str, families: tuple[tuple[str, str], ...] = THROUGHPUT_UNITS) -> str:
    """Every family of ``families`` under ``matchers``, each labelled with its unit."""
    selector = ", ".join(matchers)
    return (
        "("
        + " or ".join(
            f'label_replace({name}{{{selector}}}, "unit", "{unit}", "", "")'
            for name, unit in families
        )
        + ")"
    )


# Each throughput family holds solo runs (scope="device") and node-wide runs (scope="node": each
# device while every device of the node worked, and device="node" for their sum). A panel of solo
# results selects SOLO, or node-wide figures land on the same device and probe and mix in.
# Not scope="device": series of agents from before the label (a fleet mid-upgrade, history
# scraped before it) have no scope, and they are solo runs.
SOLO = 'scope!="node"'
PROBE_LABELS = "instance, device, workload, precision, optimization"
# Table columns (label -> header) of the PROBE_LABELS, in that order.
PROBE_COLUMNS = {
    "instance": "Node",
    "device": "Device",
    "workload": "Workload",
    "precision": "Precision",
    "optimization": "Optimization",
}
PROBE = 'instance=~"$instance", device=~"$device", workload=~"$workload", precision=~"$precision"'
PROBE_LEGEND = "{{instance}} {{device}} {{workload}} {{precision}} {{optimization}}"


def probe_variables() -> list[Json]:
    runs = 'sustain_probe_runs_total{instance=~"$instance"}'
    return [
        datasource_variable(),
        query_variable("instance", "Node", "label_values(sustain_build_info, instance)"),
        query_variable("device", "Device", f"label_values({runs}, device)", numeric=True),
        query_variable("workload", "Workload", f"label_values({runs}, workload)"),
        query_variable("precision", "Precision", f"label_values({runs}, precision)"),
    ]
