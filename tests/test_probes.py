"""The probe runner and the probe scheduler: outcomes of children that crash, raise, hang or
print junk; production-first skipping; the duty cycle; records in a real archive; abort on
restart. Children here are real processes; the scripts stand in for workloads that misbehave."""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from conftest import FakeGpus, start_agent
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, text
from test_bounded_runs import iteration_capped_python

from agent.archive.database import open_engine, upgrade
from agent.archive.probe_runs import ProbeRunWriter
from agent.config.settings import ProbingSection
from agent.probes.devices import TelemetryCapture, gpu_devices
from agent.probes.runner import (
    CPU,
    RUN_GRACE_SECONDS,
    ProbeRun,
    ProbeRunner,
    ProbeSpec,
    child_environment,
)
from agent.probes.scheduler import ProbeScheduler
from agent.telemetry.sampler import SamplerLoop
from agent.telemetry.store import TelemetryStore
from collectors.base import Reading, Sample
from collectors.host import HostCollector
from collectors.nvml.collector import NvmlCollector

SPEC = ProbeSpec("matmul", "fp32", "eager", 0.5, CPU)

MANIFEST = json.dumps({"event": "manifest", "workload": "matmul", "unit": "FLOP/s"})


def child(body: str) -> list[str]:
    """A child that prints the manifest and two iterations, then runs ``body``."""
    code = textwrap.dedent(
        f"""
        import json, os, sys, time
        print({MANIFEST!r}, flush=True)
        now = time.time()
        for i in range(2):
            print(json.dumps({{"event": "iteration", "index": i, "start": now + i,
                              "end": now + i + 0.5, "work": 1e9}}), flush=True)
        """
    )
    return [sys.executable, "-c", code + textwrap.dedent(body)]


OK = 'print(json.dumps({"event": "result", "iterations": 2, "throughput": 2e9}), flush=True)\n'


@pytest.fixture
def archive(tmp_path: Path) -> Iterator[Engine]:
    engine = open_engine(f"sqlite:///{tmp_path}/archive.db")
    upgrade(engine)
    yield engine
    engine.dispose()


def make_scheduler(
    engine: Engine | None = None,
    store: TelemetryStore | None = None,
    loops: tuple[SamplerLoop, ...] = (),
    runner: ProbeRunner | None = None,
    **settings: object,
) -> ProbeScheduler:
    return ProbeScheduler(
        ProbingSection.model_validate(settings),
        # The children here print their manifest at once: the allowance only has to cover a
        # loaded machine's interpreter start-up, and is generous (a hang after the manifest is
        # bounded by the duration and grace instead).
        runner or ProbeRunner(startup_timeout_seconds=60.0),
        store or TelemetryStore(64),
        TelemetryCapture(),
        loops,
        1.0,
        writer=None if engine is None else ProbeRunWriter(engine, "node-a"),
    )


def archived(engine: Engine) -> list[tuple[str, str, int]]:
    with engine.connect() as connection:
        rows = connection.execute(
            text("SELECT outcome, reason, iterations FROM probe_runs ORDER BY started_at, id")
        ).all()
    return [(row[0], row[1], row[2]) for row in rows]


def test_ok_run_keeps_manifest_iterations_and_result() -> None:
    run = ProbeRunner().run(SPEC, command=child(OK))
    assert (run.outcome, run.reason, run.exit_code) == ("ok", "", 0)
    assert run.manifest is not None
    assert run.manifest["workload"] == "matmul"
    assert [i.index for i in run.iterations] == [0, 1]
    assert run.throughput == 2e9


@pytest.mark.parametrize(
    ("body", "outcome", "reason"),
    [
        ("os.abort()\n", "failed", "killed by SIGABRT"),
        ("raise RuntimeError('matmul exploded')\n", "failed", "exit code 1: RuntimeError: matmul"),
        ("sys.exit(0)\n", "failed", "exited without a result line"),
        (
            'print(json.dumps({"event": "unsupported", "reason": "fp8 needs cc >= 8.9"}))\n',
            "unsupported",
            "fp8 needs cc >= 8.9",
        ),
    ],
)
def test_child_failures_are_recorded_with_their_reason(
    body: str, outcome: str, reason: str
) -> None:
    run = ProbeRunner().run(SPEC, command=child(body))
    assert run.outcome == outcome
    assert run.reason.startswith(reason), run.reason
    assert len(run.iterations) == 2  # what the child did before it died is kept


