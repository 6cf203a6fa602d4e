"""Bounded runs: a probe child is stopped at its duration plus a grace, counted from its manifest;
a run with fewer iterations than the analysis needs is never `ok`; problems shrink to fit the
minimum in the duration; a precision the device lacks natively is left out of the default plan
and, asked for, is reported as such.

The runner-level tests use small scripts that speak the child protocol slowly; the others run
the real workloads on this machine's CPU, whose bf16 support is read from /proc/cpuinfo, never
assumed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from agent.config.settings import ProbingSection
from agent.probes.devices import plan_precisions
from agent.probes.runner import CPU, ProbeRunner, ProbeSpec
from agent.verdict import MIN_ITERATIONS

ROOT = Path(__file__).resolve().parent.parent
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 flags, aarch64 Features


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


NATIVE_BF16 = bool(cpu_flags() & NATIVE_BF16_FLAGS)


def slow_child(
    *, before_manifest: float, every: float, count: int, result: bool, **manifest: Any
) -> list[str]:
    """A child that sleeps, writes its manifest, then ``count`` iterations ``every`` seconds
    apart (forever for count -1), then a result line if ``result``."""
    head = {"event": "manifest", "workload": "matmul", "unit": "FLOP/s", **manifest}
    code = textwrap.dedent(
        f"""
        import itertools, json, time
        time.sleep({before_manifest})
        print(json.dumps({head!r}), flush=True)
        counter = itertools.count() if {count} < 0 else range({count})
        for index in counter:
            start = time.time()
            time.sleep({every})
            line = {{"event": "iteration", "index": index, "start": start, "end": time.time(),
                     "work": 1e9}}
            print(json.dumps(line), flush=True)
        if {result}:
            print(json.dumps({{"event": "result", "iterations": {count}}}), flush=True)
        """
    )
    return [sys.executable, "-c", code]


def test_a_child_is_killed_at_its_duration_plus_grace_and_keeps_its_iterations() -> None:
    """Iterations of 0.3 s for ever: killed 1 s + 0.5 s after the manifest, not at the runner's
    start-up allowance; the iterations received are kept and the run is insufficient."""
    runner = ProbeRunner(startup_timeout_seconds=60, grace_seconds=0.5)
    spec = ProbeSpec("matmul", "bf16", "eager", 1.0, CPU)
    command = slow_child(
        before_manifest=0, every=0.3, count=-1, result=False, min_iterations=MIN_ITERATIONS
    )
    run = runner.run(spec, command=command)
    assert run.iterations
    measured = run.ended_at - run.iterations[0].start  # the first begins at the manifest
    assert 1.5 <= measured < 1.5 + 1.0, measured  # duration + grace, plus the kill and reap
    assert run.outcome == "timeout"
    assert run.exit_code is None
    kept = len(run.iterations)
    assert 3 <= kept <= 5
    assert [iteration.index for iteration in run.iterations] == list(range(kept))
    assert run.reason.startswith(f"insufficient: {kept} iterations of 0.3")
    assert f"in 1 s; at least {MIN_ITERATIONS} are needed: use --size small or a --duration" in (
        run.reason
    )
    assert f"(stopped at 1 s + 0.5 s grace; process group killed after {kept} iterations)" in (
        run.reason
    )


def test_the_measured_window_starts_at_the_manifest() -> None:
    """4 s of start-up, then 3 s of iterations for a 0.5 s duration: within the start-up
    timeout (6 s) and within the grace (4 s), so the child finishes. Start-up is not charged to
    the run (a bound of duration + start-up timeout from the spawn would end it at 6.5 s)."""
    runner = ProbeRunner(startup_timeout_seconds=6, grace_seconds=4)
    spec = ProbeSpec("matmul", "fp32", "eager", 0.5, CPU)
    command = slow_child(before_manifest=4, every=0.2, count=15, result=True, min_iterations=15)
    started = time.monotonic()
    run = runner.run(spec, command=command)
    assert time.monotonic() - started > 6.5
    assert (run.outcome, run.reason, run.exit_code) == ("ok", "", 0)
    assert len(run.iterations) == 15


def test_a_child_without_a_manifest_is_killed_at_the_start_up_timeout() -> None:
    runner = ProbeRunner(startup_timeout_seconds=1.0, grace_seconds=0.5)
    started = time.monotonic()
    run = runner.run(
        ProbeSpec("matmul", "fp32", "eager", 0.5, CPU),
        command=[sys.executable, "-c", "import time; time.sleep(600)"],
    )
    assert time.monotonic() - started < 1.0 + 2 * 2.0 + 1  # timeout, kill grace, slack
    assert run.outcome == "timeout"
    assert run.reason == (
        "no manifest within the start-up timeout of 1 s; process group killed after 0 iterations"
    )


def test_fewer_iterations_than_the_minimum_are_never_ok() -> None:
    """A child that ends by itself with a result but 3 of the 30 iterations it declared."""
    runner = ProbeRunner(grace_seconds=0.5)
    spec = ProbeSpec("matmul", "bf16", "eager", 0.5, CPU, "small")
    command = slow_child(
        before_manifest=0,
        every=0.2,
        count=3,
        result=True,
        min_iterations=MIN_ITERATIONS,
        native=False,
        native_reason="bf16 on this CPU has no native support (no avx512_bf16 or amx_bf16 flag)",
        slow_path="bf16 on this CPU has no native support (no avx512_bf16 flag): 0.004 of fp32",
    )
    run = runner.run(spec, command=command)
    assert run.outcome == "timeout"
    assert run.exit_code == 0
    found = re.fullmatch(
        rf"insufficient: 3 iterations of 0\.2\d* s in 0\.5 s; at least {MIN_ITERATIONS} are "
        r"needed: use a --duration of at least (\d+) s; slow path: .*",
        run.reason,
    )
    assert found is not None, run.reason
    assert int(found.group(1)) >= MIN_ITERATIONS * 0.2
    assert run.reason.endswith(
        "; slow path: bf16 on this CPU has no native support (no avx512_bf16 flag): 0.004 of fp32"
    )


def test_the_runner_asks_the_child_for_the_minimum() -> None:
    command = ProbeRunner().command(ProbeSpec("matmul", "bf16", "eager", 2.0, CPU))
    assert command[command.index("--min-iterations") + 1] == str(MIN_ITERATIONS)


def workloads_run(*args: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "workloads", "run", "--device=cpu", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_the_problem_shrinks_until_the_minimum_fits_the_duration() -> None:
    """A 2048^3 fp32 matmul on one thread takes far more than 1 s / 30 on any CPU: the child
    halves the sides until 30 iterations fit with room to spare, and records the size."""
    manifest, *iterations, result = workloads_run(
        "--workload=matmul", "--precision=fp32", "--threads=1", "--duration=1",
        f"--min-iterations={MIN_ITERATIONS}",
    )  # fmt: skip
    assert manifest["min_iterations"] == MIN_ITERATIONS
    size = manifest["size"]
    assert size.startswith("default/"), size
    divisor = int(size.removeprefix("default/"))
    side = manifest["shapes"]["a"][0]
    assert side == max(32, 2048 // divisor)
    fit = manifest["fit"]
    assert fit["share_seconds"] == pytest.approx(1 / MIN_ITERATIONS)
    assert fit["trials"][0]["size"] == "default/32"  # climbed from the smallest
    # The last trial: the size chosen, or the next bigger one that did not fit ("default" itself
    # after "default/2": the undivided size has no divisor in its label).
    bigger = "default" if divisor == 2 else f"default/{divisor // 2}"
    assert [trial["size"] for trial in fit["trials"]][-1] in (size, bigger)
    if fit["fits"]:
        assert fit["iteration_seconds"] <= fit["share_seconds"] / 2
        assert result["iterations"] >= MIN_ITERATIONS
    assert result["iterations"] == len(iterations)
    assert manifest["native"] is True
    assert manifest["reference"] is None
    assert manifest["slow_path"] is None


def test_a_node_wide_child_sizes_for_its_neighbours_too() -> None:
    """``--neighbours 1`` (one other child measured at once): the share of one iteration is
    halved, so a child that sized alone still fits the minimum beside a neighbour taking half
    the CPU; the manifest records the count."""
    manifest, *_ = workloads_run(
        "--workload=matmul", "--precision=fp32", "--threads=1", "--duration=1",
        f"--min-iterations={MIN_ITERATIONS}", "--neighbours=1", "--max-iterations=2",
    )  # fmt: skip
    fit = manifest["fit"]
    assert fit["share_seconds"] == pytest.approx(1 / (2 * MIN_ITERATIONS))
    assert fit["neighbours"] == 1
    assert manifest["min_iterations"] == MIN_ITERATIONS  # what the run must still deliver
    if fit["fits"]:
        assert fit["iteration_seconds"] <= fit["share_seconds"] / 2


def test_without_a_minimum_the_size_is_left_alone() -> None:
    manifest, *_ = workloads_run(
        "--workload=matmul", "--precision=fp32", "--size=small", "--max-iterations=2"
    )
    assert manifest["size"] == "small"
    assert manifest["shapes"]["a"] == [512, 256]
    assert (manifest["fit"], manifest["min_iterations"]) == (None, None)


def test_workloads_list_reports_native_precisions_as_cpuinfo_has_them() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "workloads", "list", "--device=cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    precisions = json.loads(done.stdout)["precisions"]
    assert precisions["fp32"] == {"native": True, "reason": None}
    assert precisions["bf16"]["native"] is NATIVE_BF16
    if not NATIVE_BF16:
        assert precisions["bf16"]["reason"].startswith("bf16 on this CPU has no native support")


def test_the_default_plan_leaves_out_what_the_device_lacks_natively() -> None:
    """bf16 stays in the default plan only where the CPU has it natively; a plan the
    configuration gives keeps every precision it lists."""
    default = ProbingSection()
    (matmul, *_) = default.plan
    assert matmul.precisions == ["bf16", "fp32"]
    runner = ProbeRunner()
    kept = plan_precisions(default, matmul, runner, CPU)
    assert kept == (["bf16", "fp32"] if NATIVE_BF16 else ["fp32"])
    given = ProbingSection.model_validate(
        {"plan": [{"workload": "matmul", "precisions": ["bf16", "fp32"], "interval_seconds": 60}]}
    )
    assert plan_precisions(given, given.plan[0], runner, CPU) == ["bf16", "fp32"]


def test_nothing_is_left_out_on_a_guess() -> None:
    """A probe interpreter that cannot list the device's precisions leaves the plan whole."""
    runner = ProbeRunner(python="/bin/false")
    assert runner.lacking_native(CPU) == {}
    default = ProbingSection()
    assert plan_precisions(default, default.plan[0], runner, CPU) == ["bf16", "fp32"]


