"""What a probe plan turns into before any child starts (issue 25, items 2 and 3).

* The all-reduce is one node-wide run with every GPU visible, from `sustain probe` as from the
  daemon: both take their runs from ``plan_specs``. Before, the command started one child per
  GPU, each seeing one GPU, and every one of them said it needs two.
* A GPU with foreign compute work on it is not touched before its busy check: the precisions of
  the built-in plan come from the compute capability NVML states, not from a `workloads list`
  child that makes a CUDA context (and runs an int8 trial) on the GPU. In exclusive-process
  compute mode such a context fails the production job's own.

The probe interpreter is conftest's CPU wrapper: it writes down each child's GPUs
(``CUDA_VISIBLE_DEVICES``) and arguments, then runs the real workload on the CPU.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from apscheduler.schedulers.background import BackgroundScheduler
from conftest import FakeGpus, cpu_wrapper, start_agent, wrapped_runs
from test_bounded_runs import iteration_capped_python

from agent.config.settings import ProbingSection
from agent.probes.devices import TelemetryCapture, gpu_devices, plan_specs
from agent.probes.runner import CPU, ProbeDevice, ProbeRunner, ProbeSpec
from agent.probes.scheduler import ProbeScheduler
from agent.telemetry.sampler import SamplerLoop
from agent.telemetry.store import TelemetryStore
from collectors.nvml.collector import NvmlCollector

Scenario = Callable[[str, float], tuple[FakeGpus, NvmlCollector]]
GPU0 = "GPU-0a000000-0000-4000-8000-00000000000a"
GPU1 = "GPU-1b000000-0000-4000-8000-00000000000b"
TWO_GPUS = f"device 0 uuid {GPU0}\ndevice 1 uuid {GPU1}\n"
# A production job on GPU 0 for the whole scenario.
BUSY_GPU0 = TWO_GPUS + "process 0 4242 3221225472 - -\n"


def _logged(log: Path) -> list[dict[str, Any]]:
    """Every child the wrapper started (`workloads run`, `list`, `facts`), in order."""
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _sees(child: dict[str, Any], uuid: str) -> bool:
    return uuid in (child["gpus"] or "").split(",")


def _probe_env(fake_nvml: Path, scenario: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    return env | {"LD_LIBRARY_PATH": str(fake_nvml.parent), "FAKENVML_SCENARIO": str(scenario)}


def _sustain_probe(
    fake_nvml: Path, tmp_path: Path, scenario: str, *args: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`sustain probe ARGS --json` on the fake node: its runs, and the children it started."""
    done, children = _sustain_probe_done(fake_nvml, tmp_path, scenario, *args)
    return json.loads(done.stdout)["runs"], children


def _sustain_probe_done(
    fake_nvml: Path, tmp_path: Path, scenario: str, *args: str
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    wrapper, log = cpu_wrapper(tmp_path)
    # 80 iterations: membw alternates two phases, and the analysis reads one (30 at least).
    capped = iteration_capped_python(tmp_path, 80, target=wrapper)
    (tmp_path / "gpus.scn").write_text(scenario)
    (tmp_path / "sustain.toml").write_text(
        f'[probing]\npython = "{capped}"\nrun_grace_seconds = 60\n'
    )
    command = [
        sys.executable, "-m", "agent", "probe", "--config", str(tmp_path / "sustain.toml"),
        "--data-dir", str(tmp_path), *args, "--json",
    ]  # fmt: skip
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=_probe_env(fake_nvml, tmp_path / "gpus.scn"),
        timeout=300,
        check=False,
    )
    assert done.stdout, done.stderr
    return done, _logged(log)


def _two_gpus() -> list[ProbeDevice]:
    return [
        ProbeDevice("cuda", GPU0, "0", 0, capability=(9, 0)),
        ProbeDevice("cuda", GPU1, "1", 1, capability=(9, 0)),
    ]