def test_a_hanging_child_and_its_children_are_killed_at_the_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    body = f"""
    import subprocess
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open({str(pid_file)!r}, "w").write(str(grandchild.pid))
    time.sleep(600)
    """
    runner = ProbeRunner(startup_timeout_seconds=60)
    started = time.monotonic()
    run = runner.run(SPEC, command=child(body))
    elapsed = time.monotonic() - started
    assert run.outcome == "timeout"
    assert "process group killed after 2 iterations" in run.reason
    # Killed at the duration and grace after its manifest (plus the kill grace and a loaded
    # machine's delays), not after the child's 600 s; never before the deadline.
    assert run.manifest is not None
    assert elapsed >= 0.5 + RUN_GRACE_SECONDS
    assert elapsed < 0.5 + RUN_GRACE_SECONDS + 2 * 2.0 + 60  # + start-up, kill grace, slack
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while alive(grandchild):  # SIGKILLed with its group; gone once the kernel is done
        assert time.monotonic() < deadline, "the grandchild outlived its group's kill"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for an init that may not reap it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def test_junk_on_stdout_is_counted_not_trusted() -> None:
    body = (
        'print("not json"); print("[1, 2]"); '
        'print(json.dumps({"event": "iteration", "index": 9, "start": 1, "end": 0, "work": 1}))\n'
        'print(json.dumps({"event": "iteration", "index": 9, "start": 0, "end": 1, "work": -5}))\n'
        'print(json.dumps({"event": "iteration", "index": 9, "start": "NaN", "end": 1, '
        '"work": 1}))\n' + OK
    )
    run = ProbeRunner().run(SPEC, command=child(body))
    assert run.outcome == "ok"
    assert run.protocol_errors == 5
    assert len(run.iterations) == 2


def test_child_environment_is_minimal() -> None:
    base = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "SUSTAIN_ARCHIVE__DATABASE_URL": "postgresql://u:secret@db/x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "CUDA_CACHE_PATH": "/tmp/cuda",
        "NCCL_DEBUG": "INFO",
    }
    env = child_environment(CPU, base)
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "CUDA_CACHE_PATH": "/tmp/cuda",
        "NCCL_DEBUG": "INFO",
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }


def test_agent_keeps_going_after_crash_raise_and_hang(archive: Engine) -> None:
    """Acceptance 2: each bad child is recorded; the next probe runs and succeeds."""
    scheduler = make_scheduler(archive, duty_cycle=1.0)
    bodies = ["os.abort()\n", "raise ValueError('bad')\n", "time.sleep(600)\n", OK]
    outcomes = [scheduler.run_one(SPEC, command=child(body)).outcome for body in bodies]
    assert outcomes == ["failed", "failed", "timeout", "ok"]
    rows = archived(archive)
    assert [row[0] for row in rows] == outcomes
    assert all(row[2] == 2 for row in rows)
    status = scheduler.status()
    assert status.runs[("matmul", "fp32", "eager", "cpu", "", "failed")] == 2


def test_duty_cycle_skips_and_says_why(archive: Engine) -> None:
    # A budget of 1.5 s an hour: one 1 s probe fits, a second does not.
    scheduler = make_scheduler(archive, duty_cycle=1.5 / 3600)
    spec = ProbeSpec("matmul", "fp32", "eager", 1.0, CPU)
    first = scheduler.run_one(spec, command=child("time.sleep(1.0)\n" + OK))
    assert first.outcome == "ok"
    second = scheduler.run_one(spec, command=child(OK))
    assert second.outcome == "skipped"
    used = first.ended_at - first.started_at  # 1 s and a bit, more on a loaded machine
    assert second.reason.startswith(f"duty cycle: {used:.0f} s of 2 s used on cpu in the last hour")
    assert [row[0] for row in archived(archive)] == ["ok", "skipped"]
    assert scheduler.run_one(spec, force=True, command=child(OK)).outcome == "ok"
    assert scheduler.status().duty_used[("cpu", "")] > 1.0 / 3600


