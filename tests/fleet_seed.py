"""A small fleet's archive for the planner's report (tests/test_report.py): three GPU models on
three nodes, a stack change on node-a, node-wide runs there, and a degraded device (node-b's
gpu1: 20% below its three peers, thermally throttled, its health changed and a drift
recorded). The medians it seeds are ``SEEDED_MEDIANS``, in FLOP/s. Not every run settled: the
L40S ran fp32 matmul too, and those runs never reached a steady state (they count on their p10,
``L40S_FP32_P10``); and some runs gave nothing (``LEFT_OUT``: by reason)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, insert

from agent.archive.models import EventRecord, ProbeRunRecord, StackSnapshotRecord

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
L40S = "NVIDIA L40S"
STACK_A, STACK_B, STACK_C = "a" * 64, "b" * 64, "c" * 64
T = 1e12
H100_MEDIAN, A100_MEDIAN, L40S_MEDIAN = 700 * T, 280 * T, 250 * T
SEEDED_MEDIANS = (H100_MEDIAN, A100_MEDIAN, L40S_MEDIAN)
NODE_WIDE = 630 * T  # each H100 with its neighbour working too: 90% of solo
RUNS = 6
L40S_FP32_P10 = 61.5 * T
LEFT_OUT = {"timeout": 2, "failed": 1}


def _run(
    node: str, device: int, model: str, steady: float, at: datetime, **extra: Any
) -> dict[str, Any]:
    ratio = extra.pop("ratio", 0.95)
    row: dict[str, Any] = {
        "run_id": uuid.uuid4().hex,
        "node": node,
        "device": f"GPU-{node}-{device}",
        "device_label": f"gpu{device}",
        "workload": "matmul",
        "precision": "bf16",
        "optimization": "eager",
        "size": "default",
        "scope": "device",
        "outcome": "ok",
        "reason": "",
        "started_at": at - timedelta(seconds=30),
        "ended_at": at,
        "duration_seconds": 30.0,
        "iterations": 400,
        "throughput": steady,
        "unit": "FLOP/s",
        "exit_code": 0,
        "stderr_tail": "",
        "classification": "warmup",
        "peak_throughput": steady / ratio,
        "steady_throughput": steady,
        "steady_ci_low": steady * 0.99,
        "steady_ci_high": steady * 1.01,
        "sustained_ratio": ratio,
        "device_model": model,
        "analysis": json.dumps({"tolerance": 0.02}),
        "steady_thermal_share": 0.0,
        "steady_power_share": 0.1,
        "p10_throughput": steady * 0.98,
    }
    row.update(extra)
    return row


def _event(
    kind: str, node: str, device: str, at: datetime, message: str, **attributes: str
) -> dict[str, Any]:
    return {
        "event_id": uuid.uuid4().hex,
        "node": node,
        "device": device,
        "kind": kind,
        "occurred_at": at,
        "message": message,
        "attributes": json.dumps(attributes, sort_keys=True),
    }


def seed_fleet(engine: Engine, now: datetime | None = None) -> None:
    now = now or datetime.now(UTC)
    change = now - timedelta(days=5)
    runs: list[dict[str, Any]] = []
    for index in range(RUNS):
        at = now - timedelta(days=9, hours=-index * 36)  # every 36 hours from 9 days ago
        for device in (0, 1):
            stack = STACK_A if at < change else STACK_B
            runs.append(_run("node-a", device, H100, H100_MEDIAN, at, stack_id=stack))
            runs.append(_run("node-c", device, L40S, L40S_MEDIAN, at, stack_id=STACK_C))
        for device in range(4):
            degraded = device == 1
            runs.append(
                _run(
                    "node-b",
                    device,
                    A100,
                    A100_MEDIAN * (0.8 if degraded else 1.0),
                    at,
                    stack_id=STACK_C,
                    ratio=0.85 if degraded else 0.95,
                    steady_thermal_share=0.4 if degraded else 0.0,
                )
            )
        for device in (0, 1):  # never settled: no steady value, no sustained ratio, their p10
            runs.append(
                _run(
                    "node-c",
                    device,
                    L40S,
                    L40S_FP32_P10,
                    at + timedelta(minutes=10),
                    stack_id=STACK_C,
                    precision="fp32",
                    classification="no_steady_state",
                    steady_throughput=None,
                    steady_ci_low=None,
                    steady_ci_high=None,
                    sustained_ratio=None,
                    p10_throughput=L40S_FP32_P10,
                )
            )
        group = uuid.uuid4().hex
        for device in (0, 1):
            runs.append(
                _run(
                    "node-a",
                    device,
                    H100,
                    NODE_WIDE,
                    at + timedelta(minutes=5),
                    scope="node",
                    group_id=group,
                    stack_id=STACK_B,
                    coupling_ratio=0.9,
                )
            )
    failures = [("node-a", 0, H100, "timeout"), ("node-a", 1, H100, "timeout")]
    failures.append(("node-b", 2, A100, "failed"))
    for node, device, model, outcome in failures:  # no figures
        runs.append(
            _run(
                node,
                device,
                model,
                0.0,
                now - timedelta(days=2),
                outcome=outcome,
                reason=f"{outcome}: seeded",
                stack_id=STACK_B if node == "node-a" else STACK_C,
                classification=None,
                peak_throughput=None,
                steady_throughput=None,
                steady_ci_low=None,
                steady_ci_high=None,
                sustained_ratio=None,
                p10_throughput=None,
                analysis=None,
            )
        )
    stacks = [
        {
            "stack_id": stack,
            "facts": "{}",
            "driver_version": driver,
            "cuda_version": "12.4",
            "torch_version": "2.5.1",
            "first_seen_at": now - timedelta(days=30),
        }
        for stack, driver in (
            (STACK_A, "550.54.15"),
            (STACK_B, "555.42.02"),
            (STACK_C, "550.54.15"),
        )
    ]
    events = [
        _event(
            "stack_changed",
            "node-a",
            "node",
            change,
            "driver.version 550.54.15 -> 555.42.02",
            before=STACK_A,
            after=STACK_B,
        ),
        _event(
            "drift",
            "node-b",
            "GPU-node-b-1",
            now - timedelta(days=4),
            "matmul bf16 eager regression -20.0% (thermal): thermal share up 40 points",
            direction="regression",
            cause="thermal",
            change="-0.2",
        ),
        _event(
            "health_change",
            "node-b",
            "GPU-node-b-1",
            now - timedelta(days=4, hours=-1),
            "GPU 1: healthy -> degraded (slow: 80% of peers)",
            state="degraded",
            previous="healthy",
        ),
        _event(
            "throttle_episode",
            "node-b",
            "GPU-node-b-1",
            now - timedelta(days=3),
            "GPU 1: hw_thermal_slowdown for 120.0 s",
            reason="hw_thermal_slowdown",
            seconds="120.0",
            started="0",
        ),
    ]
    with engine.begin() as connection:
        connection.execute(insert(ProbeRunRecord), runs)
        connection.execute(insert(StackSnapshotRecord), stacks)
        connection.execute(insert(EventRecord), events)
