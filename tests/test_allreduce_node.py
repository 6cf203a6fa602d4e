"""The all-reduce probe under the scheduler (issue 15, acceptance 4): node-wide, every GPU of the
node visible to one run, one rank per GPU, the ranks counted as the agent's own.

Two fake GPUs; the probe interpreter is a wrapper that writes down the GPUs it was given
(``CUDA_VISIBLE_DEVICES``) and runs the real workload on the CPU (``--device cuda:0`` becomes
``--device cpu``), where the ranks meet over gloo instead of NCCL.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from conftest import FakeGpus, cpu_wrapper, wrapped_runs
from test_bounded_runs import iteration_capped_python

from agent.config.settings import ProbingSection
from agent.probes.devices import TelemetryCapture
from agent.probes.runner import ProbeRunner
from agent.probes.scheduler import ProbeScheduler
from agent.telemetry.sampler import SamplerLoop
from agent.telemetry.store import TelemetryStore
from collectors.nvml.collector import NvmlCollector
from workloads.allreduce import backend

Scenario = Callable[[str, float], tuple[FakeGpus, NvmlCollector]]
GPU0 = "GPU-0a000000-0000-4000-8000-00000000000a"
GPU1 = "GPU-1b000000-0000-4000-8000-00000000000b"


@pytest.mark.slow
def test_allreduce_runs_node_wide_with_a_rank_per_gpu_never_foreign(
    scenario: Scenario, tmp_path: Path
) -> None:
    _, collector = scenario(f"device 0 uuid {GPU0}\ndevice 1 uuid {GPU1}\n", 1.0)
    wrapper, log = cpu_wrapper(tmp_path)
    # The run ends after 40 iterations, within a generous duration: on a loaded machine an
    # iteration of two gloo ranks takes 0.1 s or more, and 3 s would leave it short of the
    # analysis minimum of 30 (a timeout, not the ok run this test is about).
    capped = iteration_capped_python(tmp_path, 40, target=wrapper)
    store = TelemetryStore(64)
    capture = TelemetryCapture()
    loop = SamplerLoop(collector, 1.0, sinks=(store.record, capture.record), stall_seconds=30)
    loop.poll_once()
    entry = {"workload": "allreduce", "precisions": ["fp32"], "duration_seconds": 60.0}
    settings = ProbingSection.model_validate(
        {"plan": [{**entry, "size": "small", "interval_seconds": 3600}]}
    )
    runner = ProbeRunner(python=str(capped), startup_timeout_seconds=120)
    scheduler = ProbeScheduler(settings, runner, store, capture, (loop,), 1.0)

    # While it runs: what the agent counts as its own, beside every process of the run. The
    # processes are listed first and the agent asked after, and only those still running after
    # its answer are compared with it: a rank started between the two reads, or gone before the
    # answer, is the next sample's (a loaded machine widens that gap; it is no finding).
    own: list[tuple[set[int], set[int]]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            started: set[int] = set()
            for pid in runner.child_pids():
                try:
                    parent = psutil.Process(pid)
                    started.update(p.pid for p in parent.children(recursive=True))
                except psutil.Error:
                    continue
            children = runner.child_pids()
            own.append((children, {pid for pid in started if running(pid)}))

    watcher = threading.Thread(target=watch)
    watcher.start()
    loop.start()  # the GPUs' telemetry during the run
    try:
        (run,) = scheduler.run_entry(settings.plan[0])
    finally:
        done.set()
        watcher.join()
        loop.request_stop()
        loop.join(5)

    assert run.outcome == "ok", (run.reason, run.stderr_tail)
    assert run.spec.device.key == "node"
    assert [m.key for m in run.spec.device.members] == [GPU0, GPU1]
    (child,) = wrapped_runs(log)
    assert child["gpus"] == f"{GPU0},{GPU1}"  # every GPU visible to the one run
    assert "--ranks" in child["argv"]
    assert child["argv"][child["argv"].index("--ranks") + 1] == "2"
    assert run.manifest is not None
    parameters = run.manifest["parameters"]
    assert parameters["world_size"] == 2
    assert parameters["backend"] == "gloo"  # NCCL on GPUs: backend("cuda")
    assert parameters["bus_factor"] == 1.0  # 2(n-1)/n, nccl-tests' busbw for n = 2
    assert run.manifest["unit"] == "B/s"
    assert run.throughput is not None
    assert run.throughput > 0
    # Both ranks ran, and rank 1 (a process the child started) was counted as the agent's own.
    (rank1,) = parameters["rank_pids"]
    seen = [children for children, started in own if rank1 in started]
    assert seen, "rank 1 was never seen running"
    assert all(rank1 in children for children in seen)
    # Both GPUs' telemetry was captured for the run.
    assert {s.device for s in run.telemetry} >= {GPU0, GPU1}


def running(pid: int) -> bool:
    """Still running (a zombie has ended its work)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_allreduce_selects_nccl_on_gpus_and_gloo_on_cpus() -> None:
    """The one switch between the two (the rest of the path is the same code)."""
    assert backend("cuda") == "nccl"
    assert backend("cpu") == "gloo"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload=matmul", "--ranks=2"], "--ranks applies to allreduce only"),
        (["--workload=allreduce", "--ranks=1"], "--ranks must be 2 or more"),
    ],
)
def test_ranks_is_checked(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "workloads", "run", *args, "--precision=fp32", "--device=cpu"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert done.stderr.count("\n") == 1
