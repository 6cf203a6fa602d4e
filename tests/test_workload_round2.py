"""Three defects of the probe workloads (issue 25, items 6 to 8), each pinned on the CPU.

- fp8 matmul ran torch._scaled_mm without fast accumulation only: the slower path alone, compared
  with a published fp8 peak, while inference kernels accumulate fast. ``fast_accum`` is now a
  level of its own, reported apart.
- A child bound to a few CPUs (``--cpus``) kept torch's thread pools sized for the whole machine,
  so its threads shared the bound CPUs and the figure measured the contention.
- The all-reduce payload was summed in place forever: each sum multiplies it by the world size,
  and fp32 or bf16 reached inf after 128/log2(n) sums (43 on 8 GPUs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.config import names
from workloads import allreduce
from workloads.allreduce import REPEATS, Allreduce
from workloads.cli import describe_workloads
from workloads.device import probe as probe_device
from workloads.matmul import Matmul
from workloads.workload import Request

ROOT = Path(__file__).resolve().parent.parent
CPU = probe_device("cpu")


def workloads_child(*args: str) -> list[dict[str, Any]]:
    """`python -m workloads ARGS`, as the agent starts it; its JSON lines."""
    done = subprocess.run(
        [sys.executable, "-m", "workloads", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


# Item 6: fp8 with and without fast accumulation, as two levels.


def test_fast_accum_is_a_level_of_matmul_fp8_only() -> None:
    assert "fast_accum" in Matmul.spec.optimizations
    assert names.declares("matmul", "fp8", "fast_accum")
    assert names.declares("matmul", "fp8", "eager")
    # A plan of every precision and both levels runs fast_accum for fp8 alone.
    assert not names.declares("matmul", "fp32", "fast_accum")
    assert not names.declares("inference", "bf16", "fast_accum")
    assert Matmul.unsupported_reason(CPU, "bf16", "fast_accum") == "fast_accum applies to fp8 only"


def test_fast_accum_is_unsupported_on_a_cpu_for_the_reason_fp8_is() -> None:
    fp8_reason = Matmul.unsupported_reason(CPU, "fp8", "eager")
    assert fp8_reason is not None
    (line,) = workloads_child(
        "run",
        "--workload=matmul",
        "--precision=fp8",
        "--optimization=fast_accum",
        "--device=cpu",
        "--size=small",
    )
    assert line["event"] == "unsupported"
    assert line["optimization"] == "fast_accum"
    assert line["reason"] == fp8_reason
    levels = describe_workloads("cpu")["workloads"]["matmul"]["optimizations"]
    assert levels["eager"] == {"supported": True, "reason": None}
    # Judged at fp8, the precision the level is for, not at fp32.
    assert levels["fast_accum"] == {"supported": False, "reason": fp8_reason}


@pytest.mark.parametrize(("level", "fast"), [("eager", False), ("fast_accum", True)])
def test_each_fp8_level_runs_its_accumulation_and_says_so(
    monkeypatch: pytest.MonkeyPatch, level: str, fast: bool
) -> None:
    """torch._scaled_mm runs on this CPU build (the child refuses fp8 on a CPU, so the workload is
    built here directly): the call the GPU would get, checked by the real operator."""
    real = torch._scaled_mm
    handed: list[dict[str, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        handed.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    workload = Matmul(Request("fp8", level, "small"), CPU)
    steps = workload.steps()
    next(steps).run()
    steps.close()
    assert handed
    assert all(kwargs["use_fast_accum"] is fast for kwargs in handed)
    assert workload.parameters["fast_accum"] is fast
    assert workload.kernel == "torch._scaled_mm"


# Item 7: the thread pools follow the binding.


def test_a_child_bound_to_one_cpu_runs_one_thread() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU allowed: torch's default is one thread already")
    manifest, *_ = workloads_child(
        "run",
        "--workload=matmul",
        "--precision=fp32",
        "--device=cpu",
        "--size=small",
        "--duration=0.1",
        "--max-iterations=1",
        f"--cpus={allowed[0]}",
    )
    assert manifest["event"] == "manifest"
    binding = manifest["cpu_binding"]
    assert binding["cpus"] == [allowed[0]]
    assert manifest["threads"] == 1
    assert binding["interop_threads"] == 1


def test_threads_given_beside_cpus_are_what_runs() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    manifest, *_ = workloads_child(
        "run",
        "--workload=matmul",
        "--precision=fp32",
        "--device=cpu",
        "--size=small",
        "--duration=0.1",
        "--max-iterations=1",
        f"--cpus={allowed[0]}",
        "--threads=3",
    )
    assert manifest["threads"] == 3


# Item 8: the all-reduce payload stays finite.


def test_allreduce_payload_stays_finite_however_many_iterations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two gloo ranks, fp32: left to grow, the payload is 2^(5k) after k iterations and inf from
    the 26th. The steps are driven as the runner drives them (agree to go on, then step); a small
    message keeps it quick, the sums do not depend on its size."""
    monkeypatch.setattr(allreduce, "SMALL_BYTES", 1 << 16)
    workload = Allreduce(Request("fp32", "eager", "small", ranks=2), CPU)
    try:
        steps = workload.steps()
        for _ in range(30):
            assert not workload.agree_stop(False)
            next(steps).run()
        assert workload.agree_stop(True)
        steps.close()
        payload = workload.rank.payload
        assert workload.parameters["bytes"] == 1 << 16
        # Still a SUM of every rank's ones, once per timed call of the last iteration.
        assert torch.equal(payload, torch.full_like(payload, 2.0**REPEATS))
    finally:
        workload.close()
