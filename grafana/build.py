"""Writes the sustain Grafana dashboards: ``python grafana/build.py`` -> grafana/dashboards/*.json.

The JSON files are what ships (Grafana provisions or imports them, see grafana/README.md); this
script keeps them consistent: one datasource reference, one set of variables, the same legends,
units and layout rules everywhere. Edit this file, run it, commit both.
``python grafana/build.py --check`` exits 1 when a committed file differs from what it would write;
tests/test_dashboards.py checks the same.

Every metric name comes from docs/metrics.md. Targets Grafana 10/11 (schemaVersion 39).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Json = dict[str, Any]

HERE = Path(__file__).resolve().parent
DASHBOARDS = HERE / "dashboards"
SCHEMA_VERSION = 39
GRID_WIDTH = 24
DATASOURCE: Json = {"type": "prometheus", "uid": "${datasource}"}
# The uid grafana/provisioning/datasources/prometheus.yaml gives its datasource: the default choice.
PROVISIONED_DATASOURCE_UID = "prometheus"
TAG = "sustain"

# Clock-event reasons that hold the clocks down (the others are idle, application clocks,
# sync boost, display clock: not throttling).
THROTTLE_REASONS = (
    "sw_power_cap|hw_slowdown|sw_thermal_slowdown|hw_thermal_slowdown|hw_power_brake_slowdown"
)
CLASSIFICATIONS = ("flat", "warmup", "slowdown", "no_steady_state", "insufficient")
SLOWDOWN_CAUSES = ("thermal", "power_brake", "power_cap", "clock_unexplained", "not_clock_bound")
PROBE_LABELS = "instance, device, workload, precision, optimization"


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
    """Panels placed left to right, top to bottom, on Grafana's 24-column grid."""

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


# --- sustain / Node -------------------------------------------------------------------------

HEALTH = value_map({"1": ("healthy", "green"), "0": ("lost", "red")})
UP = value_map({"1": ("up", "green"), "0": ("down", "red")})

UTILIZATION_NOTE = """\
### Utilization is not performance

NVML *utilization* is the share of time in which at least one kernel was running. A GPU at 100 %
can be doing a small part of what it is capable of: one busy SM, a memory-bound loop, or clocks
held down by a power cap or by heat all read as 100 %. SM occupancy and tensor activity (GPM,
Hopper and newer) say more, and still not how much work gets done.

The probes measure what the GPU achieves on a known workload (FLOP/s, B/s, tokens/s) when
production leaves it idle. A steady throughput below its usual level means the device (clocks,
power, cooling) or the software stack delivers less, whatever utilization says. Peak against
sustained, and why: **sustain / Probes**; across the fleet: **sustain / Fleet**.
"""


