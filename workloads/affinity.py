"""Binding a probe child to the CPUs nearest its GPU, before it allocates anything.

Pinned host buffers (h2d/d2h copies) are allocated on the NUMA node of the thread that first
touches them; on a dual-socket node the far socket gives a fraction of the bandwidth. The agent
passes the GPU's CPUs (``nvmlDeviceGetCpuAffinityWithinScope``) as ``--cpus``; the child binds
itself to those it may use (its cgroup may allow fewer) and records the binding in its manifest.

torch sizes its thread pools when it is imported, before the binding: the intra-op pool from the
CPUs allowed then, the inter-op pool from every CPU of the machine. A child bound to one NUMA node
of 4 CPUs would run one thread per CPU of the machine on those 4, and measure the contention.
Binding therefore shrinks both pools to the bound CPUs (``--threads`` still sets the intra-op
count after it).
"""

from __future__ import annotations

import os
from typing import Any

import torch


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
    where they do; and ``interop_threads``, torch's inter-op pool after binding (the intra-op
    count is the manifest's ``threads``). Nothing allowed of those asked: left unbound, saying so.
    Before any parallel work: torch refuses to resize its inter-op pool once it has started."""
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
        _fit_thread_pools(len(os.sched_getaffinity(0)))
    return {
        "requested": sorted(requested),
        "cpus": sorted(os.sched_getaffinity(0)),
        "bound": bool(chosen),
        "reason": reason,
        "interop_threads": torch.get_num_interop_threads(),
    }


def _fit_thread_pools(cpus: int) -> None:
    """At most one thread per bound CPU in each pool; a smaller count torch chose (from
    OMP_NUM_THREADS, or physical cores only) is kept."""
    if torch.get_num_threads() > cpus:
        torch.set_num_threads(cpus)
    if torch.get_num_interop_threads() > cpus:
        torch.set_num_interop_threads(cpus)


def _show(cpus: frozenset[int] | set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))
