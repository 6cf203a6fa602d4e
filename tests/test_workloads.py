"""The probe child process, run for real: `python -m workloads ...`, its JSON lines parsed.

The command line and the JSON lines are the contract with the agent (workloads/README.md), so the
tests go through them rather than through the classes. Each run is about 2 s at --size small.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from workloads.cli import main
from workloads.device import DeviceInfo, last_level_cache_bytes
from workloads.matmul import FALLBACK_CACHE_BYTES
from workloads.membw import Membw

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
MANIFEST_FIELDS = {
    "event",
    "workload",
    "version",
    "unit",
    "work_unit",
    "precision",
    "optimization",
    "size",
    "device",
    "device_name",
    "timer",
    "shapes",
    "parameters",
    "torch",
    "backends",
    "kernel",
    "threads",
    "duration_target",
    "max_iterations",
    "started",
    "pid",
}
RESULT_FIELDS = {
    "event",
    "iterations",
    "duration",
    "elapsed",
    "work",
    "throughput",
    "kernel",
}


@dataclass(frozen=True, slots=True)
class Child:
    returncode: int
    lines: list[dict[str, Any]]
    stderr: str
    began: float
    ended: float

    @property
    def manifest(self) -> dict[str, Any]:
        assert self.lines[0]["event"] == "manifest", self.lines[0]
        return self.lines[0]

    @property
    def iterations(self) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["event"] == "iteration"]

    @property
    def result(self) -> dict[str, Any]:
        assert self.lines[-1]["event"] == "result", self.lines[-1]
        return self.lines[-1]


def child(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> Child:
    """Run the child; every stdout line must be a JSON object, whatever the outcome."""
    began = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "workloads", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )
    ended = time.time()
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert all(isinstance(line, dict) for line in lines)
    return Child(done.returncode, lines, done.stderr, began, ended)


def probe(workload: str, precision: str, *extra: str, duration: float = 2.0) -> Child:
    """A probe run on the CPU that must succeed, with the checks every run must pass."""
    run = child(
        "run",
        f"--workload={workload}",
        f"--precision={precision}",
        "--device=cpu",
        f"--duration={duration}",
        *extra,
    )
    assert run.returncode == 0, run.stderr
    assert_well_formed(run)
    return run


def assert_well_formed(run: Child) -> None:
    manifest, iterations, result = run.manifest, run.iterations, run.result
    assert set(manifest) >= MANIFEST_FIELDS
    assert manifest["timer"] == "perf_counter"
    assert manifest["device"] == "cpu"
    assert manifest["torch"] == torch.__version__
    assert manifest["pid"] > 0
    assert run.lines == [manifest, *iterations, result]
    assert [i["index"] for i in iterations] == list(range(len(iterations)))
    assert iterations, "at least one iteration"
    previous_end = run.began
    for iteration in iterations:
        assert previous_end <= iteration["start"] <= iteration["end"] <= run.ended
        assert iteration["work"] > 0
        previous_end = iteration["end"]

    assert set(result) >= RESULT_FIELDS
    assert result["iterations"] == len(iterations)
    busy = math.fsum(i["end"] - i["start"] for i in iterations)
    assert result["duration"] == pytest.approx(busy)
    assert result["work"] == pytest.approx(math.fsum(i["work"] for i in iterations))
    assert result["throughput"] == pytest.approx(result["work"] / result["duration"])
    assert result["elapsed"] == pytest.approx(iterations[-1]["end"] - iterations[0]["start"])
    # Stopped by the duration, checked between iterations: no iteration starts after it (give or
    # take the instant between the check and the start).
    if manifest["max_iterations"] is None:
        last_start = iterations[-1]["start"] - iterations[0]["start"]
        assert last_start < manifest["duration_target"] + 0.05


def rates(run: Child, phase: str) -> list[float]:
    return [i["work"] / (i["end"] - i["start"]) for i in run.iterations if i.get("phase") == phase]


@pytest.mark.parametrize(
    ("precision", "duration"), [("fp32", 2.0), ("bf16", 1.0), ("fp16", 1.0), ("int8", 1.0)]
)
def test_matmul_flops_are_2mnk_per_iteration(precision: str, duration: float) -> None:
    run = probe("matmul", precision, "--size=small", duration=duration)
    manifest = run.manifest
    (m, k), (k2, n) = manifest["shapes"]["a"], manifest["shapes"]["b"]
    assert k == k2
    assert manifest["unit"] == "FLOP/s"
    assert manifest["work_unit"] == "flop"
    assert manifest["precision"] == precision
    repeats = manifest["parameters"]["repeats"]
    assert {i["work"] for i in run.iterations} == {2 * m * n * k * repeats}
    result = run.result
    flops = 2 * m * n * k * repeats * result["iterations"] / result["duration"]
    assert result["throughput"] == pytest.approx(flops)
    assert result["throughput"] > 1e8  # even a slow fallback path does more than 0.1 GFLOP/s
    expected = "torch._int_mm" if precision == "int8" else "torch.matmul"
    assert manifest["kernel"] == result["kernel"] == expected


def test_matmul_flush_cache_runs_between_iterations() -> None:
    run = probe("matmul", "fp32", "--size=small", "--flush-cache", "--max-iterations=4")
    parameters = run.manifest["parameters"]
    assert parameters["flush_cache"] is True
    assert parameters["flush_bytes"] == 2 * (last_level_cache_bytes() or FALLBACK_CACHE_BYTES)
    assert run.result["iterations"] == 4
    # The flush happens outside the timed windows: time passes between iterations.
    assert run.result["elapsed"] > run.result["duration"]


def test_membw_bytes_follow_the_buffer_size() -> None:
    run = probe("membw", "fp32", "--size=small")
    parameters = run.manifest["parameters"]
    n, element, repeats = parameters["elements"], parameters["element_bytes"], parameters["repeats"]
    assert run.manifest["shapes"] == {"a": [n], "b": [n], "c": [n]}
    assert parameters["array_bytes"] == n * element
    phases = [i["phase"] for i in run.iterations]
    assert phases == ["copy", "triad"] * (len(phases) // 2) + ["copy"] * (len(phases) % 2)
    for iteration in run.iterations:
        per_element = 2 if iteration["phase"] == "copy" else 3
        assert iteration["work"] == per_element * n * element * repeats
    result_phases = run.result["phases"]
    assert set(result_phases) == {"copy", "triad"}
    assert result_phases["copy"]["iterations"] + result_phases["triad"]["iterations"] == len(phases)
    for name, totals in result_phases.items():  # membw states nothing of its own per phase
        assert set(totals) == {"iterations", "duration", "work", "throughput"}
        assert totals["throughput"] == pytest.approx(totals["work"] / totals["duration"])
        assert totals["iterations"] == phases.count(name)
    assert min(rates(run, "copy")) > 1e8


@pytest.mark.parametrize(
    ("cache", "free", "expected"),
    [
        (300 * MIB, 24 << 30, 1200 * MIB),  # this machine: STREAM's 4x the last-level cache
        (32 * MIB, 24 << 30, 256 * MIB),  # a small cache: at least 256 MiB all the same
        (1 << 30, 64 << 30, 2 << 30),  # a huge cache: capped at 2 GiB
        (300 * MIB, 6 << 30, 512 * MIB),  # little memory: three arrays in a quarter of it
    ],
)
def test_membw_arrays_are_far_larger_than_the_last_level_cache(
    cache: int, free: int, expected: int
) -> None:
    cpu = DeviceInfo(
        kind="cpu",
        torch_device="cpu",
        name="test",
        capability=None,
        memory_total_bytes=free,
        memory_free_bytes=free,
        cache_bytes=cache,
        cuda_device_count=0,
    )
    assert Membw.array_bytes(cpu) == expected


def test_the_last_level_cache_is_read_from_sysfs(tmp_path: Path) -> None:
    for index, (level, kind, size) in enumerate(
        [
            (1, "Data", "48K"),
            (1, "Instruction", "32K"),
            (2, "Unified", "2048K"),
            (3, "Unified", "300M"),
        ]
    ):
        entry = tmp_path / f"index{index}"
        entry.mkdir()
        (entry / "level").write_text(f"{level}\n")
        (entry / "type").write_text(f"{kind}\n")
        (entry / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes(tmp_path) == 300 * MIB
    assert last_level_cache_bytes(tmp_path / "absent") is None


@pytest.mark.parametrize(
    ("precision", "causal", "duration"), [("fp32", False, 2.0), ("bf16", True, 1.0)]
)
def test_attention_flops_and_backend(precision: str, causal: bool, duration: float) -> None:
    causal_flag = ["--causal"] if causal else []
    run = probe("attention", precision, "--size=small", *causal_flag, duration=duration)
    manifest = run.manifest
    batch, heads, seq, head_dim = manifest["shapes"]["q"]
    flop = 4 * batch * heads * seq * seq * head_dim * manifest["parameters"]["repeats"]
    expected = flop // 2 if causal else flop
    assert {i["work"] for i in run.iterations} == {expected}
    assert manifest["parameters"]["causal"] is causal
    # Whatever torch dispatches to on this CPU, it is named, and the same in the result.
    assert manifest["kernel"] in {"flash", "math"}
    assert run.result["kernel"] == manifest["kernel"]


def test_inference_eager_reports_tokens_and_latency_percentiles() -> None:
    run = probe("inference", "fp32", "--size=small")
    parameters = run.manifest["parameters"]
    batch, prompt, generate = parameters["batch"], parameters["prompt"], parameters["generate"]
    assert run.manifest["unit"] == "tokens/s"
    assert run.manifest["kernel"].startswith("sdpa:")
    # One round is a prefill of the prompt and then one decode step per generated token.
    for index, iteration in enumerate(run.iterations):
        prefill = index % (generate + 1) == 0
        assert iteration["phase"] == ("prefill" if prefill else "decode")
        assert iteration["work"] == (batch * prompt if prefill else batch)
    result = run.result
    assert result["prefill_tokens_per_second"] > 0
    assert result["decode_tokens_per_second"] > 0
    decode_seconds = math.fsum(
        i["end"] - i["start"] for i in run.iterations if i["phase"] == "decode"
    )
    decode_tokens = sum(i["work"] for i in run.iterations if i["phase"] == "decode")
    assert result["decode_tokens_per_second"] == pytest.approx(decode_tokens / decode_seconds)
    latency = result["latency_seconds"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"]
    # Each phase states its own figures; the per-token latency is decode's.
    phases = result["phases"]
    assert phases["decode"]["throughput"] == pytest.approx(result["decode_tokens_per_second"])
    assert phases["prefill"]["throughput"] == pytest.approx(result["prefill_tokens_per_second"])
    assert phases["decode"]["latency_seconds"] == latency
    assert "latency_seconds" not in phases["prefill"]
    slowest = max(i["end"] - i["start"] for i in run.iterations if i["phase"] == "decode")
    assert latency["p99"] <= slowest
    # How many steps fit in 2 s depends on the machine's load; that some decode steps ran does not.
    assert sum(1 for i in run.iterations if i["phase"] == "decode") >= 1


@pytest.mark.slow
def test_inference_compiled_compiles_before_the_manifest() -> None:
    """Tens of seconds on a cold inductor cache: compiling is part of setup, not of the run."""
    run = child(
        "run",
        "--workload=inference",
        "--precision=fp32",
        "--optimization=compiled",
        "--device=cpu",
        "--size=small",
        "--duration=2",
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert_well_formed(run)
    manifest = run.manifest
    assert manifest["optimization"] == "compiled"
    assert manifest["kernel"] == "inductor"
    seconds = manifest["parameters"]["compile"]["seconds"]
    assert set(seconds) == {"prefill", "decode"}
    assert run.result["decode_tokens_per_second"] > 0
    assert manifest["started"] >= run.began + seconds["prefill"] + seconds["decode"]


@pytest.mark.slow  # a whole probe command end to end (left out of the quick tier)
def test_compiler_failure_is_unsupported_not_a_crash(tmp_path: Path) -> None:
    """A compiler that exists and fails: caught while compiling (a cold cache forces the call)."""
    run = child(
        "run",
        "--workload=inference",
        "--precision=fp32",
        "--optimization=compiled",
        "--device=cpu",
        "--size=small",
        "--duration=2",
        env={"CXX": "/bin/false", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr
    [line] = run.lines
    assert line["event"] == "unsupported"
    assert line["reason"].startswith("torch.compile failed:")


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--workload=h2d", "--precision=fp32"], "h2d needs a CUDA device"),
        (["--workload=d2h", "--precision=fp32"], "d2h needs a CUDA device"),
        (["--workload=matmul", "--precision=fp8"], "compute capability >= 8.9"),
        (["--workload=matmul", "--precision=tf32"], "tf32 is a CUDA tensor-core mode"),
        (["--workload=allreduce", "--precision=fp32"], "2 or more CUDA devices"),
        (
            ["--workload=inference", "--precision=fp32", "--optimization=compiled"],
            "needs a C++ compiler",
        ),
    ],
)
def test_what_the_cpu_cannot_run_is_one_unsupported_line(args: list[str], reason: str) -> None:
    env = {"CXX": "/nonexistent/c++"} if "--optimization=compiled" in args else None
    run = child("run", *args, "--device=cpu", "--duration=2", env=env)
    assert run.returncode == 0, run.stderr
    [line] = run.lines
    assert line["event"] == "unsupported"
    assert reason in line["reason"]


def test_a_cuda_device_on_a_cpu_build_is_unsupported() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    run = child("run", "--workload=matmul", "--precision=fp32", "--device=cuda:0")
    assert run.returncode == 0, run.stderr
    [line] = run.lines
    assert line["event"] == "unsupported"
    assert "CUDA" in line["reason"]


def test_max_iterations_stops_the_run() -> None:
    run = probe("matmul", "fp32", "--size=small", "--max-iterations=3", duration=60)
    assert run.result["iterations"] == 3
    assert run.manifest["max_iterations"] == 3


def test_list_describes_every_workload_for_the_device() -> None:
    run = child("list", "--json", "--device=cpu")
    assert run.returncode == 0, run.stderr
    [listing] = run.lines
    workloads = listing["workloads"]
    assert set(workloads) == {
        "matmul",
        "membw",
        "h2d",
        "d2h",
        "attention",
        "inference",
        "allreduce",
    }
    for description in workloads.values():
        assert {"version", "unit", "work_unit", "precisions", "optimizations", "applies"} <= set(
            description
        )
        for support in [
            *description["precisions"].values(),
            *description["optimizations"].values(),
        ]:
            assert support["supported"] is (support["reason"] is None)
    matmul = workloads["matmul"]["precisions"]
    assert matmul["fp32"] == {"supported": True, "reason": None}
    assert matmul["fp8"]["supported"] is False
    assert matmul["fp16"]["supported"] is True  # slow on many CPUs: a finding, not unsupported
    assert workloads["h2d"]["applies"] is False
    assert workloads["allreduce"]["applies"] is True  # CPU ranks over gloo, given --ranks
    assert workloads["allreduce"]["precisions"]["bf16"]["supported"] is False
    assert workloads["inference"]["optimizations"].keys() == {"eager", "compiled"}


def test_facts_describe_torch_and_the_device() -> None:
    run = child("facts", "--device=cpu")
    assert run.returncode == 0, run.stderr
    [facts] = run.lines
    assert facts["torch"] == torch.__version__
    backends = facts["backends"]
    assert backends["cuda"] == torch.version.cuda
    assert {"cudnn", "nccl", "tf32_matmul", "tf32_cudnn", "sdpa"} <= set(backends)
    assert set(backends["sdpa"]) == {"flash", "mem_efficient", "math", "cudnn"}
    assert facts["device"]["kind"] == "cpu"
    assert facts["device"]["name"]
    assert facts["threads"] >= 1


def test_bad_arguments_are_one_line_and_exit_2() -> None:
    run = child("run", "--workload=nosuch", "--precision=fp32", "--device=cpu")
    assert run.returncode == 2
    assert run.lines == []
    assert len(run.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--workload=matmul", "--device=cpu"],
        ["run", "--workload=membw", "--precision=int8", "--device=cpu"],
        ["run", "--workload=matmul", "--precision=fp32", "--device=gpu"],
        ["run", "--workload=matmul", "--precision=fp32", "--device=cpu:1"],
        ["run", "--workload=matmul", "--precision=fp32", "--device=cpu", "--duration=-1"],
        ["run", "--workload=matmul", "--precision=fp32", "--device=cpu", "--max-iterations=0"],
        ["run", "--workload=matmul", "--precision=fp32", "--device=cpu", "--optimization=compiled"],
        ["run", "--workload=membw", "--precision=fp32", "--device=cpu", "--flush-cache"],
        ["run", "--workload=matmul", "--precision=fp32", "--device=cpu", "--causal"],
        ["list", "--device=tpu"],
        [],
    ],
)
def test_each_usage_error_is_one_line(
    argv: Sequence[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1
    assert captured.err.startswith("workloads")