def node() -> Json:
    gpu = 'instance=~"$instance", device=~"$device"'
    host = 'instance=~"$instance"'
    board = Board(
        "sustain-node",
        "sustain / Node",
        "One node: GPU clocks, power and temperature against their limits, clock-event reasons, "
        "utilization beside achieved probe throughput, memory, PCIe, errors, and the host.",
        [
            datasource_variable(),
            query_variable(
                "instance", "Node", "label_values(sustain_build_info, instance)", multi=False
            ),
            query_variable("model", "GPU model", "label_values(sustain_gpu_info, name)"),
            query_variable(
                "device",
                "GPU",
                'label_values(sustain_gpu_info{instance=~"$instance", name=~"$model"}, device)',
                all_value=None,
                numeric=True,
            ),
        ],
    )

    board.row("Overview")
    board.add(
        stat(
            "Agent",
            "Whether Prometheus reaches the agent (up).",
            [Q(f"up{{{host}}}", "{{job}}")],
            mappings=UP,
            steps=thresholds((None, "red"), (1, "green")),
            color_mode="background",
        ),
        4,
        4,
    )
    board.add(
        stat(
            "Agent version",
            "sustain_build_info: the agent's version and Python.",
            [Q(f"sustain_build_info{{{host}}}", "{{version}} (Python {{python_version}})")],
            text_mode="name",
            color_mode="none",
        ),
        4,
        4,
    )
    board.add(
        stat(
            "Driver",
            "NVIDIA driver and the CUDA version it supports (sustain_nvml_info).",
            [
                Q(
                    f"sustain_nvml_info{{{host}}}",
                    "driver {{driver_version}}, CUDA {{cuda_driver_version}}",
                )
            ],
            text_mode="name",
            color_mode="none",
        ),
        6,
        4,
    )
    board.add(
        stat(
            "GPU health",
            "0 (lost) from NVML_ERROR_GPU_IS_LOST until the GPU answers again.",
            [Q(f"sustain_gpu_healthy{{{gpu}}}", "GPU {{device}}")],
            mappings=HEALTH,
            steps=thresholds((None, "red"), (1, "green")),
            text_mode="value_and_name",
            color_mode="background",
        ),
        6,
        4,
    )
    board.add(
        stat(
            "Other compute processes",
            "Compute processes on the GPU that are not the agent's (production work). "
            "Probes are skipped while there are any.",
            [Q(f"sustain_gpu_foreign_compute_processes{{{gpu}}}", "GPU {{device}}")],
            text_mode="value_and_name",
        ),
        4,
        4,
    )
    board.add(
        table(
            "GPUs",
            "The GPUs of this node (sustain_gpu_info).",
            [Q(f"sustain_gpu_info{{{gpu}}}")],
            columns={
                "device": "GPU",
                "name": "Model",
                "uuid": "UUID",
                "pci_bus_id": "PCI bus id",
                "serial": "Serial",
            },
        ),
        24,
        5,
    )

    board.row("Clocks and clock-event reasons")
    for clock, label in (("sm", "SM"), ("memory", "Memory")):
        board.add(
            timeseries(
                f"{label} clock against its maximum",
                f"{label} clock (mean over the exporter window) and the maximum the GPU reports "
                "(dashed). A clock below its maximum under load: see the clock-event reasons.",
                [
                    Q(
                        f'sustain_gpu_clock_window_mean_hertz{{{gpu}, clock="{clock}"}}',
                        f"GPU {{{{device}}}} {label} clock",
                    ),
                    Q(
                        f'sustain_gpu_clock_max_hertz{{{gpu}, clock="{clock}"}}',
                        "GPU {{device}} max",
                    ),
                ],
                unit="hertz",
                minimum=0,
                overrides=[reference_line("B")],
            ),
            12,
            8,
        )
    board.add(
        state_timeline(
            "Clock-event reasons, GPU $device",
            "Each clock-event (throttle) reason of the GPU: red while it was active at any "
            "moment of the exporter window. gpu_idle is no throttle; sw_power_cap, "
            "hw_slowdown, sw/hw_thermal_slowdown and hw_power_brake_slowdown are.",
            [
                Q(
                    f"sustain_gpu_clock_event_reason_active_window_max{{{gpu}}}",
                    "{{reason}}",
                )
            ],
            mappings=value_map({"0": ("inactive", "transparent"), "1": ("active", "red")}),
        ),
        24,
        8,
        repeat="device",
        repeatDirection="h",
        maxPerRow=2,
    )
    board.add(
        timeseries(
            "Time under each clock-event reason",
            "Share of time each reason held the clocks (rate of "
            "sustain_gpu_clock_event_reason_seconds_total). Reasons overlap.",
            [
                Q(
                    "rate(sustain_gpu_clock_event_reason_seconds_total"
                    f'{{{gpu}, reason!="gpu_idle"}}[$__rate_interval])',
                    "GPU {{device}} {{reason}}",
                )
            ],
            unit="percentunit",
            minimum=0,
            maximum=1,
        ),
        12,
        8,
    )
    board.add(
        timeseries(
            "Time in violation, by policy",
            "Share of time the GPU was held below its target clocks, per NVML violation "
            "policy (rate of sustain_gpu_violation_seconds_total).",
            [
                Q(
                    f"rate(sustain_gpu_violation_seconds_total{{{gpu}}}[$__rate_interval])",
                    "GPU {{device}} {{policy}}",
                )
            ],
            unit="percentunit",
            minimum=0,
            maximum=1,
        ),
        12,
        8,
    )

    board.row("Power and temperature")
    board.add(
        timeseries(
            "Power against the enforced limit",
            "Board power: mean and maximum over the exporter window, and the enforced power "
            "limit (dashed). Power at the limit with clocks below their maximum: power cap.",
            [
                Q(f"sustain_gpu_power_window_mean_watts{{{gpu}}}", "GPU {{device}} mean"),
                Q(f"sustain_gpu_power_window_max_watts{{{gpu}}}", "GPU {{device}} peak"),
                Q(f"sustain_gpu_power_limit_watts{{{gpu}}}", "GPU {{device}} limit"),
            ],
            unit="watt",
            minimum=0,
            overrides=[
                reference_line("C"),
                by_ref("B", ("custom.lineStyle", {"dash": [0, 10], "fill": "dot"})),
            ],
        ),
        12,
        8,
    )
    board.add(
        timeseries(
            "Temperature against the slowdown threshold",
            "GPU and memory temperature (maximum over the exporter window) and the GPU's "
            "slowdown threshold (dashed): above it the GPU slows itself down.",
            [
                Q(
                    f"sustain_gpu_temperature_window_max_celsius{{{gpu}}}",
                    "GPU {{device}} {{sensor}}",
                ),
                Q(
                    f'sustain_gpu_temperature_threshold_celsius{{{gpu}, threshold="slowdown"}}',
                    "GPU {{device}} slowdown threshold",
                ),
            ],
            unit="celsius",
            overrides=[reference_line("B")],
        ),
        12,
        8,
    )

    board.row("Utilization is not performance")
    board.add(
        timeseries(
            "Utilization",
            "NVML utilization (time with a kernel running), memory controller utilization, "
            "and where the GPU has GPM (Hopper and newer): SM occupancy, tensor activity, DRAM "
            "bandwidth. Means over the exporter window.",
            [
                Q(f"sustain_gpu_utilization_window_mean_ratio{{{gpu}}}", "GPU {{device}} util"),
                Q(
                    f"sustain_gpu_memory_utilization_window_mean_ratio{{{gpu}}}",
                    "GPU {{device}} memory controller",
                ),
                Q(
                    f"sustain_gpu_sm_occupancy_window_mean_ratio{{{gpu}}}",
                    "GPU {{device}} SM occupancy",
                ),
                Q(
                    f"sustain_gpu_tensor_activity_window_mean_ratio{{{gpu}}}",
                    "GPU {{device}} tensor activity",
                ),
                Q(
                    f"sustain_gpu_dram_bandwidth_utilization_window_mean_ratio{{{gpu}}}",
                    "GPU {{device}} DRAM bandwidth",
                ),
            ],
            unit="percentunit",
            minimum=0,
            maximum=1,
        ),
        9,
        9,
    )
    board.add(
        timeseries(
            "Achieved probe throughput (steady state)",
            "What the GPU achieved in its latest probe runs: the mean of each run's steady "
            "state, per workload and precision, in the probe's unit (FLOP/s, B/s, tokens/s).",
            [
                Q(
                    f'sustain_probe_throughput{{{gpu}, stat="steady"}}',
                    "GPU {{device}} {{workload}} {{precision}} {{optimization}} ({{unit}})",
                )
            ],
            unit="short",
            steps_after=True,
            points=True,
        ),
        9,
        9,
    )
    board.add(text("Utilization is not performance", UTILIZATION_NOTE), 6, 9)

    board.row("Memory and PCIe")
    board.add(
        timeseries(
            "GPU memory used and total",
            "Device memory in use, and the total (dashed).",
            [
                Q(f"sustain_gpu_memory_used_bytes{{{gpu}}}", "GPU {{device}} used"),
                Q(f"sustain_gpu_memory_total_bytes{{{gpu}}}", "GPU {{device}} total"),
            ],
            unit="bytes",
            minimum=0,
            overrides=[reference_line("B", "blue")],
        ),
        12,
        8,
    )
    board.add(
        bargauge(
            "GPU memory in use",
            "Used over total device memory, now.",
            [
                Q(
                    f"sustain_gpu_memory_used_bytes{{{gpu}}}"
                    f" / sustain_gpu_memory_total_bytes{{{gpu}}}",
                    "GPU {{device}}",
                    instant=True,
                )
            ],
            unit="percentunit",
            minimum=0,
            maximum=1,
            steps=thresholds((None, "green"), (0.8, "orange"), (0.95, "red")),
        ),
        12,
        8,
    )
    board.add(
        state_timeline(
            "PCIe link degraded",
            "Red: the link runs narrower than its maximum width (a reseat or riser problem). "
            "Yellow: a lower generation than its maximum, which is normal while the GPU idles "
            "(it drops the link to save power) and a problem under load.",
            [
                Q(
                    f"sustain_gpu_pcie_link_width{{{gpu}}}"
                    f" < bool sustain_gpu_pcie_link_width_max{{{gpu}}}",
                    "GPU {{device}} width",
                ),
                Q(
                    f"sustain_gpu_pcie_link_generation{{{gpu}}}"
                    f" < bool sustain_gpu_pcie_link_generation_max{{{gpu}}}",
                    "GPU {{device}} generation",
                ),
            ],
            mappings=value_map({"0": ("at max", "green"), "1": ("below max", "red")}),
            overrides=[
                by_ref(
                    "B",
                    (
                        "mappings",
                        value_map({"0": ("at max", "green"), "1": ("below max", "yellow")}),
                    ),
                )
            ],
        ),
        12,
        8,
    )

    def link(field: str) -> Q:
        return Q(f"max by (instance, device) (sustain_gpu_pcie_link_{field}{{{gpu}}})")

    board.add(
        table(
            "PCIe link: current against maximum",
            "Generation and width the link runs at now, and the most it can.",
            [link("generation"), link("generation_max"), link("width"), link("width_max")],
            columns={
                "device": "GPU",
                "Value #A": "Generation",
                "Value #B": "Max generation",
                "Value #C": "Width",
                "Value #D": "Max width",
            },
        ),
        6,
        8,
    )
    board.add(
        timeseries(
            "PCIe throughput",
            "PCIe traffic by direction (mean over the exporter window).",
            [
                Q(
                    f"sustain_gpu_pcie_throughput_window_mean_bytes_per_second{{{gpu}}}",
                    "GPU {{device}} {{direction}}",
                )
            ],
            unit="Bps",
            minimum=0,
        ),
        6,
        8,
    )

    board.row("Errors and health")
    board.add(
        state_timeline(
            "Device health",
            "Red while NVML reports the GPU lost.",
            [Q(f"sustain_gpu_healthy{{{gpu}}}", "GPU {{device}}")],
            mappings=HEALTH,
        ),
        12,
        6,
    )
    board.add(
        table(
            "XID events: count and last seen",
            "XID errors since the agent started, by code, and when each code was last seen.",
            [
                Q(f"max by (instance, device, xid) (sustain_gpu_xid_errors_total{{{gpu}}})"),
                Q(
                    "max by (instance, device, xid) "
                    f"(sustain_gpu_xid_last_seen_timestamp_seconds{{{gpu}}}) * 1000"
                ),
            ],
            columns={
                "device": "GPU",
                "xid": "XID",
                "Value #A": "Count",
                "Value #B": "Last seen",
            },
            overrides=[by_name("Last seen", ("unit", "dateTimeAsIso"))],
            sort_by="Last seen",
        ),
        12,
        6,
    )
    board.add(
        timeseries(
            "XID events",
            "New XID errors by code (an XID's first occurrence after an agent start shows in "
            "the table, not here: its series starts at 1).",
            [
                Q(
                    f"increase(sustain_gpu_xid_errors_total{{{gpu}}}[$__rate_interval])",
                    "GPU {{device}} XID {{xid}}",
                )
            ],
            unit="short",
            minimum=0,
            bars=True,
        ),
        8,
        7,
    )
    board.add(
        timeseries(
            "ECC errors",
            "New ECC errors by type (single-bit corrected, double-bit uncorrected).",
            [
                Q(
                    f"increase(sustain_gpu_ecc_errors_total{{{gpu}}}[$__rate_interval])",
                    "GPU {{device}} {{type}}",
                )
            ],
            unit="short",
            minimum=0,
            bars=True,
        ),
        8,
        7,
    )
    board.add(
        stat(
            "Row remapping",
            "Pending: a remap waits for a GPU reset. Failed: the GPU ran out of spare rows.",
            [
                Q(f"sustain_gpu_row_remap_pending{{{gpu}}}", "GPU {{device}} pending"),
                Q(f"sustain_gpu_row_remap_failed{{{gpu}}}", "GPU {{device}} failed"),
            ],
            steps=thresholds((None, "green"), (1, "red")),
            text_mode="value_and_name",
        ),
        8,
        7,
    )

    board.row("Host")
    board.add(
        timeseries(
            "CPU utilization",
            "All CPUs: mean and maximum over the exporter window.",
            [
                Q(f"sustain_cpu_utilization_window_mean_ratio{{{host}}}", "mean"),
                Q(f"sustain_cpu_utilization_window_max_ratio{{{host}}}", "max"),
            ],
            unit="percentunit",
            minimum=0,
            maximum=1,
        ),
        8,
        8,
    )
    board.add(
        timeseries(
            "Host memory",
            "Memory in use (total minus available) and the total (dashed).",
            [
                Q(f"sustain_memory_used_bytes{{{host}}}", "used"),
                Q(f"sustain_memory_total_bytes{{{host}}}", "total"),
            ],
            unit="bytes",
            minimum=0,
            overrides=[reference_line("B", "blue")],
        ),
        8,
        8,
    )
    board.add(
        timeseries(
            "Load",
            "Load averages over 1, 5 and 15 minutes.",
            [
                Q(f"sustain_load1{{{host}}}", "1 min"),
                Q(f"sustain_load5{{{host}}}", "5 min"),
                Q(f"sustain_load15{{{host}}}", "15 min"),
            ],
            unit="short",
            minimum=0,
        ),
        8,
        8,
    )
    board.add(
        timeseries(
            "CPU frequency against its maximum",
            "Mean and slowest CPU frequency (over the exporter window) and the highest "
            "maximum frequency (dashed).",
            [
                Q(
                    f"avg by (instance) (sustain_cpu_frequency_window_mean_hertz{{{host}}})",
                    "mean of CPUs",
                ),
                Q(
                    f"max by (instance) (sustain_cpu_frequency_max_hertz{{{host}}})",
                    "max",
                ),
                Q(
                    f"min by (instance) (sustain_cpu_frequency_window_mean_hertz{{{host}}})",
                    "slowest CPU",
                ),
            ],
            unit="hertz",
            minimum=0,
            overrides=[reference_line("B")],
        ),
        12,
        8,
    )
    board.add(
        timeseries(
            "Host temperatures",
            "hwmon and thermal-zone sensors (maximum over the exporter window).",
            [
                Q(
                    f"sustain_temperature_window_max_celsius{{{host}}}",
                    "{{chip}} {{sensor}}",
                )
            ],
            unit="celsius",
        ),
        12,
        8,
    )
    return board.to_json()