def test_the_plan_runs_the_allreduce_once_on_the_node_and_others_per_device() -> None:
    probing = ProbingSection.model_validate(
        {
            "plan": [
                {"workload": "allreduce", "precisions": ["fp32", "bf16"], "interval_seconds": 60},
                {"workload": "matmul", "precisions": ["fp32"], "interval_seconds": 60},
            ]
        }
    )
    runner = ProbeRunner(python="/nonexistent/python")  # no child may start: none is needed
    allreduce = plan_specs(probing, probing.plan[0], _two_gpus(), runner)
    assert [(spec.precision, spec.device.key, spec.scope) for spec in allreduce] == [
        ("fp32", "node", "node"),
        ("bf16", "node", "node"),
    ]
    assert [member.key for member in allreduce[0].device.members] == [GPU0, GPU1]
    matmul = plan_specs(probing, probing.plan[1], _two_gpus(), runner)
    assert [(spec.device.key, spec.scope) for spec in matmul] == [
        (GPU0, "device"),
        (GPU1, "device"),
    ]
    # A request's flags override the entry; a variant the workload lacks is left out.
    asked = plan_specs(
        probing, probing.plan[0], _two_gpus(), runner, precisions=["fp16", "fp32"], duration=5
    )
    assert [(spec.precision, spec.duration_seconds) for spec in asked] == [("fp32", 5)]


@pytest.mark.slow  # a whole probe command end to end (left out of the quick tier)
def test_sustain_probe_runs_the_allreduce_node_wide_with_both_gpus(
    fake_nvml: Path, tmp_path: Path
) -> None:
    runs, children = _sustain_probe(
        fake_nvml,
        tmp_path,
        TWO_GPUS,
        "--workload", "allreduce", "--precision", "fp32", "--size", "small",
        "--duration", "120", "--force", "--node",
    )  # fmt: skip
    # One run, on the node, every GPU visible to it; --node adds no per-device copy of it.
    assert [(run["scope"], run["device"], run["outcome"]) for run in runs] == [
        ("node", "node", "ok")
    ], runs
    (child,) = wrapped_runs(tmp_path / "children.jsonl")
    assert child["gpus"] == f"{GPU0},{GPU1}"
    assert child["argv"][child["argv"].index("--ranks") + 1] == "2"
    assert runs[0]["manifest"]["parameters"]["world_size"] == 2
    assert len([c for c in children if "run" in c["argv"]]) == 1


