"""The planner's report as one self-contained HTML file: inline SVG charts, the figures beside
them as text, a style sheet in the page, and nothing fetched: no script, font or image from
anywhere, which the page's Content-Security-Policy also forbids (``default-src 'none'``), so the
file can be mailed around and opened offline.

Sections, each an element with an id: ``throughput`` (per model x precision: median, p10, the
runs' mean peak, the published spec), ``ratio`` (sustained ratio per model), ``coupling``
(node-wide against solo), ``timeline`` (drift, stack and health changes), ``outliers``,
``hot-spots`` (throttling) and ``methods``. A chart is drawn only where it has data; a section
without any says so in words.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from itertools import groupby
from typing import TYPE_CHECKING

from agent.plots import fleet_charts
from agent.plots.fleet_charts import Chart, row_label
from agent.reports.capacity import SCOPE_SHOWN, RunsCounted
from agent.reports.capacity_output import LEFT_OUT_SHOWN, human
from agent.reports.fleet import FleetData, ThroughputRow, coupling_pairs

if TYPE_CHECKING:
    from agent.drift.detect import Outlier

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222;
       padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 12px; }
th, td { border-bottom: 1px solid #e4e4e4; padding: 0.25em 0.6em; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
figure.chart { margin: 0.8em 0; } figure.chart svg { max-width: 100%; height: auto; }
.empty { color: #666; font-style: italic; } .lead { color: #555; }
"""
SHORT_STACK = 12
BASIS_SHOWN = {"steady": "steady", "p10": "p10 (no steady state)"}


def render(data: FleetData, outliers: Sequence[Outlier], outlier_ratio: float) -> str:
    period = (
        "every result in the archive"
        if data.since is None
        else (f"results since {data.since:%Y-%m-%d %H:%M} UTC")
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>sustain: the fleet's sustained capacity</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>The fleet's sustained capacity</h1>",
        f'<p class="lead" id="period">{_e(period)}; generated '
        f"{data.generated_at:%Y-%m-%d %H:%M} UTC by sustain report fleet. "
        f"{_counted(data.results, 'analysed result')} from {_counted(data.devices, 'device')} "
        f"on {_counted(data.nodes, 'node')}.</p>",
        f'<p class="lead" id="runs">{_e(runs_used(data.runs))}</p>',
    ]
    if data.empty:
        parts.append(
            '<p class="empty" id="empty">The archive holds no analysed probe results for '
            f"{_e(period)}: nothing to report yet. Archive some runs (the agent, or sustain "
            "probe --record) and make the report again.</p>"
        )
    else:
        parts += _throughput(data.throughput)
        parts += _ratio(data.throughput)
        parts += _coupling(data.throughput)
        parts += _timeline(data)
        units = {row.capacity.workload: row.capacity.unit for row in data.throughput}
        parts += _outliers(outliers, outlier_ratio, units)
        parts += _hot_spots(data)
    parts += _methods(data)
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _chart(chart_id: str, chart: Chart, caption: str) -> str:
    return (
        f'<figure class="chart" id="chart-{chart_id}" data-marks="{chart.marks}">{chart.svg}'
        f"<figcaption>{_e(caption)}</figcaption></figure>"
    )


def _table(head: Iterable[str], rows: Iterable[Iterable[object]], numeric: int = 0) -> str:
    """A table; the last ``numeric`` columns are right-aligned figures."""
    header = list(head)
    first_number = len(header) - numeric
    lines = ["<table><thead><tr>", *(f"<th>{_e(h)}</th>" for h in header), "</tr></thead><tbody>"]
    for row in rows:
        cells = [
            f'<td class="n">{_e(v)}</td>' if i >= first_number else f"<td>{_e(v)}</td>"
            for i, v in enumerate(row)
        ]
        lines.append("<tr>" + "".join(cells) + "</tr>")
    lines.append("</tbody></table>")
    return "".join(lines)


def _maybe(value: float | None, unit: str | None) -> str:
    return "-" if value is None else human(value, unit)


def runs_used(runs: RunsCounted) -> str:
    """The runs behind the page's figures, by basis, and those left out, by reason, in words."""
    used = (
        f"The figures rest on {runs.used} runs: {runs.steady} on a steady basis (the work "
        f"over time of their steady state) and {runs.p10} on a p10 basis (runs that never "
        "settled, counted on their 10th percentile over one-second windows)."
    )
    reasons = [
        f"{count} {LEFT_OUT_SHOWN.get(reason, reason)}"
        for reason, count in runs.left_out.items()
        if count
    ]
    if not reasons:
        return f"{used} No run was left out."
    return f"{used} Left out: {runs.left_out_total} runs ({', '.join(reasons)})."


