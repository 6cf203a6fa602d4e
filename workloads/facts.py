"""The torch side of the stack snapshot, read where torch is: in the child.

The daemon never imports torch, so the versions and switches that decide which kernels run
(CUDA, cuDNN, NCCL; TF32; the SDPA backends) are reported from here, both by the `facts` command
for the stack snapshot and inside every manifest, since a probe's number means nothing without
the stack it was measured on.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import Any, Final

import torch

from workloads.device import DeviceInfo

# torch leaves these functions unannotated; the tables give them the types they return.
_SDPA: Final[dict[str, Callable[[], bool]]] = {
    "flash": torch.backends.cuda.flash_sdp_enabled,
    "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
    "math": torch.backends.cuda.math_sdp_enabled,
    "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
}
_LIBRARIES: Final[dict[str, Callable[[], bool]]] = {
    "mkl": torch.backends.mkl.is_available,
    "mkldnn": torch.backends.mkldnn.is_available,
    "openmp": torch.backends.openmp.is_available,
}
_CUDNN_AVAILABLE: Final[Callable[[], bool]] = torch.backends.cudnn.is_available
_CUDNN_VERSION: Final[Callable[[], int | None]] = torch.backends.cudnn.version
_NCCL_VERSION: Final[Callable[[], object]] = torch.cuda.nccl.version


def backends() -> dict[str, Any]:
    """Versions of the backend libraries and the process-wide switches that choose kernels."""
    cudnn = _CUDNN_VERSION() if _CUDNN_AVAILABLE() else None
    return {
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "cudnn": cudnn,
        "nccl": _nccl_version(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "sdpa": {name: enabled() for name, enabled in _SDPA.items()},
        **{name: available() for name, available in _LIBRARIES.items()},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _nccl_version() -> str | None:
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return None
    version = _NCCL_VERSION()  # GPU-only: not exercised on CPU
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def facts(device: DeviceInfo | None, device_reason: str | None) -> dict[str, Any]:
    """The `facts` command's object; device is None (with the reason) when it is absent."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backends": backends(),
        "device": None if device is None else describe(device),
        "device_unavailable": device_reason,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
    }


def describe(device: DeviceInfo) -> dict[str, Any]:
    return {
        "device": device.torch_device,
        "kind": device.kind,
        "name": device.name,
        "capability": None if device.capability is None else list(device.capability),
        "memory_total_bytes": device.memory_total_bytes,
        "memory_free_bytes": device.memory_free_bytes,
        "cache_bytes": device.cache_bytes,
        "cuda_device_count": device.cuda_device_count,
    }
