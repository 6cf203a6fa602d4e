"""Binding a probe child to the CPUs nearest its GPU, before it allocates anything.

Pinned host buffers (h2d/d2h copies) are allocated on the NUMA node of the thread that first
touches them; on a dual-socket node the far socket gives a fraction of the bandwidth. The agent
passes the GPU's CPUs (``nvmlDeviceGetCpuAffinityWithinScope``) as ``--cpus``; the child binds
itself to those it may use (its cgroup may allow fewer) and records the binding in its manifest.
"""

from __future__ import annotations

import os
from typing import Any


def parse(text: str) -> frozenset[int]:
    """``--cpus``: CPU numbers separated by commas ("0,1,2,3"); ValueError names a bad one."""
    try:
        cpus = frozenset(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"must be CPU numbers separated by commas, not {text!r}") from None
    if not cpus or min(cpus) < 0:
        raise ValueError(f"must be CPU numbers separated by commas, not {text!r}")
    return cpus


def bind(requested: frozenset[int]) -> dict[str, Any]:
    """Bind this process to the requested CPUs it is allowed; the manifest's ``cpu_binding``:
    the CPUs asked for, the CPUs it runs on now (``os.sched_getaffinity``), and why they differ
    where they do. Nothing allowed of those asked: left unbound, saying so."""
    allowed = os.sched_getaffinity(0)
    chosen = requested & allowed
    reason = None
    if not chosen:
        reason = (
            f"none of the GPU's CPUs ({_show(requested)}) is allowed to this process "
            f"(allowed: {_show(allowed)}): left unbound"
        )
    else:
        os.sched_setaffinity(0, chosen)
        if chosen != requested:
            reason = f"CPUs {_show(requested - allowed)} are not allowed here (cgroup cpuset)"
    return {
        "requested": sorted(requested),
        "cpus": sorted(os.sched_getaffinity(0)),
        "bound": bool(chosen),
        "reason": reason,
    }


def _show(cpus: frozenset[int] | set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))