# --- sustain / Probes -----------------------------------------------------------------------


def probe_variables() -> list[Json]:
    runs = 'sustain_probe_runs_total{instance=~"$instance"}'
    return [
        datasource_variable(),
        query_variable("instance", "Node", "label_values(sustain_build_info, instance)"),
        query_variable("device", "Device", f"label_values({runs}, device)", numeric=True),
        query_variable("workload", "Workload", f"label_values({runs}, workload)"),
        query_variable("precision", "Precision", f"label_values({runs}, precision)"),
    ]


PROBE = 'instance=~"$instance", device=~"$device", workload=~"$workload", precision=~"$precision"'
PROBE_LEGEND = "{{instance}} {{device}} {{workload}} {{precision}} {{optimization}}"


def coded(metric: str, selector: str, label: str, values: Sequence[str]) -> str:
    """One series per probe whose value is the index of its ``label`` in ``values``, so that a
    state timeline shows a change of classification or cause as a change of colour."""
    parts = [f'{metric}{{{selector}, {label}="{value}"}} * {i}' for i, value in enumerate(values)]
    return f"max without ({label}) ({' or '.join(parts)})"


def coded_map(values: Sequence[str], colors: Sequence[str]) -> list[Json]:
    return value_map({str(i): (v, c) for i, (v, c) in enumerate(zip(values, colors, strict=True))})