def test_busy_cpu_is_skipped_but_own_probe_load_is_not_counted() -> None:
    store = TelemetryStore(256)
    scheduler = make_scheduler(store=store, busy_cpu_utilization=0.5, duty_cycle=1.0)
    own = scheduler.run_one(SPEC, command=child("time.sleep(0.5)\n" + OK))
    assert own.outcome == "ok"
    steps = 20
    for step in range(steps + 1):  # 90% CPU, but all of it while our own probe ran
        timestamp = own.started_at + (own.ended_at - own.started_at) * step / steps
        store.record(Sample("host", "host", timestamp, (Reading("cpu_utilization_ratio", 0.9),)))
    assert scheduler.skip_reason(SPEC) is None
    now = time.time()
    for second in range(5):  # then production load after it
        store.record(
            Sample("host", "host", now + second + 2, (Reading("cpu_utilization_ratio", 0.8),))
        )
    reason = scheduler.skip_reason(SPEC)
    assert reason is not None
    assert reason.startswith("CPU busy: mean utilization 80%")


FOREIGN = """
set driver_version 550.54.15
device 0 uuid GPU-00000000-0000-0000-0000-00000000000a
device 1 uuid GPU-00000000-0000-0000-0000-00000000000b
at 0 0 gpu_util_pct 0
at 0 1 gpu_util_pct 0
process 0 4242 1073741824 - -
"""


def test_foreign_process_on_a_fake_gpu_skips_probes_there_only(
    scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]], archive: Engine
) -> None:
    """Acceptance 3."""
    _, collector = scenario(FOREIGN, 1.0)
    store = TelemetryStore(64)
    for sample in collector.collect():
        store.record(sample)
    scheduler = make_scheduler(archive, store=store)
    gpus = scheduler.devices()
    assert [(d.label, d.key) for d in gpus] == [
        ("0", "GPU-00000000-0000-0000-0000-00000000000a"),
        ("1", "GPU-00000000-0000-0000-0000-00000000000b"),
    ]
    runs = [
        scheduler.run_one(ProbeSpec("matmul", "bf16", "eager", 0.5, gpu), command=child(OK))
        for gpu in gpus
    ]
    assert [run.outcome for run in runs] == ["skipped", "ok"]
    assert runs[0].reason == "1 foreign compute process(es) on GPU 0"
    assert archived(archive)[0] == ("skipped", "1 foreign compute process(es) on GPU 0", 0)
    status = scheduler.status()
    assert (
        status.runs[
            ("matmul", "bf16", "eager", "0", "GPU-00000000-0000-0000-0000-00000000000a", "skipped")
        ]
        == 1
    )


def test_the_agents_own_probe_child_is_not_foreign(
    scenario: Callable[[str, float], tuple[FakeGpus, NvmlCollector]],
) -> None:
    _, collector = scenario(FOREIGN.replace("process 0 4242", f"process 0 {os.getpid()}"), 1.0)
    store = TelemetryStore(64)
    for sample in collector.collect():
        store.record(sample)
    assert [d.label for d in gpu_devices(store)] == ["0", "1"]
    scheduler = make_scheduler(store=store)
    assert (
        scheduler.skip_reason(ProbeSpec("matmul", "bf16", "eager", 1, gpu_devices(store)[0]))
        is None
    )


class StampedCapture(TelemetryCapture):
    """The scheduler's capture, noting when it started and stopped keeping samples."""

    started_at = stopped_at = 0.0

    def start(self, probe_id: str, devices: Iterable[str]) -> None:
        self.started_at = time.time()
        super().start(probe_id, devices)

    def stop(self, probe_id: str) -> list[Sample]:
        samples = super().stop(probe_id)
        self.stopped_at = time.time()
        return samples


