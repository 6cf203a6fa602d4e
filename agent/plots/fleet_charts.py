"""The charts of the planner's report, each an inline ``<svg>`` (``agent.plots.fleet_page`` puts
them on the page with the figures beside them as text).

Each chart's marks carry ids (``median``, ``p10``, ``peak``, ``spec``, ``ratio``, ``solo``,
``node-wide``, ``drift``, ``stack-change``, ``health-change``, ``thermal``, ``power``) so that a
reader of the SVG, or a test, finds what was drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from agent.plots.canvas import inline_svg, pyplot
from agent.plots.run_figure import scale_for
from agent.reports.capacity import SCOPE_SHOWN
from agent.reports.fleet import HotSpot, ThroughputRow, TimelineEvent

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

WIDTH = 9.0
ROW = 0.32
MAX_ROWS = 40


@dataclass(frozen=True, slots=True)
class Chart:
    svg: str
    marks: int  # data points drawn: a chart with none is not drawn at all


def _figure(rows: int, extra: float = 1.2) -> tuple[Figure, Axes]:
    plt = pyplot()
    figure, ax = plt.subplots(figsize=(WIDTH, ROW * max(rows, 2) + extra), layout="constrained")
    return figure, ax


Bars = tuple[list[float], str, str, str]  # values, colour, label, id


def _paired_bars(ax: Axes, y: list[int], first: Bars, second: Bars) -> None:
    """Two bars per row, the first above the second."""
    for (values, colour, label, gid), shift in ((first, -0.4), (second, 0.4)):
        ax.barh([v + shift for v in y], values, height=0.8, color=colour, label=label, gid=gid)


def row_label(row: ThroughputRow) -> str:
    c = row.capacity
    scope = SCOPE_SHOWN.get(c.scope, c.scope)
    size = "" if c.size in (None, "default") else f", {c.size}"
    basis = "" if c.basis == "steady" else f", {c.basis} basis"
    return f"{c.group or 'unknown model'} · {c.precision} {c.optimization} ({scope}{size}{basis})"


def throughput_chart(rows: Sequence[ThroughputRow]) -> Chart:
    """One workload and unit: the median of each model x precision as a bar, its p10, the runs'
    mean peak and the published spec as marks."""
    rows = list(rows)[:MAX_ROWS]
    unit = rows[0].capacity.unit or ""
    values = [v for r in rows for v in (r.capacity.median, r.peak or 0.0, r.spec or 0.0)]
    factor, shown = scale_for(values, unit)
    figure, ax = _figure(len(rows))
    y = list(range(len(rows)))
    ax.barh(
        y,
        [r.capacity.median / factor for r in rows],
        color="#4c78a8",
        label="median",
        gid="median",
        height=0.6,
    )
    ax.plot(
        [r.capacity.p10 / factor for r in rows],
        y,
        "|",
        ms=14,
        mew=2.2,
        color="#1b3a5c",
        label="p10",
        gid="p10",
    )
    peaks = [(r.peak / factor, i) for i, r in enumerate(rows) if r.peak is not None]
    if peaks:
        ax.plot(
            *zip(*peaks, strict=True), "^", color="#2ca02c", label="peak (mean of runs)", gid="peak"
        )
    specs = [(r.spec / factor, i) for i, r in enumerate(rows) if r.spec is not None]
    if specs:
        ax.plot(
            *zip(*specs, strict=True),
            "D",
            color="#d62728",
            ms=5,
            label="published spec",
            gid="spec",
        )
    ax.set_yticks(y, [row_label(r) for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"sustained throughput ({shown})")
    ax.set_xlim(left=0)
    figure.legend(loc="outside lower center", fontsize=7, ncols=4)
    return Chart(inline_svg(figure), len(rows))


def ratio_chart(rows: Sequence[ThroughputRow]) -> Chart:
    """Mean sustained ratio (steady / peak) per model and probe, with the lowest run's."""
    shown = [r for r in rows if r.sustained_ratio is not None][:MAX_ROWS]
    figure, ax = _figure(len(shown))
    y = list(range(len(shown)))
    ax.barh(
        y,
        [r.sustained_ratio or 0.0 for r in shown],
        color="#f58518",
        height=0.6,
        label="mean of the runs",
        gid="ratio",
    )
    lowest = [(r.min_sustained_ratio, i) for i, r in enumerate(shown)]
    points = [(value, i) for value, i in lowest if value is not None]
    if points:
        ax.plot(
            *zip(*points, strict=True),
            "|",
            ms=14,
            mew=2.2,
            color="#7f3b08",
            label="lowest run",
            gid="ratio-min",
        )
    labels = [
        f"{r.capacity.group or 'unknown model'} · {r.capacity.workload} "
        f"{r.capacity.precision} ({SCOPE_SHOWN.get(r.capacity.scope, r.capacity.scope)})"
        for r in shown
    ]
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.05)
    ax.axvline(1.0, color="0.5", lw=0.8)
    ax.set_xlabel("sustained ratio: steady / peak of the same run")
    figure.legend(loc="outside lower center", fontsize=7, ncols=2)
    return Chart(inline_svg(figure), len(shown))


