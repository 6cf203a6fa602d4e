"""Precisions: their torch dtypes and the one table of what a device can run.

Kept in one place so that every workload gates a precision the same way and the rules in
README.md ("Unsupported") have a single implementation. A precision that runs on a slow fallback
path (fp16 matmul on many CPUs) is *supported*: its low figure is a finding the agent reports
against the device's best precision, never something to hide by upcasting.

Whether the device runs a supported precision *natively* is a second question, answered from the
instruction set (/proc/cpuinfo) or the compute capability: bf16 on a CPU without AVX512-BF16 or
AMX is converted in software and runs orders of magnitude below fp32. The default probe plan
leaves such precisions out; one asked for explicitly runs, measured against the native ones.

Operands are drawn here too (`random_operand`, `matmul_operands`), so that the workloads and the
int8 capability trial hand the kernels the same values in the same layout. Their spread matters
on a GPU: operands with little entropy (many zeros, few distinct values) toggle fewer bits, so
the device draws less power and, under a power cap, clocks higher than it does on real data.
"""

from __future__ import annotations

import platform
from typing import Final

import torch

from workloads.catalog import CPU_LACKS, cuda_native_reason, unsupported_up_front
from workloads.device import DeviceInfo, cpu_flags

PRECISIONS: Final = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")

_DTYPES: Final = {
    "fp32": torch.float32,
    # tf32 is not a storage type: fp32 tensors, with tensor cores switched on by configure().
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,
}

# Per architecture, the CPU flags (x86 `flags`, aarch64 `Features`) any one of which gives a
# precision native arithmetic; fp32 needs none. A CPU whose flags cannot be read, or of another
# architecture, is taken as native: nothing is left out of a plan on a guess.
NATIVE_CPU_FLAGS: Final = {
    "x86_64": {
        "bf16": ("avx512_bf16", "amx_bf16"),
        "fp16": ("avx512_fp16", "amx_fp16"),
        "int8": ("avx512_vnni", "avx_vnni", "amx_int8"),
    },
    "aarch64": {"bf16": ("bf16",), "fp16": ("asimdhp",), "int8": ("asimddp", "i8mm")},
}


def dtype(precision: str) -> torch.dtype:
    """The storage dtype of a precision's inputs."""
    if precision == "fp8":
        return torch.float8_e4m3fn
    return _DTYPES[precision]


def random_operand(
    precision: str,
    shape: tuple[int, ...],
    *,
    device: torch.device,
    generator: torch.Generator,
) -> torch.Tensor:
    """Values with the spread of real data, in the precision's storage type.

    int8: uniform over all 256 values. (A standard normal rounded to int8 truncates toward zero:
    68% zeros and 9 distinct values, which a power-capped GPU multiplies at a higher clock.) The
    floating-point precisions: a standard normal rounded to the type (fp8 e4m3: about 150 distinct
    values, 0.06% zeros; bf16, fp16, fp32: thousands, no zeros).
    """
    if precision == "int8":
        return torch.randint(-128, 128, shape, dtype=torch.int8, generator=generator, device=device)
    return torch.randn(shape, generator=generator, device=device).to(dtype(precision))


def matmul_operands(
    precision: str, m: int, n: int, k: int, *, device: torch.device, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """a (M x K) and b (K x N) in the layout the precision's kernel takes, a always row-major.

    int8 and fp8: b column-major (a view of an N x K row-major tensor), the "TN" layout.
    torch._scaled_mm requires it; for torch._int_mm it is the one layout pytorch's
    test/test_matmul_cuda.py (test__int_mm) expects to run on every supported device (SM80 and
    later; SM70 and SM75 from CUDA 12.3), while a row-major b (NN) is skipped there on CUDA 13,
    whose cuBLAS lacks the kernel. The dense precisions: b row-major, for torch.matmul.
    """
    a = random_operand(precision, (m, k), device=device, generator=generator)
    b_rows = random_operand(precision, (n, k), device=device, generator=generator)
    if precision in ("int8", "fp8"):
        return a, b_rows.t()
    return a, b_rows.t().contiguous()


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


def native_reason(precision: str, device: DeviceInfo) -> str | None:
    """Why the device runs this (supported) precision without native support, or None where it
    has native support: a precision without it is a slow path, left out of the default plan."""
    if device.kind == "cpu":
        wanted = NATIVE_CPU_FLAGS.get(platform.machine(), {}).get(precision, ())
        flags = cpu_flags()
        if not wanted or not flags or flags.intersection(wanted):
            return None
        return f"{precision} on this CPU has no native support (no {_either(wanted)} flag)"
    return cuda_native_reason(precision, device.capability or (0, 0))  # GPU-only


def _either(names: tuple[str, ...]) -> str:
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


def _cpu_reason(precision: str) -> str | None:
    if precision == "int8":
        return _int_mm_reason(torch.device("cpu"))
    return CPU_LACKS.get(precision)


def _cuda_reason(precision: str, device: DeviceInfo) -> str | None:
    # The rule the agent applies before any child starts, from NVML's compute capability.
    reason = unsupported_up_front("matmul", precision, "cuda", device.capability or (0, 0))
    if reason is not None:
        return reason
    if precision == "fp8" and not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    if precision == "int8":
        return _int_mm_reason(torch.device(device.torch_device))
    return None


def _int_mm_reason(device: torch.device) -> str | None:
    """Try torch._int_mm once: which builds and devices have it is not documented as a rule.

    The operands are 32 x 32, the smallest shape that meets the CUDA kernel's alignment rules, in
    the workload's own layout (``matmul_operands``): a layout the workload does not use could pass
    here and fail there, or the reverse.
    """
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = matmul_operands("int8", 32, 32, 32, device=device, generator=generator)
    try:
        torch._int_mm(a, b)
    except (RuntimeError, NotImplementedError) as exc:
        return f"torch._int_mm does not run on {device}: {str(exc).splitlines()[0]}"
    return None
