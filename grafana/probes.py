"""sustain / Probes: what the probes measure, sustained against peak, and why they differ.

Classifications and slowdown causes are drawn as state timelines of coded series, so that a
change of verdict between runs shows as a change of colour.
"""

from __future__ import annotations

from collections.abc import Sequence

from panels import (
    PROBE,
    PROBE_COLUMNS,
    PROBE_LABELS,
    PROBE_LEGEND,
    SOLO,
    WORK_PER_JOULE_UNITS,
    Board,
    Json,
    Q,
    bargauge,
    by_name,
    by_ref,
    probe_variables,
    stack_change_annotation,
    state_timeline,
    table,
    thresholds,
    throughput,
    timeseries,
    value_map,
)

CLASSIFICATIONS = ("flat", "warmup", "slowdown", "no_steady_state", "insufficient")
SLOWDOWN_CAUSES = ("thermal", "power_brake", "power_cap", "clock_unexplained", "not_clock_bound")


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
    "preempted": "yellow",
}


def probes() -> Json:
    board = Board(
        "sustain-probes",
        "sustain / Probes",
        "Probe results: sustained against peak per workload and precision, warm-up, the "
        "classification of each run and the cause of a slowdown, work per joule, inference "
        "latency, runs by outcome, preemptions and the duty cycle.",
        probe_variables(),
    )
    board.annotations.append(stack_change_annotation('instance=~"$instance"'))

    _sustained_against_peak(board)
    _warmup_and_slowdowns(board)
    _efficiency_and_latency(board)
    _runs_and_duty_cycle(board)
    return board.to_json()


def _plan_with(by: str) -> str:
    """The figure a planner can use: steady where the run has one, else its windowed p10."""
    return (
        f"{by} (" + throughput(PROBE, SOLO, 'stat="steady"') + f")"
        f" or {by} (" + throughput(PROBE, SOLO, 'stat="p10"') + ")"
    )


def _sustained_against_peak(board: Board) -> None:
    board.row("Sustained against peak")
    by = f"max by ({PROBE_LABELS}, unit)"
    board.add(
        table(
            "Peak and steady throughput, latest run",
            "Peak: the best short window of the latest ok run. Steady: its work over time in its "
            "steady state. Sustained: steady over peak. p10: the 10th percentile over one-second "
            "windows, stated even for a run that never settled. Plan with: the steady value where "
            "there is one, else the p10, as Basis says. In the probe's unit.",
            [
                Q(f"{by} (" + throughput(PROBE, SOLO, 'stat="peak"') + ")"),
                Q(f"{by} (" + throughput(PROBE, SOLO, 'stat="steady"') + ")"),
                Q(
                    f"{by} (" + throughput(PROBE, SOLO, 'stat="steady"') + f")"
                    f" / {by} (" + throughput(PROBE, SOLO, 'stat="peak"') + ")"
                ),
                Q(f"{by} (" + throughput(PROBE, SOLO, 'stat="p10"') + ")"),
                Q(_plan_with(by)),
                Q(
                    f"{by} (" + throughput(PROBE, SOLO, 'stat="steady"') + f") * 0 + 1"
                    f" or {by} (" + throughput(PROBE, SOLO, 'stat="p10"') + ") * 0"
                ),
            ],
            columns=PROBE_COLUMNS
            | {
                "unit": "Unit",
                "Value #A": "Peak",
                "Value #B": "Steady",
                "Value #C": "Sustained",
                "Value #D": "p10",
                "Value #E": "Plan with",
                "Value #F": "Basis",
            },
            unit="short",
            overrides=[
                by_name(
                    "Basis",
                    (
                        "mappings",
                        value_map(
                            {
                                "1": ("steady", "green"),
                                "0": ("p10 (no steady state)", "orange"),
                            }
                        ),
                    ),
                    ("custom.cellOptions", {"type": "color-text"}),
                ),
                by_name(
                    "Sustained",
                    ("unit", "percentunit"),
                    ("decimals", 1),
                    ("custom.cellOptions", {"type": "color-text"}),
                    ("thresholds", thresholds((None, "red"), (0.85, "orange"), (0.95, "green"))),
                ),
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
                    throughput(PROBE, SOLO, 'stat="peak"'),
                    f"{PROBE_LEGEND} peak ({{{{unit}}}})",
                ),
                Q(
                    throughput(PROBE, SOLO, 'stat="steady"'),
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


def _warmup_and_slowdowns(board: Board) -> None:
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
            columns=PROBE_COLUMNS
            | {
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


def _efficiency_and_latency(board: Board) -> None:
    board.row("Efficiency and latency")
    board.add(
        timeseries(
            "Work per joule",
            "Work of each run over the energy it used (GPU energy counter; RAPL package "
            "energy on the CPU), in the probe's work unit per joule.",
            [
                Q(
                    throughput(PROBE, families=WORK_PER_JOULE_UNITS),
                    f"{PROBE_LEGEND} ({{{{unit}}}})",
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


def _runs_and_duty_cycle(board: Board) -> None:
    board.row("Runs and duty cycle")
    board.add(
        timeseries(
            "Probe runs by outcome",
            "Runs per hour (over the trailing hour) by outcome: ok, failed, timeout, "
            "unsupported, skipped (other processes on the GPU, a busy device, the duty-cycle "
            "budget spent), aborted (the agent stopped during the run) and preempted "
            "(production work arrived on the device during the run).",
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
            columns=PROBE_COLUMNS
            | {
                "Value": "Since last run",
            },
            unit="s",
            sort_by="Since last run",
        ),
        12,
        8,
    )
    preemptions = f"sustain_probe_preemptions_total{{{PROBE}}}"
    board.add(
        timeseries(
            "Preemptions",
            "Probe runs stopped because production work arrived on their device (a compute "
            "process that is not the agent's on the GPU, or a process taking more than "
            "probing.preempt_cpu_share of the CPUs): the probe yields within a second and the "
            "run counts for no result.",
            [
                Q(
                    f"sum by (instance, device) (increase({preemptions}[$__rate_interval]))",
                    "{{instance}} {{device}}",
                )
            ],
            unit="short",
            minimum=0,
            bars=True,
        ),
        12,
        8,
    )
    board.add(
        table(
            "Preemptions over the time range",
            "Preempted runs of each probe over the dashboard's time range, most first. Many: "
            "the probe's schedule meets production work; its results are stale while it keeps "
            "yielding.",
            [Q(f"sum by ({PROBE_LABELS}) (increase({preemptions}[$__range]))")],
            columns=PROBE_COLUMNS
            | {
                "Value": "Preempted runs",
            },
            decimals=0,
            sort_by="Preempted runs",
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