def test_fast_sampling_and_capture_during_a_probe() -> None:
    """While a probe runs, loops poll at the fast interval and the probe's samples are kept.

    Load-proof: the rate is judged by the gaps between the kept samples (0.1 s at the fast
    interval, 1 s at the baseline) with room for a loaded machine's late polls; the samples
    kept are bounded by when the capture started and stopped, the older samples of the same
    loop lying a second and a half before it."""
    store = TelemetryStore(512)
    capture = StampedCapture()
    loop = SamplerLoop(HostCollector(), 1.0, sinks=(store.record, capture.record), stall_seconds=30)
    scheduler = ProbeScheduler(
        ProbingSection(fast_interval_seconds=0.1), ProbeRunner(), store, capture, (loop,), 1.0
    )
    loop.start()
    try:
        deadline = time.monotonic() + 60
        while not store.latest():
            assert time.monotonic() < deadline, "the loop never polled"
            time.sleep(0.05)
        first = min(sample.timestamp for sample in store.latest())
        time.sleep(max(0.0, first + 1.5 - time.time()))
        run = scheduler.run_one(SPEC, force=True, command=child("time.sleep(3.0)\n" + OK))
    finally:
        loop.request_stop()
        loop.join(2)
    assert run.outcome == "ok"
    assert loop.interval_seconds == 1.0  # back to the baseline
    stamps = sorted(sample.timestamp for sample in run.telemetry)
    assert len(stamps) >= 6  # ~10 Hz for ~3 s (30 polls unloaded), not 1 Hz (3 or 4)
    gaps = [later - earlier for earlier, later in itertools.pairwise(stamps)]
    assert statistics.median(gaps) < 0.5, gaps
    assert capture.started_at <= run.started_at <= run.ended_at <= capture.stopped_at
    # A sample is stamped when its poll begins, and kept if it came in while the capture ran.
    assert all(capture.started_at - 1.0 <= stamp <= capture.stopped_at for stamp in stamps)
    assert first < capture.started_at - 1.0  # what an overeager capture would have kept


def test_unfinished_runs_become_aborted_at_the_next_start(archive: Engine) -> None:
    writer = ProbeRunWriter(archive, "node-a")
    writer.start("a" * 32, SPEC, time.time())
    assert archived(archive) == [("running", "", 0)]
    assert ProbeRunWriter(archive, "node-b").abort_unfinished() == 0  # other nodes' rows: no
    assert ProbeRunWriter(archive, "node-a").abort_unfinished() == 1
    assert archived(archive) == [("aborted", "the agent stopped during the run", 0)]


def test_stopping_the_runner_aborts_the_running_probe() -> None:
    runner = ProbeRunner(startup_timeout_seconds=60)
    result: list[ProbeRun] = []
    thread = threading.Thread(
        target=lambda: result.append(runner.run(SPEC, command=child("time.sleep(600)\n")))
    )
    thread.start()
    deadline = time.monotonic() + 60
    while not runner.child_pids():  # the child is running (its start-up is the machine's)
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    started = time.monotonic()
    runner.stop()
    thread.join(60)
    assert not thread.is_alive()
    # At once (SIGTERM, the kill grace at the most, and a loaded machine's delays), not after
    # the child's 600 s.
    assert time.monotonic() - started < 2 * 2.0 + 30
    assert result[0].outcome == "aborted"