def sustain_probe(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "agent", "probe", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    return done, time.monotonic() - started


def test_sustain_probe_bf16_for_2_s_is_bounded_and_never_ok_with_one_iteration() -> None:
    """Acceptance 2. ``--force``: the busy check (another matter) must not skip it on a shared
    test machine."""
    done, wall = sustain_probe(
        "--precision", "bf16", "--duration", "2", "--device", "cpu", "--json", "--force"
    )
    assert done.returncode in (0, 1), done.stderr
    # The plan's matmul; membw has no bf16 (whether it is left out or fails is another matter).
    run = {run["workload"]: run for run in json.loads(done.stdout)["runs"]}["matmul"]
    manifest = run["manifest"]
    measured = run["ended_at"] - manifest["started"]
    grace = max(3.0, 2 / MIN_ITERATIONS)
    assert measured < 2 + grace + 2, measured  # duration + grace, plus the kill or the exit
    assert wall < 240, wall  # start-up is bounded apart (imports, sizing the problem)
    if run["outcome"] == "ok":
        assert run["iterations"] >= MIN_ITERATIONS
    else:
        assert run["outcome"] == "timeout"
        assert run["reason"].startswith("insufficient: ")
    if NATIVE_BF16:
        assert "native support" not in run["reason"]
        assert manifest["native"] is True
    else:
        assert manifest["native"] is False
        assert "bf16 on this CPU has no native support" in run["reason"]
        assert manifest["size"].startswith("default/")  # shrunk: 2048^3 takes about a minute


def test_sustain_probe_runs_the_default_plan_without_what_the_cpu_lacks() -> None:
    done, _ = sustain_probe(
        "--workload", "matmul", "--duration", "1", "--size", "small", "--device", "cpu",
        "--json", "--force",
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    precisions = [run["precision"] for run in json.loads(done.stdout)["runs"]]
    assert precisions == (["bf16", "fp32"] if NATIVE_BF16 else ["fp32"])
