"""Dense matrix multiply: the achieved FLOP/s of one precision.

Sizes: 8192^3 on GPUs with 40 GiB or more, 4096^3 on smaller ones, repeated 10 times per iteration
so that an iteration lasts milliseconds, not microseconds, and the host's bookkeeping between
iterations does not let the GPU cool. On a CPU, 2048^3 (4096^3 from 32 cores): on the 2-core
development machine 2048 is at the top of a 512..4096 sweep, and larger matrices fall out of the
caches. An iteration's work is 2*M*N*K*repeats.

fp8 is e4m3 through torch._scaled_mm (unit scales, bf16 out: the operating mode of fp8 training
and inference); int8 is torch._int_mm (int8 in, int32 out). Neither is upcast or emulated here: a
device that cannot run them reports them unsupported, and a device that runs a precision on a
slow path reports the slow figure.

--flush-cache writes a buffer of twice the last-level cache between iterations, outside the timed
window, so that every iteration starts with cold operands.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import ClassVar

import torch

from workloads import precision as precisions
from workloads.device import DeviceInfo
from workloads.workload import Request, Spec, Step, Workload

GIB = 1 << 30
BIG_GPU_BYTES = 40 * GIB
MANY_CORES = 32
FALLBACK_CACHE_BYTES = 64 << 20
"""Assumed last-level cache where the device does not report one (flush buffer size only)."""


class Matmul(Workload):
    spec: ClassVar[Spec] = Spec(
        name="matmul",
        version=1,
        unit="FLOP/s",
        work_unit="flop",
        precisions=("fp32", "tf32", "bf16", "fp16", "fp8", "int8"),
        optimizations=("eager",),
        default_duration=10.0,
        devices=("cpu", "cuda"),
    )

    def __init__(self, request: Request, device: DeviceInfo) -> None:
        super().__init__(request, device)
        m, n, k, repeats = self._sizes()
        dev = self.torch_device
        generator = torch.Generator(device=dev).manual_seed(0)
        a32 = torch.randn((m, k), generator=generator, device=dev)
        b32 = torch.randn((n, k), generator=generator, device=dev)
        self._multiply = self._operation(a32, b32)
        del a32, b32
        self.repeats = repeats
        self.flop = 2 * m * n * k * repeats
        self.shapes = {"a": [m, k], "b": [k, n], "c": [m, n]}
        self.parameters = {"m": m, "n": n, "k": k, "repeats": repeats}
        self._flush: torch.Tensor | None = None
        if request.flush_cache:
            cache = device.cache_bytes or FALLBACK_CACHE_BYTES
            self._flush = torch.empty(2 * cache, dtype=torch.uint8, device=dev)
            self.parameters["flush_bytes"] = self._flush.numel()
        self.parameters["flush_cache"] = request.flush_cache

    def _sizes(self) -> tuple[int, int, int, int]:
        if self.request.size == "small":
            return 512, 384, 256, 1
        if self.device.kind == "cuda":  # GPU-only: not exercised on CPU
            total = self.device.memory_total_bytes or 0
            side = 8192 if total >= BIG_GPU_BYTES else 4096
            return side, side, side, 10
        cores = torch.get_num_threads()
        side = 4096 if cores >= MANY_CORES else 2048
        return side, side, side, 1

    def _operation(self, a32: torch.Tensor, b32: torch.Tensor) -> Callable[[], None]:
        """The call to time, with operands already in the precision's layout (b stored as N x K)."""
        precision = self.request.precision
        if precision == "fp8":  # GPU-only: not exercised on CPU
            a8 = a32.to(torch.float8_e4m3fn)
            b8 = b32.to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm requires
            scale = torch.ones((), device=a32.device)
            self.kernel = "torch._scaled_mm"

            def scaled() -> None:
                torch._scaled_mm(a8, b8, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)

            return scaled
        if precision == "int8":
            a_int = a32.clamp(-127, 127).to(torch.int8)
            b_int = b32.clamp(-127, 127).to(torch.int8).t().contiguous()
            self.kernel = "torch._int_mm"

            def integer() -> None:
                torch._int_mm(a_int, b_int)

            return integer
        dtype = precisions.dtype(precision)
        a = a32.to(dtype)
        b = b32.to(dtype).t().contiguous()
        c = torch.empty((a.shape[0], b.shape[1]), dtype=dtype, device=a32.device)
        self.kernel = "torch.matmul"

        def dense() -> None:
            torch.matmul(a, b, out=c)

        return dense

    def steps(self) -> Generator[Step, None, None]:
        def work() -> None:
            for _ in range(self.repeats):
                self._multiply()

        while True:
            yield Step(work=self.flop, run=work)
            if self._flush is not None:
                self._flush.fill_(1)
