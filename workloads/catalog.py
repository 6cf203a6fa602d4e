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
OPTIMIZATIONS: Final = ("eager", "compiled")

# Node-wide by nature: one run spans every GPU of the node (the agent makes them all visible).
NODE_WIDE: Final = frozenset({"allreduce"})

WORKLOADS: Final[dict[str, Declared]] = {
    declared.name: declared
    for declared in (
        Declared("matmul", ("fp32", "tf32", "bf16", "fp16", "fp8", "int8"), ("eager",)),
        Declared("membw", ("fp32",), ("eager",)),
        Declared("h2d", ("fp32",), ("eager",)),
        Declared("d2h", ("fp32",), ("eager",)),
        Declared("attention", ("bf16", "fp16", "fp32"), ("eager",)),
        Declared("inference", ("bf16", "fp16", "fp32"), ("eager", "compiled")),
        Declared("allreduce", ("fp32", "bf16"), ("eager",)),
    )
}
