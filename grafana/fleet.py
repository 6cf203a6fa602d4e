"""sustain / Fleet: capacity planning and the fleet's health, across every agent of a job.

Throughput is grouped by GPU model through sustain_gpu_info (joined on instance and uuid), since
only identical devices are comparable; a device is an outlier against its identical peers.
"""

from __future__ import annotations

from panels import (
    SOLO,
    Board,
    Json,
    Q,
    bargauge,
    by_name,
    datasource_variable,
    query_variable,
    stat,
    table,
    thresholds,
    throughput,
    timeseries,
)

# Clock-event reasons that hold the clocks down (the others are idle, application clocks,
# sync boost, display clock: not throttling).
THROTTLE_REASONS = (
    "sw_power_cap|hw_slowdown|sw_thermal_slowdown|hw_thermal_slowdown|hw_power_brake_slowdown"
)

JOB = 'job=~"$job"'
JOB_PROBE = f'{JOB}, workload=~"$workload", precision=~"$precision"'
GPU_INFO = f'sustain_gpu_info{{{JOB}, name=~"$model"}}'
WITH_MODEL = f"on (instance, uuid) group_left (name) {GPU_INFO}"
# The labels that name one probe of one device, on every probe family.
SAME_PROBE = "job, instance, device, uuid, workload, precision, optimization"


def fleet() -> Json:
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

    _agents(board)
    _health(board)
    _capacity(board)
    _outliers(board)
    _throttling(board)
    _stacks(board)
    return board.to_json()


def _agents(board: Board) -> None:
    board.row("Agents")
    board.add(
        stat("Agents up", "Scrape targets of the job(s) that answer.", [Q(f"sum(up{{{JOB}}})")]),
        4,
        4,
    )
    board.add(
        stat(
            "Agents down",
            "Scrape targets of the job(s) that do not answer (listed below).",
            [Q(f"count(up{{{JOB}}} == 0) or vector(0)")],
            steps=thresholds((None, "green"), (1, "red")),
        ),
        4,
        4,
    )
    board.add(stat("GPUs", "GPUs the agents see.", [Q(f"count({GPU_INFO})")]), 4, 4)
    board.add(
        stat(
            "GPUs lost",
            "GPUs NVML reports lost (sustain_gpu_healthy 0).",
            [Q(f"count(sustain_gpu_healthy{{{JOB}}} == 0) or vector(0)")],
            steps=thresholds((None, "green"), (1, "red")),
        ),
        4,
        4,
    )
    board.add(
        stat(
            "Stalled samplers",
            "Sampler loops that finished no poll in time (/healthz answers 503).",
            [Q(f"count(sustain_sampler_stalled{{{JOB}}} == 1) or vector(0)")],
            steps=thresholds((None, "green"), (1, "red")),
        ),
        4,
        4,
    )
    board.add(
        stat(
            "Archive writes waiting",
            "Writes in the agents' spools, not yet in the database.",
            [Q(f"sum(sustain_archive_spool_items{{{JOB}}})")],
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
            [Q(f"sort(up{{{JOB}}})")],
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
            [Q(f"count by (version) (sustain_build_info{{{JOB}}})", "{{version}}", instant=True)],
            unit="short",
            minimum=0,
        ),
        12,
        6,
    )


def _health(board: Board) -> None:
    board.row("Health")
    board.add(
        stat(
            "Devices not healthy",
            "Devices (GPUs, MIG devices, CPUs) whose health verdict is degraded or unhealthy "
            "(listed below): the fleet's one is-it-good number, before and after an upgrade.",
            [Q(f'sum(state:sustain_device_health:count{{{JOB}, state!="healthy"}}) or vector(0)')],
            steps=thresholds((None, "green"), (1, "orange")),
        ),
        6,
        6,
    )
    board.add(
        table(
            "Devices not healthy, and why",
            "Every reason a device is degraded or unhealthy now (docs/health.md); "
            "`sustain health` on the node gives the evidence.",
            [Q(f"sustain_device_health_reason{{{JOB}}} == 1")],
            columns={"instance": "Node", "device": "Device", "uuid": "UUID", "reason": "Reason"},
            sort_by="Node",
            descending=False,
        ),
        18,
        6,
    )


def _sustained(matchers: str) -> str:
    """Each device's sustained figure, as the capacity rules record it, its `stat` the basis:
    the steady value of its latest run, else, where that run never settled, its p10 over
    one-second windows (a run too short to judge counts on neither)."""
    steady = throughput(matchers, SOLO, 'stat="steady"')
    p10 = throughput(matchers, SOLO, 'stat="p10"')
    unsettled = f'sustain_probe_classification{{{matchers}, classification="no_steady_state"}}'
    return f"{steady} or {p10} and on ({SAME_PROBE}) {unsettled}"


