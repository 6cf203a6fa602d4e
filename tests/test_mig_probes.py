"""Probing a node with a MIG GPU and a plain GPU (issue 14, defects 7 and 8; acceptance 2).

The fake driver declares GPU 0 in MIG mode with two MIG devices and GPU 1 plain, each with its
CPU affinity. The probe plan runs the way the scheduler's job runs it (``run_entry``); the probe
interpreter is a wrapper that writes down the GPU it was given (``CUDA_VISIBLE_DEVICES``) and
then runs the real workload on the CPU (``--device cuda:N`` becomes ``--device cpu``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import FakeGpus, cpu_wrapper, wrapped_runs

from agent.config.settings import ProbingSection
from agent.probes.devices import TelemetryCapture, gpu_devices
from agent.probes.runner import ProbeRunner, ProbeSpec
from agent.probes.scheduler import ProbeScheduler
from agent.telemetry.sampler import SamplerLoop
from agent.telemetry.store import TelemetryStore
from collectors.nvml.collector import NvmlCollector

Scenario = Callable[[str, float], tuple[FakeGpus, NvmlCollector]]
GPU0 = "GPU-0a000000-0000-4000-8000-000000000000"
GPU1 = "GPU-1b000000-0000-4000-8000-000000000001"
MIG_A = "MIG-11111111-1111-4111-8111-111111111111"
MIG_B = "MIG-22222222-2222-4222-8222-222222222222"


ALLOWED = sorted(os.sched_getaffinity(0))
# Each GPU's nearest CPUs: one this process may use, the last for GPU 0, the first for GPU 1,
# so that a binding shows as a change wherever the machine has more than one CPU.
NEAR0, NEAR1 = ALLOWED[-1], ALLOWED[0]


def node(processes: str = "") -> str:
    return f"""
