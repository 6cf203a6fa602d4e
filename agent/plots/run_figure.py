"""One run as a person checks a verdict: the throughput of each iteration and of each one-second
window, the change points, the stretch before the steady state shaded, the peak and the steady
value with its 99% interval, the outliers marked; under it, on the same time axis, the device's
clock, temperature and power against their limits and the clock-event reasons as a timeline (on
a CPU: its frequency and package power).

Every element a reader (or a test) looks for carries an id in the SVG: ``throughput``,
``windows``, ``changepoint-0``.., ``warmup``, ``peak``, ``steady``, ``steady-band``, ``outliers``,
``p10`` and ``p50`` (a run with no steady state),
``panel-<quantity>`` for each panel and ``reason-<name>`` in ``panel-reasons``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent.plots.canvas import pyplot
from agent.plots.run_series import Panel, RunPlot

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

WIDTH = 10.0  # inches
THROUGHPUT_HEIGHT = 3.6
PANEL_HEIGHT = 1.3
REASON_ROW = 0.28
_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def scale_for(values: list[float], unit: str) -> tuple[float, str]:
    """The SI prefix that keeps the throughput axis readable: (factor, "TFLOP/s")."""
    top = max((abs(v) for v in values), default=0.0)
    for factor, prefix in _PREFIXES:
        if top >= factor:
            return factor, f"{prefix}{unit}"
    return 1.0, unit


def draw(plot: RunPlot) -> Figure:
    plt = pyplot()
    reasons = len(plot.reasons)
    heights = [THROUGHPUT_HEIGHT] + [PANEL_HEIGHT] * len(plot.panels)
    timeline = bool(plot.panels) and plot.reasons_panel
    if timeline:
        heights.append(max(0.7, REASON_ROW * (reasons + 1)))
    figure: Figure
    figure, axes = plt.subplots(
        len(heights),
        1,
        sharex=True,
        figsize=(WIDTH, sum(heights) + 0.9),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
        layout="constrained",
    )
    column = [row[0] for row in axes]
    figure.suptitle(plot.title, fontsize=11)
    _throughput(column[0], plot)
    for ax, panel in zip(column[1:], plot.panels, strict=False):
        _panel(ax, panel)
    if timeline:
        _reasons(column[-1], plot)
    column[-1].set_xlabel("seconds from the first iteration")
    if plot.note:  # under the axis label: the layout makes room for it (a figure.text overlapped)
        figure.supxlabel(plot.note, x=0.01, ha="left", fontsize=7, color="0.35")
    return figure


def _throughput(ax: Axes, plot: RunPlot) -> None:
    ax.set_gid("panel-throughput")
    factor, unit = scale_for([*plot.throughput, plot.peak or 0.0], plot.unit)

    def scaled(values: Any) -> list[float]:
        return [value / factor for value in values]

    end = max([*plot.times, *plot.window_times, 0.0])
    if plot.steady_start is not None and plot.steady_start > 0:
        ax.axvspan(
            0.0,
            plot.steady_start,
            color="#f2c14e",
            alpha=0.22,
            lw=0,
            gid="warmup",
            label="before the steady state",
        )
    ax.plot(
        plot.times,
        scaled(plot.throughput),
        ".",
        ms=2.5,
        color="#4c78a8",
        alpha=0.55,
        label="each iteration",
        gid="throughput",
    )
    if plot.window_times:
        ax.step(
            plot.window_times,
            scaled(plot.window_throughput),
            where="mid",
            color="#1b3a5c",
            lw=1.4,
            label="each 1 s window",
            gid="windows",
        )
    if plot.outliers:
        ax.plot(
            [plot.times[i] for i in plot.outliers],
            scaled(plot.throughput[i] for i in plot.outliers),
            "x",
            ms=5,
            color="#d62728",
            label=f"outliers ({len(plot.outliers)})",
            gid="outliers",
        )
    for index, moment in enumerate(plot.changepoints):
        ax.axvline(
            moment,
            color="#9467bd",
            ls="--",
            lw=1.1,
            gid=f"changepoint-{index}",
            label="change point" if index == 0 else None,
        )
    if plot.peak is not None:
        ax.axhline(plot.peak / factor, color="#2ca02c", lw=1.1, gid="peak", label="peak")
    if plot.steady is not None and plot.steady_start is not None:
        if plot.steady_ci is not None:
            low, high = plot.steady_ci
            ax.fill_between(
                [plot.steady_start, end],
                low / factor,
                high / factor,
                color="#ff7f0e",
                alpha=0.25,
                lw=0,
                gid="steady-band",
                label="99% interval",
            )
        ax.hlines(
            plot.steady / factor,
            plot.steady_start,
            end,
            color="#ff7f0e",
            lw=1.8,
            gid="steady",
            label="steady",
        )
    if plot.steady is None:  # no steady state: its windows' p10 and p50 stand for it
        for name, value, style in (("p10", plot.p10, ":"), ("p50", plot.p50, "-.")):
            if value is not None:
                ax.axhline(
                    value / factor, color="#8c564b", ls=style, lw=1.2, gid=name,
                    label=f"{name} of 1 s windows",
                )  # fmt: skip
    ax.set_ylabel(f"throughput ({unit})")
    ax.set_title(_verdict(plot, factor, unit), fontsize=9, loc="left")
    # Out of the data's way: a slowdown ends low, so the top right is free; else the bottom.
    slowdown = plot.classification == "slowdown"
    ax.legend(
        loc="upper right" if slowdown else "lower right", fontsize=7, ncols=4, framealpha=0.85
    )
    ax.set_xlim(0.0, end if end > 0 else 1.0)


def _verdict(plot: RunPlot, factor: float, unit: str) -> str:
    parts = [plot.classification]
    if plot.steady is not None:
        parts.append(f"steady {plot.steady / factor:.4g} {unit}")
    if plot.peak is not None:
        parts.append(f"peak {plot.peak / factor:.4g} {unit}")
    if plot.steady is not None and plot.peak:
        parts.append(f"sustained {plot.steady / plot.peak:.3f} of peak")
    if plot.steady is None and plot.p10 is not None:
        parts.append(f"p10 {plot.p10 / factor:.4g} {unit}")
    text = ", ".join(parts)
    return f"{text}\n{plot.reason}" if plot.reason else text


def _panel(ax: Axes, panel: Panel) -> None:
    ax.set_gid(f"panel-{panel.key}")
    ax.set_ylabel(panel.label, fontsize=8)
    if not panel.values:
        ax.text(
            0.5, 0.5, panel.missing, transform=ax.transAxes, ha="center", va="center", color="0.4"
        )
        ax.set_yticks([])
        return
    ax.plot(panel.times, panel.values, color="#333333", lw=1.0, gid=f"{panel.key}-line")
    if panel.limit is not None:
        ax.axhline(panel.limit, color="#d62728", ls=":", lw=1.1, gid=f"{panel.key}-limit")
        ax.annotate(
            f"{panel.limit_label} {panel.limit:.4g}",
            (1.0, panel.limit),
            xycoords=("axes fraction", "data"),
            ha="right",
            va="bottom",
            fontsize=7,
            color="#d62728",
        )
        ax.set_ylim(min(*panel.values, panel.limit) * 0.95, max(*panel.values, panel.limit) * 1.03)


def _reasons(ax: Axes, plot: RunPlot) -> None:
    ax.set_gid("panel-reasons")
    ax.set_ylabel("clock-event\nreasons", fontsize=8)
    if not plot.reasons:
        ax.text(
            0.5,
            0.5,
            plot.reasons_note or "none active",
            transform=ax.transAxes,
            ha="center",
            va="center",
            color="0.4",
        )
        ax.set_yticks([])
        return
    names = list(plot.reasons)
    for row, name in enumerate(names):
        spans = plot.reasons[name]
        ax.broken_barh(
            [(start, max(end - start, 0.05)) for start, end, _ in spans],
            (row - 0.35, 0.7),
            facecolors=[(0.84, 0.15, 0.16, 0.25 + 0.75 * share) for _, _, share in spans],
            gid=f"reason-{name}",
        )
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_ylim(-0.6, len(names) - 0.4)
    ax.grid(False)
