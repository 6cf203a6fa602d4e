"""Precisions: their torch dtypes and the one table of what a device can run.

Kept in one place so that every workload gates a precision the same way and the rules in
README.md ("Unsupported") have a single implementation. A precision that runs on a slow fallback
path (fp16 matmul on many CPUs) is *supported*: its low figure is a finding the agent reports
against the device's best precision, never something to hide by upcasting.
"""

from __future__ import annotations

from typing import Final

import torch

from workloads.device import DeviceInfo

PRECISIONS: Final = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")

_DTYPES: Final = {
    "fp32": torch.float32,
    # tf32 is not a storage type: fp32 tensors, with tensor cores switched on by configure().
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,
}

AMPERE: Final = (8, 0)
ADA: Final = (8, 9)


def dtype(precision: str) -> torch.dtype:
    """The storage dtype of a precision's inputs."""
    if precision == "fp8":
        return torch.float8_e4m3fn
    return _DTYPES[precision]


def configure(precision: str) -> None:
    """Set the process-wide TF32 switches so that fp32 means IEEE fp32 and tf32 means tensor cores.

    torch's defaults have changed between releases; a probe must not inherit whichever one the
    installed version has, or an "fp32" figure silently becomes a TF32 one.
    """
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def unsupported_reason(precision: str, device: DeviceInfo) -> str | None:
    """Why the device cannot run this precision, or None when it can."""
    if device.kind == "cpu":
        return _cpu_reason(precision)
    return _cuda_reason(precision, device)


def _cpu_reason(precision: str) -> str | None:
    if precision == "tf32":
        return "tf32 is a CUDA tensor-core mode"
    if precision == "fp8":
        return "fp8 (e4m3 scaled matmul) needs a CUDA device with compute capability >= 8.9"
    if precision == "int8":
        return _int_mm_reason(torch.device("cpu"))
    return None


def _cuda_reason(precision: str, device: DeviceInfo) -> str | None:
    capability = device.capability or (0, 0)
    has = f"{capability[0]}.{capability[1]}"
    if precision in ("tf32", "bf16") and capability < AMPERE:
        return f"{precision} needs compute capability >= 8.0 (device has {has})"
    if precision == "fp8":
        if capability < ADA:
            return f"fp8 needs compute capability >= 8.9 (device has {has})"
        if not hasattr(torch, "_scaled_mm"):
            return f"torch {torch.__version__} has no torch._scaled_mm"
    if precision == "int8":
        return _int_mm_reason(torch.device(device.torch_device))
    return None


def _int_mm_reason(device: torch.device) -> str | None:
    """Try torch._int_mm once: which builds and devices have it is not documented as a rule.

    The operands are 32 x 32, the smallest shape that meets the CUDA kernel's alignment rules.
    """
    a = torch.ones((32, 32), dtype=torch.int8, device=device)
    try:
        torch._int_mm(a, a)
    except (RuntimeError, NotImplementedError) as exc:
        return f"torch._int_mm does not run on {device}: {str(exc).splitlines()[0]}"
    return None