def _throughput(rows: Sequence[ThroughputRow]) -> list[str]:
    parts = [
        '<section id="throughput"><h2>Sustained throughput per GPU model and precision</h2>',
        "<p>The bar is the median of the runs' steady-state throughput, the tick their 10th "
        "percentile (9 results in 10 were at least this); the triangle is the runs' mean peak "
        "(the best 5% window of each run), the diamond the model's published dense peak. Runs "
        "that never settled count on their p10 over one-second windows instead, in rows of "
        "their own marked basis p10 (never mixed with the steady ones).</p>",
    ]
    ordered = sorted(rows, key=lambda r: (r.capacity.workload, r.capacity.unit or ""))
    sections = groupby(ordered, key=lambda r: (r.capacity.workload, r.capacity.unit or ""))
    for index, ((workload, unit), group) in enumerate(sections):
        items = list(group)
        caption = f"{workload}, in {unit or 'its unit'}"
        parts.append(f"<h3>{_e(caption)}</h3>")
        chart = fleet_charts.throughput_chart(items)
        parts.append(_chart(f"throughput-{index}-{workload}", chart, caption))
        parts.append(
            _table(
                [
                    "model",
                    "precision",
                    "optimization",
                    "size",
                    "scope",
                    "basis",
                    "median",
                    "p10",
                    "peak",
                    "spec",
                    "median / spec",
                    "results",
                    "devices",
                ],
                (_throughput_cells(r) for r in items),
                numeric=7,
            )
        )
    parts.append("</section>")
    return parts


def _throughput_cells(row: ThroughputRow) -> list[object]:
    c = row.capacity
    return [
        c.group or "unknown model",
        c.precision,
        c.optimization,
        c.size or "-",
        SCOPE_SHOWN.get(c.scope, c.scope),
        BASIS_SHOWN.get(c.basis, c.basis),
        human(c.median, c.unit),
        human(c.p10, c.unit),
        _maybe(row.peak, c.unit),
        _maybe(row.spec, c.unit),
        "-" if c.spec_ratio is None else f"{c.spec_ratio:.1%}",
        c.results,
        c.devices,
    ]


def _ratio(rows: Sequence[ThroughputRow]) -> list[str]:
    parts = [
        '<section id="ratio"><h2>Sustained ratio per model</h2>',
        "<p>Steady over peak within each run: how much of its own best a device keeps once "
        "warm-up, boost and throttling have played out.</p>",
    ]
    shown = [r for r in rows if r.sustained_ratio is not None]
    if not shown:
        parts.append('<p class="empty">No run stated a sustained ratio.</p></section>')
        return parts
    parts.append(_chart("ratio", fleet_charts.ratio_chart(shown), "sustained ratio per model"))
    parts.append(
        _table(
            ["model", "workload", "precision", "scope", "mean ratio", "lowest run", "results"],
            (
                [
                    r.capacity.group or "unknown model",
                    r.capacity.workload,
                    r.capacity.precision,
                    SCOPE_SHOWN.get(r.capacity.scope, r.capacity.scope),
                    f"{r.sustained_ratio:.1%}",
                    "-" if r.min_sustained_ratio is None else f"{r.min_sustained_ratio:.1%}",
                    r.capacity.results,
                ]
                for r in shown
                if r.sustained_ratio is not None
            ),
            numeric=3,
        )
    )
    parts.append("</section>")
    return parts


def _coupling(rows: Sequence[ThroughputRow]) -> list[str]:
    parts = [
        '<section id="coupling"><h2>Node-wide against solo</h2>',
        "<p>The same probe on one device alone, and on each device while every device of its "
        "node runs it at once (what production sees): plan with the node-wide figure.</p>",
    ]
    pairs = coupling_pairs(rows)
    if not pairs:
        parts.append('<p class="empty">No node-wide runs in this period.</p></section>')
        return parts
    by_unit = sorted(pairs, key=lambda pair: pair[0].capacity.unit or "")
    for unit, group in groupby(by_unit, key=lambda pair: pair[0].capacity.unit or ""):
        items = list(group)
        parts.append(_chart(f"coupling-{unit}", fleet_charts.coupling_chart(items), f"in {unit}"))
    parts.append(
        _table(
            ["model · probe", "solo median", "node-wide median", "node-wide / solo"],
            (
                [
                    row_label(solo),
                    human(solo.capacity.median, solo.capacity.unit),
                    human(node.capacity.median, node.capacity.unit),
                    f"{node.capacity.median / solo.capacity.median:.1%}",
                ]
                for solo, node in pairs
            ),
            numeric=3,
        )
    )
    parts.append("</section>")
    return parts


def _timeline(data: FleetData) -> list[str]:
    parts = [
        '<section id="timeline"><h2>Drift, stack changes and health changes</h2>',
        "<p>Lasting changes in a device's sustained throughput (drift, with its cause), changes "
        "of the software stack results ran on, and changes of a device's health verdict.</p>",
    ]
    if not data.events:
        parts.append('<p class="empty">No drift, stack or health change in this period.</p>')
        parts.append("</section>")
        return parts
    parts.append(_chart("timeline", fleet_charts.timeline_chart(data.events), "events"))
    parts.append(
        _table(
            ["when (UTC)", "node", "device", "kind", "what"],
            (
                [f"{e.occurred_at:%Y-%m-%d %H:%M}", e.node, e.device, e.kind, e.message]
                for e in data.events
            ),
        )
    )
    parts.append("</section>")
    return parts


