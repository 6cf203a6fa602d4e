"""Every workload by name: the one list that `list`, `run` and the README's table follow."""

from __future__ import annotations

from typing import Final

from workloads.allreduce import Allreduce
from workloads.attention import Attention
from workloads.inference import Inference
from workloads.matmul import Matmul
from workloads.membw import Membw
from workloads.transfer import DeviceToHost, HostToDevice
from workloads.workload import Workload

WORKLOADS: Final[dict[str, type[Workload]]] = {
    workload.spec.name: workload
    for workload in (Matmul, Membw, HostToDevice, DeviceToHost, Attention, Inference, Allreduce)
}