device 0 uuid {GPU0} mig_mode 1 cpu_affinity {NEAR0} numa_node 0
device 1 uuid {GPU1} cpu_affinity {NEAR1} numa_node 1
mig 0 1 0 {MIG_A} 42949672960
mig 0 2 0 {MIG_B} 42949672960
{processes}
"""


def scheduler_on(
    scenario: Scenario, text: str, tmp_path: Path
) -> tuple[ProbeScheduler, SamplerLoop, Path]:
    _, collector = scenario(text, 1.0)
    wrapper, log = cpu_wrapper(tmp_path)
    store = TelemetryStore(64)
    capture = TelemetryCapture()
    loop = SamplerLoop(collector, 1.0, sinks=(store.record, capture.record), stall_seconds=30)
    loop.poll_once()
    settings = ProbingSection.model_validate(
        {
            "plan": [
                {
                    "workload": "matmul",
                    "precisions": ["fp32"],
                    "duration_seconds": 1.0,
                    "size": "small",
                    "interval_seconds": 3600,
                }
            ]
        }
    )
    # A generous grace past the duration: on a loaded machine the last iteration may wait long
    # for a core, and what is checked here is where each child ran, not how long.
    runner = ProbeRunner(python=str(wrapper), startup_timeout_seconds=120, grace_seconds=60)
    return ProbeScheduler(settings, runner, store, capture, (loop,), 1.0), loop, log


@pytest.mark.slow
def test_mig_instances_are_probed_by_their_own_uuid_bound_to_the_gpus_cpus(
    scenario: Scenario, tmp_path: Path
) -> None:
    """Acceptance 2 (targets) and defect 8: a scheduled round probes MIG device A, MIG device
    B (by their MIG- UUIDs, never the MIG GPU's own UUID, on which nothing runs) and the plain
    GPU; each child runs on its GPU's CPUs (its own os.sched_getaffinity, in its manifest)."""
    scheduler, loop, log = scheduler_on(scenario, node(), tmp_path)
    devices = gpu_devices(scheduler._store)
    assert [(d.key, d.parent, d.mig) for d in devices] == [
        (MIG_A, GPU0, "1"),
        (MIG_B, GPU0, "2"),
        (GPU1, None, None),
    ]
    loop.start()  # the GPUs' telemetry during the runs
    try:
        runs = scheduler.run_entry(scheduler.settings.plan[0])
    finally:
        loop.request_stop()
        loop.join(5)
    assert [run.spec.device.key for run in runs] == [MIG_A, MIG_B, GPU1]
    assert all(run.outcome in ("ok", "timeout") for run in runs), [r.reason for r in runs]
    assert [child["gpus"] for child in wrapped_runs(log)] == [MIG_A, MIG_B, GPU1]
    for run, near in zip(runs, (NEAR0, NEAR0, NEAR1), strict=True):
        assert run.manifest is not None, run.reason
        binding = run.manifest["cpu_binding"]
        assert binding["requested"] == [near]
        assert binding["cpus"] == [near]  # the child's os.sched_getaffinity(0)
        assert binding["bound"] is True
    # The MIG devices' runs are explained by their GPU's telemetry (clocks, power).
    mig_run = runs[0]
    assert GPU0 in {s.device for s in mig_run.telemetry}
    assert GPU1 not in {s.device for s in mig_run.telemetry}


def test_a_process_on_one_mig_instance_skips_every_probe_of_that_gpu(
    scenario: Scenario, tmp_path: Path
) -> None:
    """Acceptance 2 (busy): a foreign process on MIG device B makes B's and A's probes skip
    with the reason (the GPU's power and clocks are shared); the plain GPU is probed."""
    scheduler, _, log = scheduler_on(
        scenario, node(processes="process 0:1 4242 1073741824 - -"), tmp_path
    )
    runs = scheduler.run_entry(scheduler.settings.plan[0])
    outcomes = {run.spec.device.key: (run.outcome, run.reason) for run in runs}
    for mig in (MIG_A, MIG_B):
        outcome, reason = outcomes[mig]
        assert outcome == "skipped"
        assert reason == "1 foreign compute process(es) on GPU 0 (MIG mode: 1 on MIG 2)"
    assert outcomes[GPU1][0] in ("ok", "timeout"), outcomes[GPU1]
    assert [child["gpus"] for child in wrapped_runs(log)] == [GPU1]


def test_a_mig_gpu_whose_processes_cannot_be_read_is_not_probed_blindly(
    scenario: Scenario, tmp_path: Path
) -> None:
    """Utilization reads N/A in MIG mode; with the process lists refused too (a container
    without the permission), whether the GPU is busy cannot be told: skipped, saying why."""
    refused = "\n".join(
        f"fault {device} no_permission nvmlDeviceGetComputeRunningProcesses_v3 - -"
        for device in ("0", "0:0", "0:1")
    )
    scheduler, _, _ = scheduler_on(scenario, node(processes=refused), tmp_path)
    spec_devices = [d for d in gpu_devices(scheduler._store) if d.parent == GPU0]
    assert len(spec_devices) == 2
    reason = scheduler.skip_reason(ProbeSpec("matmul", "fp32", "eager", 1.0, spec_devices[0]))
    assert reason is not None
    assert reason == (
        "GPU 0 is in MIG mode, where utilization reads N/A, and NVML refused its process lists: "
        "whether it is busy cannot be told"
    )


@pytest.mark.parametrize("text", ["0,x", "", "-1"])
def test_workloads_cpus_argument_is_checked(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m workloads run ... --cpus TEXT`: its main here, where a child would first import
    torch (seconds of CPU) to refuse an argument; the exit code and the one line are the same."""
    from workloads.cli import main

    argv = ["run", "--workload", "matmul", "--precision", "fp32", "--device", "cpu"]
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--cpus", text])
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1
    assert "--cpus" in stderr


def test_the_first_round_waits_for_nvmls_first_poll(scenario: Scenario, tmp_path: Path) -> None:
    """A plan that starts with the agent (initial_delay_seconds = 0) must not take a GPU node for
    a CPU one because the NVML loop has not polled yet: the devices wait for its first poll."""
    _, collector = scenario(node(), 1.0)
    store = TelemetryStore(64)
    loop = SamplerLoop(collector, 1.0, sinks=(store.record,), stall_seconds=30)
    scheduler = ProbeScheduler(
        ProbingSection(), ProbeRunner(), store, TelemetryCapture(), (loop,), 1.0
    )
    late = threading.Timer(0.5, loop.poll_once)
    late.start()
    try:
        devices = scheduler.devices()
    finally:
        late.join()
    assert [device.key for device in devices] == [MIG_A, MIG_B, GPU1]