CLASSIFICATION_COLORS = ("green", "blue", "red", "orange", "text")
CAUSE_COLORS = ("red", "purple", "orange", "yellow", "blue")
OUTCOME_COLORS = {
    "ok": "green",
    "failed": "red",
    "timeout": "orange",
    "unsupported": "text",
    "skipped": "blue",
    "aborted": "purple",
}


def probes() -> Json:
    board = Board(
        "sustain-probes",
        "sustain / Probes",
        "Probe results: sustained against peak per workload and precision, warm-up, the "
        "classification of each run and the cause of a slowdown, work per joule, inference "
        "latency, runs by outcome and the duty cycle.",
        probe_variables(),
    )
    board.annotations.append(stack_change_annotation('instance=~"$instance"'))
    by = f"max by ({PROBE_LABELS}, unit)"

    board.row("Sustained against peak")
    board.add(
        table(
            "Peak and steady throughput, latest run",
            "Peak: the best short window of the latest ok run. Steady: the mean of its steady "
            "state. Sustained: steady over peak. In the probe's unit.",
            [
                Q(f'{by} (sustain_probe_throughput{{{PROBE}, stat="peak"}})'),
                Q(f'{by} (sustain_probe_throughput{{{PROBE}, stat="steady"}})'),
                Q(
                    f'{by} (sustain_probe_throughput{{{PROBE}, stat="steady"}})'
                    f' / {by} (sustain_probe_throughput{{{PROBE}, stat="peak"}})'
                ),
            ],
            columns={
                "instance": "Node",
                "device": "Device",
                "workload": "Workload",
                "precision": "Precision",
                "optimization": "Optimization",
                "unit": "Unit",
                "Value #A": "Peak",
                "Value #B": "Steady",
                "Value #C": "Sustained",
            },
            unit="short",
            overrides=[
                by_name(
                    "Sustained",
                    ("unit", "percentunit"),
                    ("decimals", 1),
                    ("custom.cellOptions", {"type": "color-text"}),
                    ("thresholds", thresholds((None, "red"), (0.85, "orange"), (0.95, "green"))),
                )
            ],
            sort_by="Sustained",
            descending=False,
        ),
        24,
        8,
    )
    board.add(
        timeseries(
            "Peak and steady throughput over time",
            "Each run's peak (dashed) and steady throughput. Orange marks: stack changes.",
            [
                Q(
                    f'sustain_probe_throughput{{{PROBE}, stat="peak"}}',
                    f"{PROBE_LEGEND} peak ({{{{unit}}}})",
                ),
                Q(
                    f'sustain_probe_throughput{{{PROBE}, stat="steady"}}',
                    f"{PROBE_LEGEND} steady ({{{{unit}}}})",
                ),
            ],
            unit="short",
            steps_after=True,
            overrides=[by_ref("A", ("custom.lineStyle", {"dash": [10, 10], "fill": "dash"}))],
        ),
        24,
        9,
        annotated=True,
    )
    board.add(
        timeseries(
            "Sustained ratio over time",
            "Steady over peak of each run: 1 is a flat run; lower means the device could not "
            "hold its peak.",
            [Q(f"sustain_probe_sustained_ratio{{{PROBE}}}", PROBE_LEGEND)],
            unit="percentunit",
            minimum=0,
            maximum=1,
            steps_after=True,
        ),
        12,
        8,
        annotated=True,
    )
    board.add(
        bargauge(
            "Sustained ratio, latest run",
            "Steady over peak of the latest run, lowest first.",
            [
                Q(
                    f"sort(sustain_probe_sustained_ratio{{{PROBE}}})",
                    PROBE_LEGEND,
                    instant=True,
                )
            ],
            unit="percentunit",
            minimum=0,
            maximum=1,
            steps=thresholds((None, "red"), (0.85, "orange"), (0.95, "green")),
        ),
        12,
        8,
    )

    board.row("Warm-up and slowdowns")
    board.add(
        timeseries(
            "Warm-up time",
            "From the start of each run to its steady state.",
            [Q(f"sustain_probe_warmup_seconds{{{PROBE}}}", PROBE_LEGEND)],
            unit="s",
            minimum=0,
            steps_after=True,
            points=True,
        ),
        12,
        8,
    )
    probe_on = "on (instance, device, uuid, workload, precision, optimization)"
    board.add(
        table(
            "Classification and cause of slowdowns, latest run",
            "flat, warmup, slowdown, no_steady_state or insufficient; for a slowdown, the "
            "cause the run's telemetry shows: thermal, power_brake, power_cap, "
            "clock_unexplained, or not_clock_bound (the clocks held: memory, host, contention).",
            [
                Q(
                    f"max by ({PROBE_LABELS}, classification, cause) ("
                    f"sustain_probe_classification{{{PROBE}}} * {probe_on} group_left (cause) "
                    f"sustain_probe_slowdown_cause{{{PROBE}}})"
                    f" or on ({PROBE_LABELS}) "
                    f"max by ({PROBE_LABELS}, classification) "
                    f"(sustain_probe_classification{{{PROBE}}})"
                )
            ],
            columns={
                "instance": "Node",
                "device": "Device",
                "workload": "Workload",
                "precision": "Precision",
                "optimization": "Optimization",
                "classification": "Classification",
                "cause": "Cause",
            },
            overrides=[
                by_name(
                    "Classification",
                    (
                        "mappings",
                        value_map(
                            {
                                name: (name, color)
                                for name, color in zip(
                                    CLASSIFICATIONS, CLASSIFICATION_COLORS, strict=True
                                )
                            }
                        ),
                    ),
                    ("custom.cellOptions", {"type": "color-text"}),
                ),
            ],
            sort_by="Classification",
        ),
        12,
        8,
    )
    board.add(
        state_timeline(
            "Classification over time",
            "The classification of each probe's latest run, as it changed.",
            [
                Q(
                    coded("sustain_probe_classification", PROBE, "classification", CLASSIFICATIONS),
                    PROBE_LEGEND,
                )
            ],
            mappings=coded_map(CLASSIFICATIONS, CLASSIFICATION_COLORS),
        ),
        12,
        8,
    )
    board.add(
        state_timeline(
            "Slowdown cause over time",
            "For runs classified slowdown: what the telemetry of the run blames; "
            "'no slowdown' for the others.",
            [
                Q(
                    coded("sustain_probe_slowdown_cause", PROBE, "cause", SLOWDOWN_CAUSES)
                    + f" or max without (classification) (sustain_probe_classification{{{PROBE}}})"
                    " * 0 - 1",
                    PROBE_LEGEND,
                )
            ],
            mappings=value_map(
                {"-1": ("no slowdown", "green")}
                | {
                    str(i): (v, c)
                    for i, (v, c) in enumerate(zip(SLOWDOWN_CAUSES, CAUSE_COLORS, strict=True))
                }
            ),
        ),
        12,
        8,
    )
    board.add(
        bargauge(
            "Steady state under each clock-event reason, latest run",
            "Share of each GPU probe's steady state spent under each clock-event reason "
            "(reasons that were active at all).",
            [
                Q(
                    f"sustain_probe_reason_share_ratio{{{PROBE}}} > 0",
                    f"{PROBE_LEGEND} {{{{reason}}}}",
                    instant=True,
                )
            ],
            unit="percentunit",
            minimum=0,
            maximum=1,
            steps=thresholds((None, "green"), (0.1, "orange"), (0.5, "red")),
        ),
        12,
        8,
    )

    board.row("Efficiency and latency")
    board.add(
        timeseries(
            "Work per joule",
            "Work of each run over the energy it used (GPU energy counter; RAPL package "
            "energy on the CPU), in the probe's work unit per joule.",
            [
                Q(
                    f"sustain_probe_work_per_joule{{{PROBE}}}",
                    f"{PROBE_LEGEND} ({{{{work_unit}}}}/J)",
                )
            ],
            unit="short",
            minimum=0,
            steps_after=True,
            points=True,
        ),
        12,
        8,
        annotated=True,
    )
    board.add(
        timeseries(
            "Inference latency percentiles",
            "Per-token decode latency of the latest inference run at the 50th, 90th and 99th "
            "percentile.",
            [
                Q(
                    'sustain_probe_latency_seconds{workload="inference", '
                    'quantile=~"0.5|0.9|0.99", instance=~"$instance", device=~"$device", '
                    'precision=~"$precision"}',
                    "{{instance}} {{device}} {{precision}} {{optimization}} q{{quantile}}",
                )
            ],
            unit="s",
            minimum=0,
            steps_after=True,
            points=True,
        ),
        12,
        8,
        annotated=True,
    )

    board.row("Runs and duty cycle")
    board.add(
        timeseries(
            "Probe runs by outcome",
            "Runs per hour (over the trailing hour) by outcome: ok, failed, timeout, "
            "unsupported, skipped (other processes on the GPU, a busy device, the duty-cycle "
            "budget spent) and aborted (the agent stopped during the run).",
            [
                Q(
                    f"sum by (outcome) (rate(sustain_probe_runs_total{{{PROBE}}}[1h])) * 3600",
                    "{{outcome}}",
                )
            ],
            unit="suffix: runs/h",
            minimum=0,
            stacked=True,
            overrides=[
                by_name(outcome, ("color", {"fixedColor": color, "mode": "fixed"}))
                for outcome, color in OUTCOME_COLORS.items()
            ],
        ),
        12,
        8,
    )
    board.add(
        table(
            "Time since the last run",
            "Since the end of each probe's last run that was not skipped.",
            [
                Q(
                    f"time() - max by ({PROBE_LABELS}) "
                    f"(sustain_probe_last_run_timestamp_seconds{{{PROBE}}})"
                )
            ],
            columns={
                "instance": "Node",
                "device": "Device",
                "workload": "Workload",
                "precision": "Precision",
                "optimization": "Optimization",
                "Value": "Since last run",
            },
            unit="s",
            sort_by="Since last run",
        ),
        12,
        8,
    )
    devices = 'instance=~"$instance", device=~"$device"'
    board.add(
        timeseries(
            "Duty cycle",
            "Share of the last hour each device spent running probes (the configured budget "
            "is 2 % by default).",
            [Q(f"sustain_probe_duty_cycle_ratio{{{devices}}}", "{{instance}} {{device}}")],
            unit="percentunit",
            minimum=0,
        ),
        12,
        8,
    )
    board.add(
        state_timeline(
            "Probe running",
            "When a probe ran on each device.",
            [Q(f"sustain_probe_running{{{devices}}}", "{{instance}} {{device}}")],
            mappings=value_map({"0": ("idle", "transparent"), "1": ("probing", "blue")}),
        ),
        12,
        8,
    )
    return board.to_json()