def coupling_chart(pairs: Sequence[tuple[ThroughputRow, ThroughputRow]]) -> Chart:
    """Solo against node-wide medians of the same model and probe."""
    pairs = list(pairs)[:MAX_ROWS]
    figure, ax = _figure(len(pairs) * 2)
    unit = pairs[0][0].capacity.unit or ""
    factor, shown = scale_for([p.capacity.median for pair in pairs for p in pair], unit)
    y = [2 * i for i in range(len(pairs))]
    _paired_bars(
        ax,
        y,
        ([s.capacity.median / factor for s, _ in pairs], "#4c78a8", "solo", "solo"),
        (
            [n.capacity.median / factor for _, n in pairs],
            "#e45756",
            "node-wide (every device at once)",
            "node-wide",
        ),
    )
    for (solo, node), v in zip(pairs, y, strict=True):
        ratio = node.capacity.median / solo.capacity.median if solo.capacity.median else 0.0
        ax.annotate(
            f"{ratio:.1%}",
            (node.capacity.median / factor, v + 0.4),
            fontsize=7,
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
        )
    labels = [
        f"{s.capacity.group or 'unknown model'} · {s.capacity.workload} {s.capacity.precision}"
        + ("" if s.capacity.basis == "steady" else f" ({s.capacity.basis} basis)")
        for s, _ in pairs
    ]
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"median sustained throughput per device ({shown})")
    figure.legend(loc="outside lower center", fontsize=7, ncols=2)
    return Chart(inline_svg(figure), 2 * len(pairs))


_EVENT_STYLE = {
    "drift": ("v", "#d62728", "drift (regression v, improvement ^)"),
    "stack_changed": ("s", "#1f77b4", "stack change"),
    "health_change": ("o", "#ff7f0e", "health change"),
}


def timeline_chart(events: Sequence[TimelineEvent]) -> Chart:
    """Drift, stack changes and health changes per node and device, on one time axis."""
    rows = sorted({(e.node, e.device) for e in events})
    where = {key: i for i, key in enumerate(rows)}
    figure, ax = _figure(len(rows), extra=1.6)
    for kind, (marker, colour, label) in _EVENT_STYLE.items():
        chosen = [e for e in events if e.kind == kind]
        if not chosen:
            continue
        if kind == "drift":
            labelled = False
            for improvement, sign, tint in ((False, "v", colour), (True, "^", "#2ca02c")):
                picked = [
                    (e.occurred_at, where[(e.node, e.device)])
                    for e in chosen
                    if (e.attributes.get("direction") == "improvement") == improvement
                ]
                if picked:
                    ax.plot(
                        *zip(*picked, strict=True),
                        sign,
                        ms=8,
                        ls="none",
                        color=tint,
                        gid="drift",
                        label=None if labelled else label,
                    )
                    labelled = True
            continue
        times: Any = [e.occurred_at for e in chosen]  # matplotlib's date units take datetimes
        ys = [where[(e.node, e.device)] for e in chosen]
        ax.plot(
            times,
            ys,
            marker,
            ms=7,
            ls="none",
            color=colour,
            label=label,
            gid=kind.replace("_", "-").replace("changed", "change"),
        )
        if kind == "stack_changed":
            for moment in times:
                ax.axvline(cast(Any, moment), color=colour, lw=0.6, alpha=0.4)
    ax.set_yticks(range(len(rows)), [f"{node} {device[:18]}" for node, device in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (UTC)")
    ax.tick_params(axis="x", labelrotation=30)
    figure.legend(loc="outside lower center", fontsize=7, ncols=3)
    return Chart(inline_svg(figure), len(events))


def hot_spot_chart(spots: Sequence[HotSpot]) -> Chart:
    """The devices whose steady segments spent the most time under a thermal or power reason."""
    shown = [s for s in spots if s.thermal_share is not None or s.power_share is not None]
    shown = shown[:MAX_ROWS]
    figure, ax = _figure(len(shown) * 2)
    y = [2 * i for i in range(len(shown))]
    _paired_bars(
        ax,
        y,
        ([s.thermal_share or 0.0 for s in shown], "#d62728", "thermal", "thermal"),
        ([s.power_share or 0.0 for s in shown], "#9467bd", "power (cap or brake)", "power"),
    )
    ax.set_yticks(
        y,
        [f"{s.node} {s.device_label} ({s.device_model or 'unknown model'})" for s in shown],
        fontsize=8,
    )
    ax.invert_yaxis()
    ax.set_xlim(0, 1.0)
    ax.set_xlabel("mean share of the steady segment with the clocks held by a reason")
    figure.legend(loc="outside lower center", fontsize=7, ncols=2)
    return Chart(inline_svg(figure), 2 * len(shown))
