"""Dense matrix multiply: the achieved FLOP/s of one precision.

Sizes: 8192^3 on GPUs of the "large" memory class (36 GiB or more: the 40 GB A100 and up;
workloads/calibration.py, ``memory_class``), 4096^3 on the others, repeated 10 times per iteration
so that an iteration lasts milliseconds, not microseconds, and the host's bookkeeping between
iterations does not let the GPU cool. On a CPU, 2048^3 (4096^3 from 32 cores): on the 2-core
development machine 2048 is at the top of a 512..4096 sweep, and larger matrices fall out of the
caches. An iteration's work is 2*M*N*K*repeats. Where the minimum of iterations would not fit the
duration (bf16 on a CPU without native bf16), the sides are halved up to 5 times
(workloads/calibration.py).

fp8 is e4m3 through torch._scaled_mm (unit scales, bf16 out: the operating mode of fp8 training
and inference); int8 is torch._int_mm (int8 in, int32 out). Neither is upcast or emulated here: a
device that cannot run them reports them unsupported, and a device that runs a precision on a
slow path reports the slow figure. Operands (workloads/precision.py, ``matmul_operands``): a
standard normal rounded to the precision, int8 uniform over its 256 values; a is row-major, b
column-major for fp8 and int8 (the "TN" layout both kernels take on every CUDA version) and
row-major for the dense precisions.

fp8 has two levels, reported apart: ``eager`` (use_fast_accum=False: cuBLAS periodically promotes
the partial sums to a higher precision, the accurate and slower path, as in fp8 training's
gradients) and ``fast_accum`` (use_fast_accum=True: no promotion; what fp8 inference and forward
passes use, and the figure to set beside a published fp8 peak such as the H100 SXM's 1979 TFLOP/s
dense). The manifest's ``parameters.fast_accum`` says which ran. The other precisions have one
accumulation: fast_accum is unsupported for them.

--flush-cache writes a buffer of twice the last-level cache between iterations, outside the timed
window, so that every iteration starts with cold operands.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, ClassVar

import torch

from workloads import calibration, catalog
from workloads import precision as precisions
from workloads.device import DeviceInfo
from workloads.workload import Request, Spec, Step, Workload

MANY_CORES = 32
FALLBACK_CACHE_BYTES = 64 << 20
"""Assumed last-level cache where the device does not report one (flush buffer size only)."""
MIN_SIDE = 32
"""No side shrinks below this (torch._int_mm on CUDA needs more than 16 rows)."""


class Matmul(Workload):
    spec: ClassVar[Spec] = Spec(
        name="matmul",
        version=2,
        unit="FLOP/s",
        work_unit="flop",
        precisions=("fp32", "tf32", "bf16", "fp16", "fp8", "int8"),
        optimizations=("eager", "fast_accum"),
        default_duration=10.0,
        devices=("cpu", "cuda"),
    )
    max_shrink = 5  # 2048 -> 64 on a CPU, 8192 -> 256 on a big GPU

    @classmethod
    def unsupported_reason(
        cls, device: DeviceInfo, precision: str, optimization: str
    ) -> str | None:
        applies = catalog.LEVEL_PRECISIONS.get((cls.spec.name, optimization))
        if applies is not None and precision not in applies:
            return f"{optimization} applies to {', '.join(applies)} only"
        return super().unsupported_reason(device, precision, optimization)

    def __init__(self, request: Request, device: DeviceInfo) -> None:
        super().__init__(request, device)
        (m, n, k, repeats), sizing = self._sizes()
        m, n, k = (max(MIN_SIDE, side >> request.shrink) for side in (m, n, k))
        dev = self.torch_device
        generator = torch.Generator(device=dev).manual_seed(0)
        a, b = precisions.matmul_operands(
            request.precision, m, n, k, device=dev, generator=generator
        )
        self._fast_accum = request.optimization == "fast_accum"
        self._multiply = self._operation(a, b)
        self.repeats = repeats
        self.flop = 2 * m * n * k * repeats
        self.shapes = {"a": [m, k], "b": [k, n], "c": [m, n]}
        self.parameters = {"m": m, "n": n, "k": k, "repeats": repeats, **sizing}
        self._flush: torch.Tensor | None = None
        if request.flush_cache:
            cache = device.cache_bytes or FALLBACK_CACHE_BYTES
            self._flush = torch.empty(2 * cache, dtype=torch.uint8, device=dev)
            self.parameters["flush_bytes"] = self._flush.numel()
        self.parameters["flush_cache"] = request.flush_cache
        if request.precision == "fp8":
            self.parameters["fast_accum"] = self._fast_accum

    def _sizes(self) -> tuple[tuple[int, int, int, int], dict[str, Any]]:
        """M, N, K and repeats; and what decided them, for the manifest's parameters."""
        if self.request.size == "small":
            return (512, 384, 256, 1), {}
        if self.device.kind == "cuda":
            memory = calibration.memory_class(self.device)
            side = 8192 if memory.name == "large" else 4096
            return (side, side, side, 10), memory.parameters
        cores = torch.get_num_threads()
        side = 4096 if cores >= MANY_CORES else 2048
        return (side, side, side, 1), {}

    def _operation(self, a: torch.Tensor, b: torch.Tensor) -> Callable[[], None]:
        """The call to time, on operands in the layout its kernel takes
        (``precision.matmul_operands``)."""
        precision = self.request.precision
        if precision == "fp8":  # GPU-only: not exercised on CPU
            scale = torch.ones((), device=a.device)
            fast = self._fast_accum
            self.kernel = "torch._scaled_mm"

            def scaled() -> None:
                torch._scaled_mm(
                    a,
                    b,
                    scale_a=scale,
                    scale_b=scale,
                    out_dtype=torch.bfloat16,
                    use_fast_accum=fast,
                )

            return scaled
        if precision == "int8":
            self.kernel = "torch._int_mm"

            def integer() -> None:
                torch._int_mm(a, b)

            return integer
        c = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
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
