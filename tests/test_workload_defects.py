"""Four defects in the workloads that only a real GPU would show, each pinned on the CPU.

- int8 operands were 68% zeros (randn truncated toward zero): low-entropy operands draw less power,
  so a power-capped GPU clocks higher than on real data and the figure is inflated.
- int8 operands reached torch._int_mm with b row-major (NN), which CUDA 13's cuBLAS rejects;
  pytorch's test/test_matmul_cuda.py expects only a row-major, b column-major (TN) to run on
  every supported GPU.
- CUDA event times were float32 milliseconds since the run began, so a duration lost precision as
  the run grew (0.25 ms steps an hour in).
- The problem size compared total memory with 40 GiB, and an A100 40GB reports 39.4-39.6 GiB.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from functools import partial

import pytest
import torch

from workloads import calibration
from workloads import precision as precisions
from workloads.attention import Attention
from workloads.device import DeviceInfo
from workloads.device import probe as probe_device
from workloads.matmul import Matmul
from workloads.timer import CudaEventTimer
from workloads.workload import Request, Workload

GIB = 1 << 30
CPU = probe_device("cpu")


def float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


class DeviceClock:
    """A device clock in seconds and a stand-in for torch.cuda.Event on it: elapsed_time is a
    float32 of milliseconds, as cudaEventElapsedTime's (ATen's CUDAEvent::elapsed_time)."""

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def event(self, enable_timing: bool = False) -> FakeEvent:
        assert enable_timing
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, clock: DeviceClock) -> None:
        self.clock = clock
        self.at: float | None = None

    def record(self) -> None:
        self.at = self.clock.now

    def synchronize(self) -> None:
        assert self.at is not None

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None
        assert end.at is not None
        return float32((end.at - self.at) * 1e3)


def test_cuda_event_durations_do_not_lose_precision_as_the_run_grows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An hour in, float32 milliseconds since the start step by 0.25 ms; durations of 8 ms
    iterations must still be exact to a microsecond, and times stay monotonic."""
    clock = DeviceClock()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    before = time.time()
    timer = CudaEventTimer(torch.device("cuda"))
    after = time.time()
    clock.advance(3600.0)
    previous_end = after
    for index in range(32):
        seconds = 8e-3 + index * 37e-6
        began = clock.now
        start, end = timer.measure(partial(clock.advance, seconds))
        assert end - start == pytest.approx(seconds, abs=1e-6)
        assert start >= previous_end
        assert before + began - 0.2e-3 <= start <= after + began + 0.2e-3
        previous_end = end
        clock.advance(20e-6)  # the host's turn between two iterations


def cuda_device(memory_total_bytes: int) -> DeviceInfo:
    """A CUDA device of that memory, backed by the CPU: the sizing rule runs as on the GPU, and
    the tensors it sizes are allocated where this machine can."""
    return DeviceInfo(
        kind="cuda",
        torch_device="cpu",
        name="sized",
        capability=(9, 0),
        memory_total_bytes=memory_total_bytes,
        memory_free_bytes=memory_total_bytes,
        cache_bytes=50 << 20,
        cuda_device_count=1,
    )


@pytest.mark.parametrize(
    ("reported_gib", "expected"),
    [
        (39.4, "large"),  # A100-SXM4-40GB, torch's total_memory
        (39.6, "large"),  # A100 40GB, nvidia-smi's 40536 MiB
        (40.0, "large"),
        (45.0, "large"),  # L40S 48GB
        (79.1, "large"),  # H100 80GB, torch's total_memory
        (80.0, "large"),
        (94.0, "large"),  # H100 NVL
        (139.8, "large"),  # H200
        (31.7, "medium"),  # V100 32GB
        (24.0, "medium"),  # RTX 4090
        (22.0, "medium"),  # L4
        (14.6, "medium"),  # T4
    ],
)
def test_memory_class_does_not_flip_on_a_rounded_marketed_size(
    reported_gib: float, expected: str
) -> None:
    memory = int(reported_gib * GIB)
    decision = calibration.memory_class(cuda_device(memory))
    assert (decision.name, decision.memory_total_bytes) == (expected, memory)


SizedWorkload = Callable[[Request, DeviceInfo], Workload]


