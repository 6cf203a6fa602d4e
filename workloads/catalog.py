"""The workloads' names, precisions and optimization levels, as plain data.

The agent checks a probe plan and a `sustain probe` request against these names before any child
starts, and the agent never imports torch: this is the one module of the package it may import,
so it imports nothing (contract `catalog-stands-alone` in pyproject.toml). Each workload's own
`Spec` says the same again beside its code; tests/test_name_checks.py keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, slots=True)
class Declared:
    """What one workload accepts on its command line."""

    name: str
    precisions: tuple[str, ...]
    optimizations: tuple[str, ...]


PRECISIONS: Final = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")
OPTIMIZATIONS: Final = ("eager", "compiled", "fast_accum")

# Levels that apply to some of a workload's precisions only: the agent leaves the other pairs out
# of a plan, and the workload reports them unsupported. fast_accum is fp8's fast accumulation
# (torch._scaled_mm's use_fast_accum, what fp8 inference kernels use); eager fp8 promotes its
# partial sums to fp32 as it goes, the slower and more accurate path.
LEVEL_PRECISIONS: Final[dict[tuple[str, str], tuple[str, ...]]] = {
    ("matmul", "fast_accum"): ("fp8",),
}

# Native arithmetic on a CUDA device, by compute capability: the one rule of what the default plan
# leaves out on a GPU (workloads.precision for the child, the agent before any child starts: it
# reads the capability from NVML, so no CUDA context is made to ask). fp16 is full rate from Volta
# (7.0) on, and before it on 5.3, 6.0 and 6.2 only (6.1, the GeForce Pascals, runs it at 1/64 of
# fp32); every other precision the device supports at all it runs natively.
VOLTA: Final = (7, 0)
FAST_FP16_BEFORE_VOLTA: Final = ((5, 3), (6, 0), (6, 2))


def cuda_native_reason(precision: str, capability: tuple[int, int]) -> str | None:
    """Why a CUDA device of ``capability`` runs ``precision`` without native support, or None."""
    if precision == "fp16" and capability < VOLTA and capability not in FAST_FP16_BEFORE_VOLTA:
        return f"fp16 on compute capability {capability[0]}.{capability[1]} is not full rate"
    return None


# Node-wide by nature: one run spans every GPU of the node (the agent makes them all visible).
NODE_WIDE: Final = frozenset({"allreduce"})

WORKLOADS: Final[dict[str, Declared]] = {
    declared.name: declared
    for declared in (
        Declared(
            "matmul", ("fp32", "tf32", "bf16", "fp16", "fp8", "int8"), ("eager", "fast_accum")
        ),
        Declared("membw", ("fp32",), ("eager",)),
        Declared("h2d", ("fp32",), ("eager",)),
        Declared("d2h", ("fp32",), ("eager",)),
        Declared("attention", ("bf16", "fp16", "fp32"), ("eager",)),
        Declared("inference", ("bf16", "fp16", "fp32"), ("eager", "compiled")),
        Declared("allreduce", ("fp32", "bf16"), ("eager",)),
    )
}

# What a device cannot run at all, known before any child starts: a probe of it is `unsupported`
# at once, with the reason the child would give (tests/test_name_checks.py keeps them equal). The
# rest (int8 kernels, a compiler for torch.compile, NCCL) only the child can tell.
CUDA_ONLY: Final = frozenset({"h2d", "d2h"})
CPU_LACKS: Final = {
    "tf32": "tf32 is a CUDA tensor-core mode",
    "fp8": "fp8 (e4m3 scaled matmul) needs a CUDA device with compute capability >= 8.9",
}
# The compute capability each precision needs on a CUDA device (Ampere 8.0, Ada 8.9); the child
# applies the same rule (workloads.precision).
CUDA_NEEDS: Final = {"tf32": (8, 0), "bf16": (8, 0), "fp8": (8, 9)}


def unsupported_up_front(
    workload: str, precision: str, kind: str, capability: tuple[int, int] | None
) -> str | None:
    """Why a device of ``kind`` ("cpu" or "cuda", a GPU of ``capability`` where NVML states it)
    cannot run ``workload`` at ``precision``, or None where it may (the child decides)."""
    if kind == "cpu":
        if workload in CUDA_ONLY:
            return f"{workload} needs a CUDA device"
        if workload in NODE_WIDE:  # CPU ranks over gloo, fp32 only (workloads.allreduce)
            return None if precision == "fp32" else f"{workload} on CPU ranks is fp32 only"
        return CPU_LACKS.get(precision)
    needs = CUDA_NEEDS.get(precision)
    if capability is None or needs is None or capability >= needs:
        return None
    return (
        f"{precision} needs compute capability >= {needs[0]}.{needs[1]} "
        f"(device has {capability[0]}.{capability[1]})"
    )
