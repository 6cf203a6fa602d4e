"""Device memory bandwidth, STREAM-style: copy (b = a) and triad (a = b + s*c) in alternation.

Each iteration is one phase, marked in its line, so the analysis can treat the two series apart.
Bytes are counted as STREAM counts them: copy reads N and writes N elements (2*N*size), triad
reads 2N and writes N (3*N*size). On a CPU, torch's kernels store with ordinary stores, so the
memory system also reads every destination line before it is written (write-allocate): the
counted bytes are 2/3 (copy) and 3/4 (triad) of the traffic. glibc's memcpy avoids that read
with streaming stores and so copies about 1.8x faster on the development machine; the probe
reports what torch code gets, and bench/probe_fidelity.py shows both.

The arrays must be far larger than the last-level cache or the probe measures the cache. On a
CPU each array is 4x the last-level cache (STREAM's rule), at least 256 MiB, at most 2 GiB, and
the three together at most a quarter of the available memory. On a GPU each array is 1/8 of the
free memory, at most 2 GiB (an H100's L2 is 50 MiB), and an iteration repeats its operation 10
times so that it lasts milliseconds.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import ClassVar

import torch

from workloads import precision as precisions
from workloads.device import DeviceInfo
from workloads.workload import Request, Size, Spec, Step, Workload

MIB = 1 << 20
MAX_ARRAY_BYTES = 2 << 30
MIN_CPU_ARRAY_BYTES = 256 * MIB
SMALL_ARRAY_BYTES = 32 * MIB
FALLBACK_CACHE_BYTES = 64 * MIB
TRIAD_SCALAR = 3.0
ARRAYS = 3


class Membw(Workload):
    spec: ClassVar[Spec] = Spec(
        name="membw",
        version=1,
        unit="B/s",
        work_unit="byte",
        precisions=("fp32",),
        optimizations=("eager",),
        default_duration=10.0,
        devices=("cpu", "cuda"),
    )

    def __init__(self, request: Request, device: DeviceInfo) -> None:
        super().__init__(request, device)
        dtype = precisions.dtype(request.precision)
        element = torch.empty((), dtype=dtype).element_size()
        n = self.array_bytes(device, request.size) // element
        self.repeats = 10 if device.kind == "cuda" and request.size == "default" else 1
        # Filled, not just allocated: the first touch of each page must not land in an iteration.
        self.a = torch.full((n,), 1.0, dtype=dtype, device=self.torch_device)
        self.b = torch.full((n,), 2.0, dtype=dtype, device=self.torch_device)
        self.c = torch.full((n,), 0.5, dtype=dtype, device=self.torch_device)
        self.copy_bytes = 2 * n * element * self.repeats
        self.triad_bytes = 3 * n * element * self.repeats
        self.shapes = {"a": [n], "b": [n], "c": [n]}
        self.parameters = {
            "elements": n,
            "element_bytes": element,
            "array_bytes": n * element,
            "cache_bytes": device.cache_bytes,
            "repeats": self.repeats,
            "triad_scalar": TRIAD_SCALAR,
        }

    @staticmethod
    def array_bytes(device: DeviceInfo, size: Size = "default") -> int:
        """The size of each array (public: bench/probe_fidelity.py sizes its reference by it)."""
        if size == "small":
            return SMALL_ARRAY_BYTES
        free = device.memory_free_bytes
        if device.kind == "cuda":  # GPU-only: not exercised on CPU
            return min((free or 0) // 8, MAX_ARRAY_BYTES)
        cache = device.cache_bytes or FALLBACK_CACHE_BYTES
        array = min(max(4 * cache, MIN_CPU_ARRAY_BYTES), MAX_ARRAY_BYTES)
        return array if free is None else min(array, free // (4 * ARRAYS))

    def steps(self) -> Generator[Step, None, None]:
        a, b, c = self.a, self.b, self.c

        def copy() -> None:
            for _ in range(self.repeats):
                b.copy_(a)

        def triad() -> None:
            for _ in range(self.repeats):
                torch.add(b, c, alpha=TRIAD_SCALAR, out=a)

        while True:
            yield Step(work=self.copy_bytes, run=copy, phase="copy")
            yield Step(work=self.triad_bytes, run=triad, phase="triad")