@pytest.mark.parametrize("workload", [Matmul, Attention])
def test_a100_40gb_gets_the_problem_size_of_its_40_gib_class(workload: SizedWorkload) -> None:
    """The rule as the workloads use it, recorded in the manifest's parameters; shrunk 32-fold so
    that the default GPU problem builds in a moment on the CPU."""
    request = Request("fp32", "eager", "default", shrink=5)
    a100 = workload(request, cuda_device(int(39.6 * GIB)))
    forty = workload(request, cuda_device(40 * GIB))
    assert a100.shapes == forty.shapes
    assert a100.parameters["memory_class"] == forty.parameters["memory_class"] == "large"
    assert a100.parameters["memory_total_bytes"] == int(39.6 * GIB)
    v100 = workload(request, cuda_device(int(31.7 * GIB)))
    assert v100.parameters["memory_class"] == "medium"
    assert v100.shapes != a100.shapes


MAX_ZERO_SHARE = 0.01
"""Uniform int8 has 1/256 zeros, fp8 e4m3 from a standard normal 0.06%; the old int8 had 68%."""


def distinct(tensor: torch.Tensor) -> int:
    return len(set(tensor.flatten().tolist()))


def distinct_wanted(dtype: torch.dtype) -> int:
    """Half of the values an 8-bit type holds; a thousand for the wider types."""
    return 128 if dtype.itemsize == 1 else 1000


@pytest.mark.parametrize("precision", Matmul.spec.precisions)
def test_matmul_operands_are_not_mostly_zeros(precision: str) -> None:
    generator = torch.Generator().manual_seed(0)
    operands = precisions.matmul_operands(
        precision, 256, 256, 256, device=torch.device("cpu"), generator=generator
    )
    for operand in operands:
        values = operand.float()
        assert (values == 0).float().mean().item() < MAX_ZERO_SHARE
        assert distinct(values) >= distinct_wanted(operand.dtype)


def test_int8_operands_span_the_whole_range() -> None:
    generator = torch.Generator().manual_seed(0)
    a, b = precisions.matmul_operands(
        "int8", 256, 256, 256, device=torch.device("cpu"), generator=generator
    )
    for operand in (a, b):
        assert (operand.min().item(), operand.max().item()) == (-128, 127)
        assert distinct(operand) == 256


@pytest.mark.parametrize("precision", Attention.spec.precisions)
def test_attention_inputs_are_not_mostly_zeros(precision: str) -> None:
    attention = Attention(Request(precision, "eager", "small"), CPU)
    for tensor in (attention.q, attention.k, attention.v):
        values = tensor.float()
        assert (values == 0).float().mean().item() < MAX_ZERO_SHARE
        assert distinct(values) >= distinct_wanted(tensor.dtype)


def record_int_mm(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What is handed to torch._int_mm, answered with zeros (whether this CPU runs it or not)."""
    handed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        handed.append((a, b))
        return torch.zeros((a.shape[0], b.shape[1]), dtype=torch.int32)

    monkeypatch.setattr(torch, "_int_mm", recording)
    return handed


def int8_workload_operands(monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor]:
    """What the int8 matmul workload hands to torch._int_mm in one timed step."""
    handed = record_int_mm(monkeypatch)
    steps = Matmul(Request("int8", "eager", "small"), CPU).steps()
    next(steps).run()
    steps.close()
    assert handed
    return handed[0]


def test_int8_workload_operands_are_not_mostly_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    for operand in int8_workload_operands(monkeypatch):
        assert (operand == 0).float().mean().item() < MAX_ZERO_SHARE
        assert distinct(operand) == 256


def assert_tn(a: torch.Tensor, b: torch.Tensor) -> None:
    k = a.shape[1]
    assert b.shape[0] == k
    assert a.stride() == (k, 1), "a row-major"
    assert b.stride() == (1, k), "b column-major"


def test_int8_workload_hands_int_mm_the_tn_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_tn(*int8_workload_operands(monkeypatch))


def test_int8_probe_tries_int_mm_in_the_tn_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    handed = record_int_mm(monkeypatch)
    assert precisions.unsupported_reason("int8", CPU) is None  # the recording always runs
    assert len(handed) == 1
    assert_tn(*handed[0])


def test_int8_tn_operands_multiply_correctly_where_int_mm_runs() -> None:
    reason = precisions.unsupported_reason("int8", CPU)
    if reason is not None:
        pytest.skip(reason)
    generator = torch.Generator().manual_seed(0)
    a, b = precisions.matmul_operands(
        "int8", 64, 48, 32, device=torch.device("cpu"), generator=generator
    )
    assert torch.equal(torch._int_mm(a, b), a.int() @ b.int())
