"""Host-to-device and device-to-host bandwidth over the bus (PCIe, NVLink-C2C), pinned memory.

Pinned (page-locked) host memory is what data loaders and offloading use, and the only kind the
DMA engines copy from directly; pageable memory would measure an extra host-side copy. Each
iteration moves one buffer of 1/8 of the free device memory, at most 1 GiB, which a Gen5 x16
link moves in about 20 ms. CUDA only: on a CPU there is no bus to cross.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import ClassVar

import torch

from workloads import precision as precisions
from workloads.device import DeviceInfo
from workloads.workload import Request, Spec, Step, Workload

MAX_BYTES = 1 << 30
SMALL_BYTES = 16 << 20


class _Transfer(Workload):
    def __init__(self, request: Request, device: DeviceInfo) -> None:  # GPU-only
        super().__init__(request, device)
        dtype = precisions.dtype(request.precision)
        element = torch.empty((), dtype=dtype).element_size()
        n = (SMALL_BYTES if request.size == "small" else self._default_bytes()) // element
        self.host = torch.ones(n, dtype=dtype, pin_memory=True)
        self.device_buffer = torch.ones(n, dtype=dtype, device=self.torch_device)
        self.bytes = n * element
        self.shapes = {"buffer": [n]}
        self.parameters = {"bytes": self.bytes, "element_bytes": element, "pinned": True}

    def _default_bytes(self) -> int:  # GPU-only: not exercised on CPU
        return min((self.device.memory_free_bytes or 0) // 8, MAX_BYTES)

    def copy(self) -> None:
        raise NotImplementedError

    def steps(self) -> Generator[Step, None, None]:  # GPU-only: not exercised on CPU
        while True:
            yield Step(work=self.bytes, run=self.copy)


def _spec(name: str) -> Spec:
    return Spec(
        name=name,
        version=1,
        unit="B/s",
        work_unit="byte",
        precisions=("fp32",),
        optimizations=("eager",),
        default_duration=5.0,
        devices=("cuda",),
    )


class HostToDevice(_Transfer):
    spec: ClassVar[Spec] = _spec("h2d")

    def copy(self) -> None:  # GPU-only: not exercised on CPU
        self.device_buffer.copy_(self.host, non_blocking=True)


class DeviceToHost(_Transfer):
    spec: ClassVar[Spec] = _spec("d2h")

    def copy(self) -> None:  # GPU-only: not exercised on CPU
        self.host.copy_(self.device_buffer, non_blocking=True)
