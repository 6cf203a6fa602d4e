"""Workload, precision and optimization names, checked against the workloads' catalogue.

A misspelt name in the probe plan or in a `sustain probe` flag is found before any child starts
and said with the nearest known name, e.g. ``unknown workload 'matmull' (did you mean 'matmul'?
known: matmul, membw, ...)``. The catalogue is plain data (workloads/catalog.py), so the daemon
checks names without importing torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from difflib import get_close_matches

from workloads.catalog import (
    LEVEL_PRECISIONS,
    NODE_WIDE,
    OPTIMIZATIONS,
    PRECISIONS,
    WORKLOADS,
    cuda_native_reason,
    unsupported_up_front,
)

__all__ = [
    "NODE_WIDE",
    "OPTIMIZATIONS",
    "PRECISIONS",
    "UnknownName",
    "check_optimization",
    "check_precision",
    "check_workload",
    "cuda_native_reason",
    "unsupported_up_front",
]


class UnknownName(ValueError):
    """A name the catalogue does not have (for these workloads); the message is one line."""


def check_workload(name: str) -> None:
    if name not in WORKLOADS:
        raise _unknown("workload", name, tuple(WORKLOADS), ())


def check_precision(precision: str, workloads: Sequence[str] = ()) -> None:
    """``precision`` must be declared by at least one of ``workloads`` (any, if none is known)."""
    declared = [WORKLOADS[name] for name in workloads if name in WORKLOADS]
    known = _union([d.precisions for d in declared]) if declared else PRECISIONS
    if precision not in known:
        raise _unknown("precision", precision, known, [d.name for d in declared])


def check_optimization(optimization: str, workloads: Sequence[str] = ()) -> None:
    """``optimization`` must be declared by one of ``workloads`` (any, if none is known)."""
    declared = [WORKLOADS[name] for name in workloads if name in WORKLOADS]
    known = _union([d.optimizations for d in declared]) if declared else OPTIMIZATIONS
    if optimization not in known:
        raise _unknown("optimization", optimization, known, [d.name for d in declared])


def declares(workload: str, precision: str, optimization: str) -> bool:
    """Whether the workload takes this precision and optimization level on its command line, and
    the level applies to the precision (matmul's fast_accum is fp8's only)."""
    declared = WORKLOADS.get(workload)
    return (
        declared is not None
        and precision in declared.precisions
        and optimization in declared.optimizations
        and precision in LEVEL_PRECISIONS.get((workload, optimization), (precision,))
    )


def _union(lists: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for names in lists for name in names))


MAX_NAME_CHARS = 60  # of an unknown name quoted in the message (it may come from a fuzzer)


def _unknown(kind: str, value: str, known: Sequence[str], owners: Sequence[str]) -> UnknownName:
    if len(value) > MAX_NAME_CHARS:
        shown, close = f"{value[:MAX_NAME_CHARS]!r}...", []
    else:
        shown, close = repr(value), get_close_matches(value, known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    owner = f" for {', '.join(owners)}" if owners else ""
    return UnknownName(f"unknown {kind} {shown}{owner} ({hint}known: {', '.join(known)})")