def test_the_daemon_process_never_imports_torch() -> None:
    code = (
        "import sys, agent.daemon, agent.cli.main, agent.probes.scheduler; "
        "print(*(m in sys.modules for m in ('torch', 'numpy', 'scipy', 'agent.analysis'))); "
        "print(*sorted(m for m in sys.modules if m.split('.')[0] == 'workloads'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    imported, workloads = result.stdout.splitlines()
    # scipy and the analysis stay out too: they alone would take the daemon past 100 MB.
    assert imported.split() == ["False", "False", "False", "False"]
    # Of the workloads only the catalogue of names, plain data, for checking the configuration.
    assert workloads.split() == ["workloads", "workloads.catalog"]


@pytest.mark.slow  # a whole probe command end to end (left out of the quick tier)
def test_sustain_probe_json_from_the_command_line(tmp_path: Path) -> None:
    """Acceptance 4 (on this CPU): the manifest and the per-iteration count, as JSON. The child
    stops after 45 iterations (probing.python, a wrapper), within a duration that only bounds
    it: a loaded machine makes the run longer, never short of the analysis minimum."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    env["SUSTAIN_PROBING__PYTHON"] = str(iteration_capped_python(tmp_path, 45))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent",
            "probe",
            "--workload",
            "matmul",
            "--precision",
            "fp32",
            "--duration",
            "60",
            "--json",
            "--force",  # the suite's own load must not skip it; the busy check is tested apart
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    (run,) = json.loads(result.stdout)["runs"]
    assert (run["workload"], run["precision"], run["device"], run["outcome"]) == (
        "matmul",
        "fp32",
        "cpu",
        "ok",
    )
    assert run["manifest"]["workload"] == "matmul"
    assert run["manifest"]["precision"] == "fp32"
    assert run["iterations"] > 0
    assert run["iterations"] == run["result"]["iterations"]
    assert run["throughput"] > 1e8  # FLOP/s of a CPU: more than 0.1 GFLOP/s
    assert run["ratio_to_best"] == 1.0


LOADED_GRACE_SECONDS = 60.0  # as test_node_wide's: a stalled iteration is waited for


def sustain_probe(*args: str) -> subprocess.CompletedProcess[str]:
    """``sustain probe`` with the default settings but a generous run grace: on a loaded machine
    one iteration can stall past the default 3 s, and the run would end as a timeout for that
    alone (the grace itself is tested by
    ``test_a_hanging_child_and_its_children_are_killed_at_the_timeout``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    env["COLUMNS"] = "100"  # the widest a block of the text output gets
    env["SUSTAIN_PROBING__RUN_GRACE_SECONDS"] = str(LOADED_GRACE_SECONDS)
    return subprocess.run(
        [sys.executable, "-m", "agent", "probe", *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
    )


@pytest.mark.slow  # a whole probe command end to end (left out of the quick tier)
def test_sustain_probe_reports_each_precision_against_the_best() -> None:
    """Each precision's throughput is put against the device's best one, so a slow fallback path
    (fp16 on this CPU) shows as a ratio, not as an error; fp8 cannot run here: unsupported, with
    the reason, never a number. A run bounded before the analysis minimum is insufficient (a
    timeout that says so), never ok: the machine's load decides which, so both are accepted."""
    result = sustain_probe(
        "--workload", "matmul", "--precision", "bf16", "--precision", "fp16",
        "--precision", "fp8", "--duration", "3", "--force", "--json",
    )  # fmt: skip
    runs = {run["precision"]: run for run in json.loads(result.stdout)["runs"]}
    finished = {p: runs[p] for p in ("bf16", "fp16") if runs[p]["outcome"] == "ok"}
    for precision in ("bf16", "fp16"):
        if precision not in finished:
            assert runs[precision]["outcome"] == "timeout", runs[precision]
            assert runs[precision]["reason"].startswith("insufficient: "), runs[precision]
            assert runs[precision]["ratio_to_best"] is None
    assert result.returncode == (0 if len(finished) == 2 else 1), result.stderr
    if finished:
        best = max(run["throughput"] for run in finished.values())
        for run in finished.values():
            assert run["iterations"] >= 30
            assert run["ratio_to_best"] == pytest.approx(run["throughput"] / best)
        assert max(run["ratio_to_best"] for run in finished.values()) == 1.0
    assert runs["fp8"]["outcome"] == "unsupported"
    assert "8.9" in runs["fp8"]["reason"] or "CUDA" in runs["fp8"]["reason"]
    assert runs["fp8"]["throughput"] is None
    assert runs["fp8"]["ratio_to_best"] is None

    # --force: the busy check (another matter) must not skip it on a loaded test machine.
    text = sustain_probe("--workload", "matmul", "--precision", "fp8", "--duration", "1", "--force")
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("matmul fp8 eager on cpu: unsupported\n"), text.stdout
    reason = text.stdout.splitlines()[1].split()
    assert reason[0] == "reason"


def test_sustain_probe_unknown_device_is_one_line_exit_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agent", "probe", "--device", "7", "--workload", "matmul"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "sustain: error: no device '7' here (devices: cpu)"
    ]


@pytest.mark.slow
def test_the_daemon_runs_its_plan_and_archives_the_runs(tmp_path: Path) -> None:
    config = tmp_path / "sustain.toml"
    # 40 iterations, within a duration that only bounds them: ok however loaded the machine is.
    python = iteration_capped_python(tmp_path, 40)
    config.write_text(
        textwrap.dedent(
            f"""
            [probing]
            initial_delay_seconds = 0
            duty_cycle = 0.5
            preempt = false  # the suite's other processes are foreign work too
            python = "{python}"

            [[probing.plan]]
            workload = "matmul"
            precisions = ["fp32"]
            duration_seconds = 60
            size = "small"
            interval_seconds = 3600
            jitter_seconds = 0
            """
        )
    )
    running = start_agent(tmp_path, "--config", str(config))
    try:
        body = running.wait_for("sustain_probe_flops{", timeout=120)
    finally:
        code, _, err = running.terminate()
    assert code == 0, err
    runs = {
        (sample.labels["workload"], sample.labels["device"], sample.labels["outcome"]): sample.value
        for family in text_string_to_metric_families(body)
        if family.name == "sustain_probe_runs"
        for sample in family.samples
    }
    assert runs[("matmul", "cpu", "ok")] == 1
    # Acceptance 4 of issue 5: the result on /metrics with peak and steady.
    figures = {
        sample.labels["stat"]: sample.value
        for family in text_string_to_metric_families(body)
        if family.name == "sustain_probe_flops"
        for sample in family.samples
    }
    assert figures["peak"] > 1e8
    assert "steady" in figures or "no_steady_state" in body
    engine = open_engine(f"sqlite:///{tmp_path}/sustain.db")
    try:
        rows = archived(engine)
        with engine.connect() as connection:
            (series,) = connection.execute(text("SELECT iterations FROM probe_series")).one()
    finally:
        engine.dispose()
    assert rows[0][0] == "ok"
    assert len(json.loads(series)) == rows[0][2] > 0
    engine = open_engine(f"sqlite:///{tmp_path}/sustain.db")
    try:
        with engine.connect() as connection:
            classification, peak, analysis = connection.execute(
                text("SELECT classification, peak_throughput, analysis FROM probe_runs")
            ).one()
    finally:
        engine.dispose()
    assert classification in ("flat", "warmup", "slowdown", "no_steady_state")
    assert peak > 1e8
    assert "attribution" in json.loads(analysis)
    # Issue 6: the run names its stack, the stack is archived once, and exported.
    engine = open_engine(f"sqlite:///{tmp_path}/sustain.db")
    try:
        with engine.connect() as connection:
            stack_id, model = connection.execute(
                text("SELECT stack_id, device_model FROM probe_runs")
            ).one()
            facts = connection.execute(
                text("SELECT facts FROM stack_snapshots WHERE stack_id = :id"), {"id": stack_id}
            ).scalar_one()
            changes = connection.execute(
                text("SELECT attributes FROM events WHERE kind = 'stack_changed'")
            ).all()
    finally:
        engine.dispose()
    assert len(stack_id) == 64
    assert model  # torch's name for the CPU device
    assert json.loads(facts)["torch"]["version"].startswith("2.")
    assert [json.loads(row[0])["new"] for row in changes] == [stack_id]
    assert f'stack_id="{stack_id}"' in body