# --- sustain / Fleet ------------------------------------------------------------------------


def fleet() -> Json:
    job = 'job=~"$job"'
    probe = f'{job}, workload=~"$workload", precision=~"$precision"'
    info = f'sustain_gpu_info{{{job}, name=~"$model"}}'
    with_model = f"on (instance, uuid) group_left (name) {info}"
    steady = f'sustain_probe_throughput{{{probe}, stat="steady"}} * {with_model}'
    capacity = "name, workload, precision, optimization, unit"
    board = Board(
        "sustain-fleet",
        "sustain / Fleet",
        "The fleet: sustained throughput per GPU model and precision (capacity), devices "
        "behind identical peers, throttling hot spots, the stacks in use and the agents.",
        [
            datasource_variable(),
            query_variable("job", "Job", "label_values(sustain_build_info, job)", all_value=None),
            query_variable(
                "model", "GPU model", 'label_values(sustain_gpu_info{job=~"$job"}, name)'
            ),
            query_variable(
                "workload",
                "Workload",
                'label_values(sustain_probe_runs_total{job=~"$job"}, workload)',
            ),
            query_variable(
                "precision",
                "Precision",
                'label_values(sustain_probe_runs_total{job=~"$job"}, precision)',
            ),
        ],
    )

    board.row("Agents")
    board.add(
        stat("Agents up", "Scrape targets of the job(s) that answer.", [Q(f"sum(up{{{job}}})")]),
        4,
        4,
    )
    board.add(
        stat(
            "Agents down",
            "Scrape targets of the job(s) that do not answer (listed below).",
            [Q(f"count(up{{{job}}} == 0) or vector(0)")],
            steps=thresholds((None, "green"), (1, "red")),
        ),
        4,
        4,
    )
    board.add(stat("GPUs", "GPUs the agents see.", [Q(f"count({info})")]), 4, 4)
    board.add(
        stat(
            "GPUs lost",
            "GPUs NVML reports lost (sustain_gpu_healthy 0).",
            [Q(f"count(sustain_gpu_healthy{{{job}}} == 0) or vector(0)")],
            steps=thresholds((None, "green"), (1, "red")),
        ),
        4,
        4,
    )
    board.add(
        stat(
            "Stalled samplers",
            "Sampler loops that finished no poll in time (/healthz answers 503).",
            [Q(f"count(sustain_sampler_stalled{{{job}}} == 1) or vector(0)")],
            steps=thresholds((None, "green"), (1, "red")),
        ),
        4,
        4,
    )
    board.add(
        stat(
            "Archive writes waiting",
            "Writes in the agents' spools, not yet in the database.",
            [Q(f"sum(sustain_archive_spool_items{{{job}}})")],
            steps=thresholds((None, "green"), (1000, "orange")),
        ),
        4,
        4,
    )
    board.add(
        table(
            "Agents not answering",
            "Every sustain target with its last scrape: 0 = not answering (those sort first), "
            "1 = answering.",
            [Q(f"sort(up{{{job}}})")],
            columns={"instance": "Node", "job": "Job", "Value": "Answering (1) or not (0)"},
            sort_by="Answering (1) or not (0)",
            descending=False,
        ),
        12,
        6,
    )
    board.add(
        bargauge(
            "Agent versions",
            "Agents per sustain version.",
            [Q(f"count by (version) (sustain_build_info{{{job}}})", "{{version}}", instant=True)],
            unit="short",
            minimum=0,
        ),
        12,
        6,
    )

    board.row("Capacity: sustained throughput per GPU model")
    board.add(
        table(
            "Sustained throughput per GPU model and precision",
            "Steady throughput of the latest run of every device, per GPU model (from "
            "sustain_gpu_info), workload and precision: median, 10th percentile (what 90 % of "
            "the devices sustain at least) and the number of devices.",
            [
                Q(f"quantile by ({capacity}) (0.5, {steady})"),
                Q(f"quantile by ({capacity}) (0.1, {steady})"),
                Q(f"count by ({capacity}) ({steady})"),
            ],
            columns={
                "name": "GPU model",
                "workload": "Workload",
                "precision": "Precision",
                "optimization": "Optimization",
                "unit": "Unit",
                "Value #A": "Median",
                "Value #B": "p10",
                "Value #C": "Devices",
            },
            unit="short",
            overrides=[by_name("Devices", ("unit", "none"), ("decimals", 0))],
            sort_by="GPU model",
            descending=False,
        ),
        24,
        9,
    )
    board.add(
        timeseries(
            "Median sustained throughput per GPU model over time",
            "Median over the devices of each model of their latest steady throughput.",
            [
                Q(
                    f"quantile by ({capacity}) (0.5, {steady})",
                    "{{name}} {{workload}} {{precision}} {{optimization}} ({{unit}})",
                )
            ],
            unit="short",
            minimum=0,
        ),
        12,
        8,
    )
    board.add(
        bargauge(
            "Median sustained ratio per GPU model",
            "Steady over peak, median over the devices of each model.",
            [
                Q(
                    "quantile by (name, workload, precision, optimization) (0.5, "
                    f"sustain_probe_sustained_ratio{{{probe}}} * {with_model})",
                    "{{name}} {{workload}} {{precision}} {{optimization}}",
                    instant=True,
                )
            ],
            unit="percentunit",
            minimum=0,
            maximum=1,
            steps=thresholds((None, "red"), (0.85, "orange"), (0.95, "green")),
        ),
        12,
        8,
    )

    board.row("Fleet outliers")
    outliers = (
        f"sustain_drift_fleet_ratio{{{probe}}} and on "
        f"(instance, uuid, workload, precision, optimization) "
        f"(sustain_drift_fleet_outlier{{{probe}}} == 1)"
    )
    board.add(
        stat(
            "Outliers now",
            "Devices whose recent steady throughput is below their identical peers' median "
            "by more than drift.outlier_ratio (default 10 %).",
            [Q(f"count(({outliers}) * {with_model}) or vector(0)")],
            steps=thresholds((None, "green"), (1, "red")),
        ),
        4,
        9,
    )
    board.add(
        table(
            "Outlier devices",
            "Each outlier with its ratio: its median of the last 5 results over the median of "
            "identical devices (same model, stack and probe, at least 3 peers).",
            [Q(f"({outliers}) * {with_model}")],
            columns={
                "instance": "Node",
                "device": "GPU",
                "name": "Model",
                "workload": "Workload",
                "precision": "Precision",
                "optimization": "Optimization",
                "Value": "Against peers",
            },
            unit="percentunit",
            sort_by="Against peers",
            descending=False,
            decimals=1,
        ),
        20,
        9,
    )
    board.add(
        bargauge(
            "Lowest ratios against identical peers",
            "The 15 devices furthest below their peers' median, now.",
            [
                Q(
                    f"bottomk(15, sustain_drift_fleet_ratio{{{probe}}} * {with_model})",
                    "{{instance}} GPU {{device}} {{name}} {{workload}} {{precision}}",
                    instant=True,
                )
            ],
            unit="percentunit",
            minimum=0,
            maximum=1.2,
            steps=thresholds((None, "red"), (0.9, "orange"), (0.97, "green")),
        ),
        12,
        9,
    )
    board.add(
        timeseries(
            "Ratio against identical peers over time",
            "The 10 lowest ratios at each moment.",
            [
                Q(
                    f"bottomk(10, sustain_drift_fleet_ratio{{{probe}}} * {with_model})",
                    "{{instance}} GPU {{device}} {{name}} {{workload}} {{precision}}",
                )
            ],
            unit="percentunit",
            minimum=0,
        ),
        12,
        9,
    )

    board.row("Throttling hot spots")
    throttled = (
        f'sustain_gpu_clock_event_reason_seconds_total{{{job}, reason=~"{THROTTLE_REASONS}"}}'
    )
    board.add(
        bargauge(
            "Most throttled GPUs over the time range",
            "The 10 GPU and reason pairs with the largest share of the dashboard's time range "
            "under a throttling reason (power cap, power brake, thermal, hardware slowdown).",
            [
                Q(
                    f"topk(10, rate({throttled}[$__range]) * {with_model})",
                    "{{instance}} GPU {{device}} {{name}} {{reason}}",
                    instant=True,
                )
            ],
            unit="percentunit",
            minimum=0,
            maximum=1,
            steps=thresholds((None, "green"), (0.05, "orange"), (0.25, "red")),
        ),
        12,
        9,
    )
    board.add(
        timeseries(
            "Throttled share, top 10",
            "At each moment, the 10 GPU and reason pairs with the most time under a "
            "throttling reason.",
            [
                Q(
                    f"topk(10, rate({throttled}[$__rate_interval]))",
                    "{{instance}} GPU {{device}} {{reason}}",
                )
            ],
            unit="percentunit",
            minimum=0,
            maximum=1,
        ),
        12,
        9,
    )
    board.add(
        bargauge(
            "Throttled share per GPU model",
            "Mean share of the time range under each throttling reason, per GPU model.",
            [
                Q(
                    f"avg by (name, reason) (rate({throttled}[$__range]) * {with_model}) > 0",
                    "{{name}} {{reason}}",
                    instant=True,
                )
            ],
            unit="percentunit",
            minimum=0,
            maximum=1,
            steps=thresholds((None, "green"), (0.05, "orange"), (0.25, "red")),
        ),
        24,
        7,
    )

    board.row("Stacks in use")
    board.add(
        table(
            "Stack versions in use",
            "Agents per driver, torch and CUDA driver version (the stack probes run on now).",
            [
                Q(
                    "count by (driver_version, torch_version, cuda_driver_version) "
                    f"(sustain_stack_info{{{job}}})"
                )
            ],
            columns={
                "driver_version": "Driver",
                "cuda_driver_version": "CUDA driver",
                "torch_version": "torch",
                "Value": "Agents",
            },
            sort_by="Agents",
        ),
        24,
        7,
    )
    return board.to_json()