def _capacity(board: Board) -> None:
    board.row("Capacity: sustained throughput per GPU model")
    sustained = f"({_sustained(JOB_PROBE)}) * {WITH_MODEL}"
    capacity = "name, workload, precision, optimization, unit, stat"
    board.add(
        table(
            "Sustained throughput per GPU model and precision",
            "The sustained figure of the latest run of every device, per GPU model (from "
            "sustain_gpu_info), workload, precision and basis: steady (the work over time of the "
            "steady state) or, for a run that never settled, p10 (its 10th percentile over "
            "one-second windows), never mixed. Median, 10th percentile (what 90 % of the devices "
            "sustain at least) and the devices on each basis; the runs left out are below.",
            [
                Q(f"quantile by ({capacity}) (0.5, {sustained})"),
                Q(f"quantile by ({capacity}) (0.1, {sustained})"),
                Q(f"count by ({capacity}) ({sustained})"),
            ],
            columns={
                "name": "GPU model",
                "workload": "Workload",
                "precision": "Precision",
                "optimization": "Optimization",
                "unit": "Unit",
                "stat": "Basis",
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
        table(
            "Probe runs over the range, by outcome",
            "What the capacity figures rest on and what they leave out: ok runs count (on a "
            "steady or a p10 basis; one too short to judge on neither), failed, timeout, "
            "preempted and aborted runs gave no figure; skipped and unsupported probes never "
            "ran. A device's figure above is its latest analysed run; sustain capacity counts "
            "every archived run, by basis and by why it was left out.",
            [
                Q(
                    "sum by (workload, precision, optimization, outcome) "
                    f"(increase(sustain_probe_runs_total{{{JOB_PROBE}}}[$__range]))"
                )
            ],
            columns={
                "workload": "Workload",
                "precision": "Precision",
                "optimization": "Optimization",
                "outcome": "Outcome",
                "Value": "Runs",
            },
            unit="none",
            decimals=0,
            sort_by="Workload",
            descending=False,
        ),
        24,
        6,
    )
    board.add(
        timeseries(
            "Median sustained throughput per GPU model over time",
            "Median over the devices of each model of their latest sustained figure, per basis.",
            [
                Q(
                    f"quantile by ({capacity}) (0.5, {sustained})",
                    "{{name}} {{workload}} {{precision}} {{optimization}} ({{unit}}, {{stat}})",
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
                    f"sustain_probe_sustained_ratio{{{JOB_PROBE}}} * {WITH_MODEL})",
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


def _outliers(board: Board) -> None:
    board.row("Fleet outliers")
    outliers = (
        f"sustain_drift_fleet_ratio{{{JOB_PROBE}}} and on "
        f"(instance, uuid, workload, precision, optimization) "
        f"(sustain_drift_fleet_outlier{{{JOB_PROBE}}} == 1)"
    )
    board.add(
        stat(
            "Outliers now",
            "Devices whose recent steady throughput is below their identical peers' median "
            "by more than drift.outlier_ratio (default 10 %).",
            [Q(f"count(({outliers}) * {WITH_MODEL}) or vector(0)")],
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
            [Q(f"({outliers}) * {WITH_MODEL}")],
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
                    f"bottomk(15, sustain_drift_fleet_ratio{{{JOB_PROBE}}} * {WITH_MODEL})",
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
                    f"bottomk(10, sustain_drift_fleet_ratio{{{JOB_PROBE}}} * {WITH_MODEL})",
                    "{{instance}} GPU {{device}} {{name}} {{workload}} {{precision}}",
                )
            ],
            unit="percentunit",
            minimum=0,
        ),
        12,
        9,
    )


def _throttling(board: Board) -> None:
    board.row("Throttling hot spots")
    throttled = (
        f'sustain_gpu_clock_event_reason_seconds_total{{{JOB}, reason=~"{THROTTLE_REASONS}"}}'
    )
    board.add(
        bargauge(
            "Most throttled GPUs over the time range",
            "The 10 GPU and reason pairs with the largest share of the dashboard's time range "
            "under a throttling reason (power cap, power brake, thermal, hardware slowdown).",
            [
                Q(
                    f"topk(10, rate({throttled}[$__range]) * {WITH_MODEL})",
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
                    f"avg by (name, reason) (rate({throttled}[$__range]) * {WITH_MODEL}) > 0",
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


def _stacks(board: Board) -> None:
    board.row("Stacks in use")
    board.add(
        table(
            "Stack versions in use",
            "Agents per driver, torch and CUDA driver version (the stack probes run on now).",
            [
                Q(
                    "count by (driver_version, torch_version, cuda_driver_version) "
                    f"(sustain_stack_info{{{JOB}}})"
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
