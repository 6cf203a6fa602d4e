"""sustain / Stack and drift: what changed in the software stack, and what it did to throughput.

Stack changes and drift are annotations on the throughput graphs, so that a lasting change of
throughput lines up with the stack change that may explain it.
"""

from __future__ import annotations

from panels import (
    PROBE,
    PROBE_COLUMNS,
    PROBE_LABELS,
    PROBE_LEGEND,
    SOLO,
    Board,
    Json,
    Q,
    annotation,
    bargauge,
    by_name,
    probe_variables,
    stack_change_annotation,
    stat,
    table,
    thresholds,
    throughput,
    timeseries,
    value_map,
)

DRIFT_LABELS = f"{PROBE_LABELS}, direction, cause"


def stack_and_drift() -> Json:
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
            f"max by ({DRIFT_LABELS}) "
            f"(sustain_drift_last_change_timestamp_seconds{{{PROBE}}}) * 1000",
            color="purple",
            title="Drift: {{direction}} ({{cause}})",
            text_format="{{instance}} {{device}} {{workload}} {{precision}} {{optimization}}",
            tag_keys="direction,cause",
            value_is_time=True,
        )
    )

    _throughput(board)
    _current_stack(board)
    _drift(board)
    _drift_detection_health(board)
    return board.to_json()


def _throughput(board: Board) -> None:
    board.row("Throughput, stack changes (orange) and drift (purple)")
    board.add(
        timeseries(
            "Steady throughput",
            "The steady throughput of each probe's latest run. Orange marks: this node's "
            "stack changed. Purple marks: the first result after a lasting change (drift).",
            [
                Q(
                    throughput(PROBE, SOLO, 'stat="steady"'),
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


def _current_stack(board: Board) -> None:
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


def _drift(board: Board) -> None:
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
                Q(f"max by ({DRIFT_LABELS}) (sustain_drift_last_change_ratio{{{PROBE}}})"),
                Q(
                    f"max by ({DRIFT_LABELS}) "
                    f"(sustain_drift_last_change_timestamp_seconds{{{PROBE}}}) * 1000"
                ),
                Q(f"max by ({DRIFT_LABELS}) (sustain_drift_last_change_ratio{{{PROBE}}}) - 1"),
            ],
            columns={"Value #B": "Detected"}
            | PROBE_COLUMNS
            | {
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


def _drift_detection_health(board: Board) -> None:
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