def test_sustain_probe_exits_1_when_every_run_is_skipped_and_names_force(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """GPU 0 busy and the only device asked for: nothing ran, which is no success."""
    done, children = _sustain_probe_done(
        fake_nvml, tmp_path, BUSY_GPU0, "--workload", "membw", "--size", "small", "--device", "0"
    )
    runs = json.loads(done.stdout)["runs"]
    assert [run["outcome"] for run in runs] == ["skipped"], runs
    assert done.returncode == 1, done.stderr
    assert "every run was skipped" in done.stderr
    assert "--force" in done.stderr
    assert "Traceback" not in done.stderr
    assert not [child for child in children if "run" in child["argv"]], children


@pytest.mark.slow  # a whole probe command end to end (left out of the quick tier)
def test_sustain_probe_starts_no_child_on_a_gpu_with_foreign_work(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """The built-in plan's membw entry (its precisions planned per device), GPU 0 busy."""
    runs, children = _sustain_probe(
        fake_nvml, tmp_path, BUSY_GPU0, "--workload", "membw", "--size", "small", "--duration", "60"
    )
    outcomes = {run["device"]: (run["outcome"], run["reason"]) for run in runs}
    assert outcomes["0"][0] == "skipped"
    assert "4242" in outcomes["0"][1] or "foreign" in outcomes["0"][1], outcomes
    assert outcomes["1"][0] == "ok", outcomes
    assert children, "the wrapper saw no child"
    assert not [child for child in children if _sees(child, GPU0)], children
    # No child at all ran before the checks to ask what a GPU supports.
    assert not [child for child in children if "list" in child["argv"]], children


def test_the_daemon_plans_from_nvml_and_touches_no_busy_gpu(
    scenario: Scenario, tmp_path: Path
) -> None:
    """The daemon's path (``run_entry``) with the built-in plan, whose precisions are planned
    per device: GPU 0 is skipped and no child ever sees it."""
    _, collector = scenario(BUSY_GPU0, 1.0)
    wrapper, log = cpu_wrapper(tmp_path)
    capped = iteration_capped_python(tmp_path, 80, target=wrapper)
    store = TelemetryStore(64)
    capture = TelemetryCapture()
    loop = SamplerLoop(collector, 1.0, sinks=(store.record, capture.record), stall_seconds=30)
    loop.poll_once()
    settings = ProbingSection()  # the built-in plan
    assert "plan" not in settings.model_fields_set
    runner = ProbeRunner(python=str(capped), startup_timeout_seconds=120, grace_seconds=60)
    scheduler = ProbeScheduler(settings, runner, store, capture, (loop,), 1.0)
    membw = next(entry for entry in settings.plan if entry.workload == "membw")
    entry = membw.model_copy(update={"size": "small", "duration_seconds": 60.0})
    loop.start()
    try:
        runs = scheduler.run_entry(entry)
    finally:
        loop.request_stop()
        loop.join(5)
    outcomes = {run.spec.device.key: run.outcome for run in runs}
    assert outcomes == {GPU0: "skipped", GPU1: "ok"}, [(r.outcome, r.reason) for r in runs]
    children = _logged(log)
    # (The analysis child is started with the same interpreter and sees no GPU.)
    assert [child["gpus"] for child in children if child["gpus"]] == [GPU1], children


@pytest.mark.slow  # probe or torch children end to end (left out of the quick tier)
def test_a_skipped_run_is_tried_again_soon_until_it_runs(
    scenario: Scenario, tmp_path: Path
) -> None:
    """A job holds GPU 0 for the first 8 s of the agent's life; the plan's interval is an hour.
    The daemon's schedule (APScheduler, as `sustain run` has it) tries GPU 0 again after 1 s,
    2 s, 4 s ... and has its result long before the next round; GPU 1, which ran, is not run
    again. The skips are counted by why."""
    _, collector = scenario(TWO_GPUS + "process 0 4242 3221225472 0 8\n", 1.0)
    wrapper, _ = cpu_wrapper(tmp_path)
    capped = iteration_capped_python(tmp_path, 80, target=wrapper)  # a duration of 60 s at most
    store = TelemetryStore(64)
    capture = TelemetryCapture()
    loop = SamplerLoop(collector, 0.5, sinks=(store.record, capture.record), stall_seconds=30)
    loop.poll_once()
    settings = ProbingSection.model_validate(
        {
            "initial_delay_seconds": 0,
            "skip_retry_seconds": 1,
            "duty_cycle": 1.0,
            "plan": [
                {
                    "workload": "membw",
                    "size": "small",
                    "duration_seconds": 60,
                    "interval_seconds": 3600,
                    "jitter_seconds": 0,
                }
            ],
        }
    )
    runner = ProbeRunner(python=str(capped), startup_timeout_seconds=120, grace_seconds=60)
    probes = ProbeScheduler(settings, runner, store, capture, (loop,), 0.5)
    jobs = BackgroundScheduler(timezone="UTC")
    loop.start()
    probes.schedule(jobs)
    jobs.start()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            status = probes.status()
            if (GPU0, "ok") in {(key[4], key[5]) for key in status.runs}:
                break
            time.sleep(0.5)
    finally:
        probes.stop()
        jobs.shutdown(wait=True)
        loop.request_stop()
        loop.join(5)
    runs = {(key[4], key[5]): count for key, count in status.runs.items()}
    reasons = {key[4]: (latest.outcome, latest.reason) for key, latest in status.latest.items()}
    assert runs.get((GPU0, "ok")) == 1, (runs, reasons)
    assert runs.get((GPU0, "skipped"), 0) >= 1, runs
    assert runs.get((GPU1, "ok")) == 1, runs  # ran in the first round: never tried again
    assert (GPU1, "skipped") not in runs, runs
    skips = {(key[4], key[5]): count for key, count in status.skips.items()}
    assert skips == {(GPU0, "foreign_processes"): runs[(GPU0, "skipped")]}, skips


def test_gpu_precisions_come_from_the_capability_nvml_states(
    scenario: Scenario, tmp_path: Path
) -> None:
    """A 6.1 GPU (a GeForce Pascal: fp16 at 1/64 rate) beside a 9.0 one: the built-in plan
    leaves fp16 out on the first only, and no child is started to find that out."""
    _, collector = scenario(
        TWO_GPUS + "device 0 compute_capability_major 6 compute_capability_minor 1\n", 1.0
    )
    store = TelemetryStore(64)
    for sample in collector.collect():
        store.record(sample)
    old, new = gpu_devices(store)
    assert (old.capability, new.capability) == ((6, 1), (9, 0))
    runner = ProbeRunner(python=str(tmp_path / "no-such-python"))
    assert runner.lacking_native(old) == {"fp16": "fp16 on compute capability 6.1 is not full rate"}
    assert runner.lacking_native(new) == {}
    probing = ProbingSection()
    entry = probing.plan[0].model_copy(update={"precisions": ["fp16", "fp32"]})
    planned = [(s.device.key, s.precision) for s in plan_specs(probing, entry, [old, new], runner)]
    assert planned == [(GPU0, "fp32"), (GPU1, "fp16"), (GPU1, "fp32")]
    # The CPU still asks its child (the instruction set decides there): a missing interpreter
    # leaves nothing out.
    assert runner.lacking_native(CPU) == {}


@pytest.mark.slow  # a whole agent end to end (left out of the quick tier)
def test_starting_the_agent_starts_no_child_that_sees_a_busy_gpu(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """`sustain run` on the node with GPU 0 busy: up to its first stack read (the torch facts
    child) and its first scrape with GPU 0's foreign process, no child sees a GPU."""
    wrapper, log = cpu_wrapper(tmp_path)
    (tmp_path / "gpus.scn").write_text(BUSY_GPU0)
    (tmp_path / "sustain.toml").write_text(f'[probing]\npython = "{wrapper}"\n')
    running = start_agent(
        tmp_path / "data",
        "--config",
        str(tmp_path / "sustain.toml"),
        env=_probe_env(fake_nvml, tmp_path / "gpus.scn"),
    )
    try:
        running.wait_for(
            f'sustain_gpu_foreign_compute_processes{{device="0",uuid="{GPU0}"}} 1.0', timeout=120
        )
        deadline = time.monotonic() + 120  # the first stack read: the torch facts child
        while not [child for child in _logged(log) if "facts" in child["argv"]]:
            assert time.monotonic() < deadline, "no stack read within 120 s"
            time.sleep(0.5)
    finally:
        code, _, err = running.terminate()
    assert code == 0, err
    children = _logged(log)
    assert children
    assert all(not child["gpus"] for child in children), children


def test_the_advice_for_a_short_phased_run_counts_every_phase() -> None:
    """membw alternates copy and triad, and the analysis reads one phase: the duration it asks
    for covers the other phase's time too (before, 20 copy iterations of 0.05 s in a run of
    40 asked for 30 x 0.05 = 2 s, which again gives 15 copy iterations)."""
    code = textwrap.dedent(
        """
        import json, time
        print(json.dumps({"event": "manifest", "workload": "membw", "unit": "B/s",
                          "min_iterations": 30, "started": time.time()}), flush=True)
        for index in range(40):
            start = time.time()
            time.sleep(0.05)
            print(json.dumps({"event": "iteration", "index": index, "start": start,
                              "end": time.time(), "work": 1e9,
                              "phase": "copy" if index % 2 == 0 else "triad"}), flush=True)
        print(json.dumps({"event": "result", "iterations": 40}), flush=True)
        """
    )
    runner = ProbeRunner(grace_seconds=30)
    spec = ProbeSpec("membw", "fp32", "eager", 30.0, CPU, "small")
    run = runner.run(spec, command=[sys.executable, "-c", code])
    assert run.outcome == "timeout"
    found = re.fullmatch(
        r"insufficient: 20 (copy|triad) iterations of ([\d.]+) s \(and 20 of its other phases\) "
        r"in 30 s; at least 30 are needed: use a --duration of at least (\d+) s",
        run.reason,
    )
    assert found is not None, run.reason
    span = run.iterations[-1].end - run.iterations[0].start
    # Twice the phase's own time at least: the other phase takes as long.
    assert int(found.group(3)) >= math.ceil(30 * span / 20) >= 2 * 30 * 0.05