# --- sustain / Stack and drift --------------------------------------------------------------


def stack_and_drift() -> Json:
    drift_labels = f"{PROBE_LABELS}, direction, cause"
    board = Board(
        "sustain-stack-drift",
        "sustain / Stack and drift",
        "Stack changes marked on the throughput they may explain, lasting throughput changes "
        "(drift) with their attribution, the stack each node runs, and the health of drift "
        "detection.",
        probe_variables(),
    )
    board.annotations.append(stack_change_annotation('instance=~"$instance"'))
    board.annotations.append(
        annotation(
            "Drift",
            f"max by ({drift_labels}) "
            f"(sustain_drift_last_change_timestamp_seconds{{{PROBE}}}) * 1000",
            color="purple",
            title="Drift: {{direction}} ({{cause}})",
            text_format="{{instance}} {{device}} {{workload}} {{precision}} {{optimization}}",
            tag_keys="direction,cause",
            value_is_time=True,
        )
    )

    board.row("Throughput, stack changes (orange) and drift (purple)")
    board.add(
        timeseries(
            "Steady throughput",
            "The steady throughput of each probe's latest run. Orange marks: this node's "
            "stack changed. Purple marks: the first result after a lasting change (drift).",
            [
                Q(
                    f'sustain_probe_throughput{{{PROBE}, stat="steady"}}',
                    f"{PROBE_LEGEND} ({{{{unit}}}})",
                )
            ],
            unit="short",
            steps_after=True,
        ),
        24,
        9,
        annotated=True,
    )
    board.add(
        timeseries(
            "Sustained ratio",
            "Steady over peak of each probe's latest run.",
            [Q(f"sustain_probe_sustained_ratio{{{PROBE}}}", PROBE_LEGEND)],
            unit="percentunit",
            minimum=0,
            maximum=1,
            steps_after=True,
        ),
        12,
        8,
        annotated=True,
    )
    board.add(
        timeseries(
            "Stack changes",
            "Stack changes each agent saw, per hour (a node's first stack counts).",
            [
                Q(
                    'increase(sustain_stack_changes_total{instance=~"$instance"}[1h])',
                    "{{instance}}",
                )
            ],
            unit="short",
            minimum=0,
        ),
        12,
        8,
        annotated=True,
    )

    board.row("Current stack")
    stack = 'sustain_stack_info{instance=~"$instance"}'
    board.add(
        table(
            "Current stack per node",
            "The stack probes run on now, and when the agent last saw it change (- : no "
            "change seen since the agent started).",
            [
                Q(
                    f"({stack} * on (instance) group_left () "
                    '(sustain_stack_last_change_timestamp_seconds{instance=~"$instance"} * 1000))'
                    f" or ({stack} * 0)"
                )
            ],
            columns={
                "instance": "Node",
                "driver_version": "Driver",
                "cuda_driver_version": "CUDA driver",
                "torch_version": "torch",
                "torch_cuda_version": "torch CUDA",
                "cudnn_version": "cuDNN",
                "nccl_version": "NCCL",
                "python_version": "Python",
                "kernel_version": "Kernel",
                "sdpa_backend": "SDPA backend",
                "stack_id": "Stack id",
                "Value": "Last change",
            },
            overrides=[
                by_name(
                    "Last change",
                    ("unit", "dateTimeAsIso"),
                    ("mappings", value_map({"0": ("-", "text")})),
                )
            ],
            sort_by="Node",
            descending=False,
        ),
        24,
        8,
    )

    board.row("Drift")
    for direction, color in (("regression", "red"), ("improvement", "green")):
        board.add(
            stat(
                f"Latest change: {direction}",
                f"Probe series whose latest lasting change of steady throughput was a {direction}.",
                [
                    Q(
                        "count(sustain_drift_last_change_ratio"
                        f'{{{PROBE}, direction="{direction}"}}) or vector(0)'
                    )
                ],
                steps=thresholds((None, "green"), (1, color)),
            ),
            6,
            6,
        )
    board.add(
        bargauge(
            "Latest changes by cause",
            "stack (most runs before and after ran on different stacks), thermal, power, "
            "clocks (the SM clock moved with no reason reported) or unexplained.",
            [
                Q(
                    f"count by (cause, direction) (sustain_drift_last_change_ratio{{{PROBE}}})",
                    "{{cause}} {{direction}}",
                    instant=True,
                )
            ],
            unit="short",
            minimum=0,
        ),
        12,
        6,
    )
    board.add(
        table(
            "Drift events and their attribution",
            "The latest lasting change of each probe's steady throughput: after over before, "
            "its direction and cause, and when the first result after it came. The stack diff "
            "of a change: sustain drift / sustain stack diff.",
            [
                Q(f"max by ({drift_labels}) (sustain_drift_last_change_ratio{{{PROBE}}})"),
                Q(
                    f"max by ({drift_labels}) "
                    f"(sustain_drift_last_change_timestamp_seconds{{{PROBE}}}) * 1000"
                ),
                Q(f"max by ({drift_labels}) (sustain_drift_last_change_ratio{{{PROBE}}}) - 1"),
            ],
            columns={
                "Value #B": "Detected",
                "instance": "Node",
                "device": "Device",
                "workload": "Workload",
                "precision": "Precision",
                "optimization": "Optimization",
                "direction": "Direction",
                "cause": "Cause",
                "Value #A": "After / before",
                "Value #C": "Change",
            },
            overrides=[
                by_name("Detected", ("unit", "dateTimeAsIso")),
                by_name("After / before", ("decimals", 3)),
                by_name(
                    "Change",
                    ("unit", "percentunit"),
                    ("decimals", 1),
                    ("custom.cellOptions", {"type": "color-text"}),
                    ("thresholds", thresholds((None, "red"), (0, "green"))),
                ),
                by_name(
                    "Direction",
                    (
                        "mappings",
                        value_map(
                            {
                                "regression": ("regression", "red"),
                                "improvement": ("improvement", "green"),
                            }
                        ),
                    ),
                    ("custom.cellOptions", {"type": "color-text"}),
                ),
            ],
            sort_by="Detected",
        ),
        24,
        9,
    )

    board.row("Drift detection health")
    host = 'instance=~"$instance"'
    board.add(
        stat(
            "Time since the last drift run",
            "Drift detection runs every drift.interval_seconds (hourly by default).",
            [Q(f"time() - sustain_drift_last_run_timestamp_seconds{{{host}}}", "{{instance}}")],
            unit="s",
            steps=thresholds((None, "green"), (7200, "orange"), (14400, "red")),
            text_mode="value_and_name",
        ),
        8,
        7,
    )
    board.add(
        timeseries(
            "Drift runs by outcome",
            "Runs of the drift detection over the trailing hour, by outcome.",
            [
                Q(
                    f"sum by (outcome) (increase(sustain_drift_runs_total{{{host}}}[1h]))",
                    "{{outcome}}",
                )
            ],
            unit="short",
            minimum=0,
            overrides=[
                by_name("ok", ("color", {"fixedColor": "green", "mode": "fixed"})),
                by_name("failed", ("color", {"fixedColor": "red", "mode": "fixed"})),
            ],
        ),
        8,
        7,
    )
    board.add(
        stat(
            "Failed drift runs, last 24 h",
            "A failed run leaves drift and outlier figures as they were.",
            [
                Q(
                    "sum(increase(sustain_drift_runs_total"
                    f'{{{host}, outcome="failed"}}[24h])) or vector(0)'
                )
            ],
            steps=thresholds((None, "green"), (1, "red")),
            decimals=0,
        ),
        8,
        7,
    )
    return board.to_json()


# --- output ---------------------------------------------------------------------------------

BUILDERS = {
    "node.json": node,
    "probes.json": probes,
    "fleet.json": fleet,
    "stack-and-drift.json": stack_and_drift,
}


def render() -> dict[str, str]:
    """File name (in grafana/dashboards) -> the JSON text this script writes there."""
    return {
        name: json.dumps(build(), indent=2, ensure_ascii=False) + "\n"
        for name, build in BUILDERS.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a committed file differs; write nothing"
    )
    args = parser.parse_args(argv)
    stale = []
    for name, content in render().items():
        path = DASHBOARDS / name
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == content:
            continue
        stale.append(name)
        if not args.check:
            DASHBOARDS.mkdir(parents=True, exist_ok=True)
            path.write_text(content, encoding="utf-8")
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python grafana/build.py", file=sys.stderr)
        return 1
    for name in stale:
        print(f"wrote grafana/dashboards/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
