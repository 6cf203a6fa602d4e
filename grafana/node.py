"""sustain / Node: one node, for an SRE looking at why its GPUs deliver what they do.

Each clock, power and temperature sits beside the limit that explains it, and utilization beside
the throughput the probes achieved, because a GPU at 100 % utilization can still be held down.
"""

from __future__ import annotations

from panels import (
    SOLO,
    Board,
    Json,
    Q,
    bargauge,
    by_name,
    by_ref,
    datasource_variable,
    query_variable,
    reference_line,
    stat,
    state_timeline,
    table,
    text,
    thresholds,
    throughput,
    timeseries,
    value_map,
)

GPU = 'instance=~"$instance", device=~"$device"'
HOST = 'instance=~"$instance"'

HEALTH = value_map({"1": ("healthy", "green"), "0": ("lost", "red")})
VERDICT = value_map(
    {"0": ("healthy", "green"), "1": ("degraded", "orange"), "2": ("unhealthy", "red")}
)
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
    board = Board(
        "sustain-node",
        "sustain / Node",
        "One node: GPU clocks, power and temperature against their limits, clock-event reasons, "
        "utilization beside achieved probe throughput, what the node sustains with every GPU "
        "at work, memory, PCIe, errors, and the host.",
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

    _overview(board)
    _clocks(board)
    _power_and_temperature(board)
    _utilization(board)
    _node_wide(board)
    _memory_and_pcie(board)
    _errors_and_health(board)
    _host(board)
    return board.to_json()


def _overview(board: Board) -> None:
    board.row("Overview")
    board.add(
        stat(
            "Agent",
            "Whether Prometheus reaches the agent (up).",
            [Q(f"up{{{HOST}}}", "{{job}}")],
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
            [Q(f"sustain_build_info{{{HOST}}}", "{{version}} (Python {{python_version}})")],
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
                    f"sustain_nvml_info{{{HOST}}}",
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
            [Q(f"sustain_gpu_healthy{{{GPU}}}", "GPU {{device}}")],
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
            [Q(f"sustain_gpu_foreign_compute_processes{{{GPU}}}", "GPU {{device}}")],
            text_mode="value_and_name",
        ),
        4,
        4,
    )
    board.add(
        table(
            "GPUs",
            "The GPUs of this node (sustain_gpu_info).",
            [Q(f"sustain_gpu_info{{{GPU}}}")],
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


def _clocks(board: Board) -> None:
    board.row("Clocks and clock-event reasons")
    for clock, label in (("sm", "SM"), ("memory", "Memory")):
        board.add(
            timeseries(
                f"{label} clock against its maximum",
                f"{label} clock (mean over the exporter window) and the maximum the GPU reports "
                "(dashed). A clock below its maximum under load: see the clock-event reasons.",
                [
                    Q(
                        f'sustain_gpu_clock_window_mean_hertz{{{GPU}, clock="{clock}"}}',
                        f"GPU {{{{device}}}} {label} clock",
                    ),
                    Q(
                        f'sustain_gpu_clock_max_hertz{{{GPU}, clock="{clock}"}}',
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
                    f"sustain_gpu_clock_event_reason_active_window_max{{{GPU}}}",
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
                    f'{{{GPU}, reason!="gpu_idle"}}[$__rate_interval])',
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
                    f"rate(sustain_gpu_violation_seconds_total{{{GPU}}}[$__rate_interval])",
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


def _power_and_temperature(board: Board) -> None:
    board.row("Power and temperature")
    board.add(
        timeseries(
            "Power against the enforced limit",
            "Board power: mean and maximum over the exporter window, and the enforced power "
            "limit (dashed). Power at the limit with clocks below their maximum: power cap.",
            [
                Q(f"sustain_gpu_power_window_mean_watts{{{GPU}}}", "GPU {{device}} mean"),
                Q(f"sustain_gpu_power_window_max_watts{{{GPU}}}", "GPU {{device}} peak"),
                Q(f"sustain_gpu_power_limit_watts{{{GPU}}}", "GPU {{device}} limit"),
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
                    f"sustain_gpu_temperature_window_max_celsius{{{GPU}}}",
                    "GPU {{device}} {{sensor}}",
                ),
                Q(
                    f'sustain_gpu_temperature_threshold_celsius{{{GPU}, threshold="slowdown"}}',
                    "GPU {{device}} slowdown threshold",
                ),
            ],
            unit="celsius",
            overrides=[reference_line("B")],
        ),
        12,
        8,
    )


def _utilization(board: Board) -> None:
    board.row("Utilization is not performance")
    board.add(
        timeseries(
            "Utilization",
            "NVML utilization (time with a kernel running), memory controller utilization, "
            "and where the GPU has GPM (Hopper and newer): SM occupancy, tensor activity, DRAM "
            "bandwidth. Means over the exporter window.",
            [
                Q(f"sustain_gpu_utilization_window_mean_ratio{{{GPU}}}", "GPU {{device}} util"),
                Q(
                    f"sustain_gpu_memory_utilization_window_mean_ratio{{{GPU}}}",
                    "GPU {{device}} memory controller",
                ),
                Q(
                    f"sustain_gpu_sm_occupancy_window_mean_ratio{{{GPU}}}",
                    "GPU {{device}} SM occupancy",
                ),
                Q(
                    f"sustain_gpu_tensor_activity_window_mean_ratio{{{GPU}}}",
                    "GPU {{device}} tensor activity",
                ),
                Q(
                    f"sustain_gpu_dram_bandwidth_utilization_window_mean_ratio{{{GPU}}}",
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
            "What the GPU achieved in its latest solo probe runs: each run's work over time in "
            "its steady state, per workload and precision, in the probe's unit (FLOP/s, B/s, "
            "tokens/s). A run with no steady state shows its p10 over one-second windows instead, "
            "marked 'p10' in the legend (steady ones say 'steady').",
            [
                Q(
                    throughput(GPU, SOLO, 'stat="steady"')
                    + " or ("
                    + throughput(GPU, SOLO, 'stat="p10"')
                    + " unless ignoring(stat) "
                    + throughput(GPU, SOLO, 'stat="steady"')
                    + ")",
                    "GPU {{device}} {{workload}} {{precision}} {{optimization}} {{stat}} "
                    "({{unit}})",
                ),
            ],
            unit="short",
            steps_after=True,
            points=True,
        ),
        9,
        9,
    )
    board.add(text("Utilization is not performance", UTILIZATION_NOTE), 6, 9)


def _node_wide(board: Board) -> None:
    board.row("Node-wide probes: every GPU at once")
    node_wide = f'{HOST}, scope="node", stat="steady"'
    probe = "workload, precision, optimization"
    # The solo results of the devices that took part in the node-wide run (each has a node-wide
    # series of its own), so that a device left out of it, or a CPU probe, is not in the sum.
    solo_sum = (
        f"sum by (instance, {probe}, unit) ("
        + throughput(HOST, SOLO, 'stat="steady"')
        + f" and on (instance, device, {probe}, unit) "
        + throughput(node_wide, 'device!="node"')
        + ")"
    )
    board.add(
        timeseries(
            "Node-wide throughput against the sum of solo results",
            "Steady throughput of the latest node-wide run (every GPU of the node running the "
            "probe at once, summed on a common time grid) and, dashed, the sum of the same "
            "GPUs' latest solo steady throughput. The gap is what the GPUs lose to each other: "
            "shared power budget, airflow, PCIe, host memory and CPUs.",
            [
                Q(
                    throughput(node_wide, 'device="node"'),
                    "node-wide {{workload}} {{precision}} {{optimization}} ({{unit}})",
                ),
                Q(solo_sum, "sum of solo {{workload}} {{precision}} {{optimization}} ({{unit}})"),
            ],
            unit="short",
            minimum=0,
            steps_after=True,
            points=True,
            overrides=[by_ref("B", ("custom.lineStyle", {"dash": [10, 10], "fill": "dash"}))],
        ),
        12,
        8,
    )
    coupled = 'instance=~"$instance", device=~"$device|node"'
    ratio = f"sustain_probe_node_coupling_ratio{{{coupled}}}"
    board.add(
        timeseries(
            "Coupling ratio over time",
            "Each GPU's node-wide steady throughput over its latest solo one (same workload, "
            "precision and size), and the node's (device node: the node-wide sum over the sum "
            "of the solo results). 1: no loss when every GPU works at once.",
            [Q(ratio, "GPU {{device}} {{workload}} {{precision}} {{optimization}}")],
            unit="percentunit",
            minimum=0,
            steps_after=True,
            points=True,
        ),
        12,
        8,
    )
    by = f"instance, device, {probe}"
    board.add(
        table(
            "Coupling ratio and cause, latest node-wide run",
            "Coupling ratio of each GPU and of the node (device node); below 95 % the cause the "
            "run's telemetry shows: thermal, power_brake, power_cap, clock_unexplained, or "
            "host_contention (the clocks held and throughput fell: shared CPUs, host memory, "
            "PCIe). Low runs: node-wide runs in a row below probing.coupling_threshold (0.85 "
            "by default); SustainProbeNodeCouplingLow fires at 3.",
            [
                Q(
                    f"max by ({by}, cause) ("
                    f"sustain_probe_node_coupling_cause{{{coupled}}}"
                    f" * on (instance, device, uuid, {probe}) group_left {ratio})"
                    f" or on ({by}) max by ({by}) ({ratio})"
                ),
                Q(f"max by ({by}) (sustain_probe_node_coupling_low_runs{{{coupled}}})"),
            ],
            columns={
                "device": "GPU",
                "workload": "Workload",
                "precision": "Precision",
                "optimization": "Optimization",
                "Value #A": "Coupling ratio",
                "cause": "Cause",
                "Value #B": "Low runs",
            },
            overrides=[
                by_name(
                    "Coupling ratio",
                    ("unit", "percentunit"),
                    ("decimals", 1),
                    ("custom.cellOptions", {"type": "color-text"}),
                    ("thresholds", thresholds((None, "red"), (0.85, "orange"), (0.95, "green"))),
                ),
                by_name("Low runs", ("decimals", 0)),
            ],
            sort_by="Coupling ratio",
            descending=False,
        ),
        24,
        7,
    )


def _memory_and_pcie(board: Board) -> None:
    board.row("Memory and PCIe")
    board.add(
        timeseries(
            "GPU memory used and total",
            "Device memory in use, and the total (dashed).",
            [
                Q(f"sustain_gpu_memory_used_bytes{{{GPU}}}", "GPU {{device}} used"),
                Q(f"sustain_gpu_memory_total_bytes{{{GPU}}}", "GPU {{device}} total"),
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
                    f"sustain_gpu_memory_used_bytes{{{GPU}}}"
                    f" / sustain_gpu_memory_total_bytes{{{GPU}}}",
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
                    f"sustain_gpu_pcie_link_width{{{GPU}}}"
                    f" < bool sustain_gpu_pcie_link_width_max{{{GPU}}}",
                    "GPU {{device}} width",
                ),
                Q(
                    f"sustain_gpu_pcie_link_generation{{{GPU}}}"
                    f" < bool sustain_gpu_pcie_link_generation_max{{{GPU}}}",
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
        return Q(f"max by (instance, device) (sustain_gpu_pcie_link_{field}{{{GPU}}})")

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
                    f"sustain_gpu_pcie_throughput_window_mean_bytes_per_second{{{GPU}}}",
                    "GPU {{device}} {{direction}}",
                )
            ],
            unit="Bps",
            minimum=0,
        ),
        6,
        8,
    )


def _errors_and_health(board: Board) -> None:
    board.row("Errors and health")
    board.add(
        state_timeline(
            "Health verdict",
            "Each device's verdict (docs/health.md): healthy, degraded or unhealthy; the CPU "
            "and each MIG device too. The reasons are in the table beside it and in "
            "`sustain health` on the node.",
            [
                Q(
                    "max by (instance, device, uuid) ("
                    f'sustain_device_health{{{GPU}, state="unhealthy"}} * 2 '
                    f'or sustain_device_health{{{GPU}, state="degraded"}})',
                    "{{device}} {{uuid}}",
                )
            ],
            mappings=VERDICT,
        ),
        12,
        6,
    )
    board.add(
        table(
            "Health reasons now",
            "Every reason a device is degraded or unhealthy now (acknowledged ones aside).",
            [Q(f"sustain_device_health_reason{{{GPU}}} == 1")],
            columns={"device": "Device", "uuid": "UUID", "reason": "Reason"},
            sort_by="Device",
            descending=False,
        ),
        12,
        6,
    )
    board.add(
        state_timeline(
            "GPU answering",
            "Red while NVML reports the GPU lost.",
            [Q(f"sustain_gpu_healthy{{{GPU}}}", "GPU {{device}}")],
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
                Q(f"max by (instance, device, xid) (sustain_gpu_xid_errors_total{{{GPU}}})"),
                Q(
                    "max by (instance, device, xid) "
                    f"(sustain_gpu_xid_last_seen_timestamp_seconds{{{GPU}}}) * 1000"
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
                    f"increase(sustain_gpu_xid_errors_total{{{GPU}}}[$__rate_interval])",
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
                    f"increase(sustain_gpu_ecc_errors_total{{{GPU}}}[$__rate_interval])",
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
                Q(f"sustain_gpu_row_remap_pending{{{GPU}}}", "GPU {{device}} pending"),
                Q(f"sustain_gpu_row_remap_failed{{{GPU}}}", "GPU {{device}} failed"),
            ],
            steps=thresholds((None, "green"), (1, "red")),
            text_mode="value_and_name",
        ),
        8,
        7,
    )


def _host(board: Board) -> None:
    board.row("Host")
    board.add(
        timeseries(
            "CPU utilization",
            "All CPUs: mean and maximum over the exporter window.",
            [
                Q(f"sustain_cpu_utilization_window_mean_ratio{{{HOST}}}", "mean"),
                Q(f"sustain_cpu_utilization_window_max_ratio{{{HOST}}}", "max"),
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
                Q(f"sustain_memory_used_bytes{{{HOST}}}", "used"),
                Q(f"sustain_memory_total_bytes{{{HOST}}}", "total"),
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
                Q(f"sustain_load1{{{HOST}}}", "1 min"),
                Q(f"sustain_load5{{{HOST}}}", "5 min"),
                Q(f"sustain_load15{{{HOST}}}", "15 min"),
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
                    f"avg by (instance) (sustain_cpu_frequency_window_mean_hertz{{{HOST}}})",
                    "mean of CPUs",
                ),
                Q(
                    f"max by (instance) (sustain_cpu_frequency_max_hertz{{{HOST}}})",
                    "max",
                ),
                Q(
                    f"min by (instance) (sustain_cpu_frequency_window_mean_hertz{{{HOST}}})",
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
                    f"sustain_temperature_window_max_celsius{{{HOST}}}",
                    "{{chip}} {{sensor}}",
                )
            ],
            unit="celsius",
        ),
        12,
        8,
    )