def _outliers(outliers: Sequence[Outlier], ratio: float, units: dict[str, str | None]) -> list[str]:
    parts = [
        '<section id="outliers"><h2>The fleet\'s outliers</h2>',
        f"<p>Devices whose recent median is more than {ratio:.0%} below the median of their "
        "peers: the same model, stack and probe, at least three devices (as sustain drift "
        "finds them).</p>",
    ]
    if not outliers:
        parts.append('<p class="empty">No device stands out from its peers.</p></section>')
        return parts
    parts.append(
        _table(
            [
                "node",
                "device",
                "model",
                "probe",
                "recent median",
                "peers' median",
                "ratio",
                "peers",
            ],
            (
                [
                    o.node,
                    o.device_label,
                    o.device_model or "unknown model",
                    f"{o.workload} {o.precision} {o.optimization}",
                    human(o.value, units.get(o.workload)),
                    human(o.peer_median, units.get(o.workload)),
                    f"{o.ratio:.1%}",
                    o.peers,
                ]
                for o in outliers
            ),
            numeric=4,
        )
    )
    parts.append("</section>")
    return parts


def _hot_spots(data: FleetData) -> list[str]:
    parts = [
        '<section id="hot-spots"><h2>Throttling hot spots</h2>',
        "<p>The share of each device's steady segments with the clocks held by a thermal or a "
        "power reason (means over its results), and the throttle episodes its agent "
        "recorded.</p>",
    ]
    spots = [s for s in data.hot_spots if s.score > 0 or s.episodes]
    if not spots:
        parts.append('<p class="empty">No throttling recorded in this period.</p></section>')
        return parts
    if any(s.thermal_share is not None or s.power_share is not None for s in spots):
        parts.append(_chart("hot-spots", fleet_charts.hot_spot_chart(spots), "throttling"))
    parts.append(
        _table(
            ["node", "device", "model", "episodes", "results", "thermal share", "power share"],
            (
                [
                    s.node,
                    s.device_label,
                    s.device_model or "unknown model",
                    ", ".join(
                        f"{reason} {count}x {seconds:.0f} s"
                        for reason, (count, seconds) in s.episodes.items()
                    )
                    or "-",
                    s.results,
                    "-" if s.thermal_share is None else f"{s.thermal_share:.1%}",
                    "-" if s.power_share is None else f"{s.power_share:.1%}",
                ]
                for s in spots
            ),
            numeric=3,
        )
    )
    parts.append("</section>")
    return parts


def _methods(data: FleetData) -> list[str]:
    tolerance = ", ".join(f"{t:.0%}" for t in data.tolerances) or "2% (the default)"
    outcomes = ", ".join(f"{n} {name}" for name, n in sorted(data.outcomes.items())) or "none"
    parts = [
        '<section id="methods"><h2>Methods</h2>',
        f"<p>Runs in the period, by outcome: {_e(outcomes)}. Every analysed ok run counts as a "
        "result: on its steady value where it has a steady state, else on its 10th percentile "
        "over one-second windows (the p10 basis: what a run that never settled delivered), the "
        "two never in one row. Runs that failed, timed out, were preempted or aborted, and ok "
        "runs too short to judge or without a figure, are left out, and counted at the top of "
        "the page. Skipped and unsupported probes never ran.</p>",
        "<p>Each probe runs a workload for a fixed time and records every iteration. The steady "
        "state is decided per run: outliers are set aside by Barrett et al.'s rule, change "
        "points in the mean are found by PELT on the series in units of its noise, and the "
        "segments equivalent to the last one (within a relative tolerance of "
        f"{_e(tolerance)}, or the 99% interval of their difference) form the steady regime, "
        "which must cover the last quarter of the run with no oscillation or drift left in it. "
        "The steady value is the regime's mean with a bootstrap 99% interval; the peak is the "
        "best window of 5% of the run; the sustained ratio is steady over peak. Results of "
        "different problem sizes or scopes (solo, node-wide) are never mixed.</p>",
    ]
    if data.probes:
        parts.append("<h3>What was run</h3>")
        parts.append(
            _table(
                ["workload", "precision", "optimization", "size", "scope", "results", "devices"],
                (
                    [
                        p.workload,
                        p.precision,
                        p.optimization,
                        p.size or "-",
                        SCOPE_SHOWN.get(p.scope, p.scope),
                        p.results,
                        p.devices,
                    ]
                    for p in data.probes
                ),
                numeric=2,
            )
        )
    if data.stacks:
        parts.append("<h3>Stacks covered</h3>")
        parts.append(
            _table(
                ["stack", "driver", "CUDA driver", "torch", "results", "nodes"],
                (
                    [
                        (s.stack_id or "not recorded")[:SHORT_STACK],
                        s.driver or "-",
                        s.cuda or "-",
                        s.torch or "-",
                        s.results,
                        s.nodes,
                    ]
                    for s in data.stacks
                ),
                numeric=2,
            )
        )
    parts.append("</section>")
    return parts


def _counted(count: int, noun: str) -> str:
    """``1 device``, ``2 devices``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
