"""Which processes other than the agent's own used the CPUs between two polls, read with psutil.

The busy check names who is busy when it skips a CPU probe, and the same answer is what a CPU
probe needs to yield when production takes the CPUs. A skip for a busy CPU then ends in::

    ; top: pid 4242 stress-ng 1.9 CPUs, pid 977 python3 0.4 CPUs

psutil reads /proc/<pid>/stat under ``psutil.PROCFS_PATH``, which the meter sets to its procfs
root when it is built: a process-wide global, so one process has one procfs root (the daemon gives
the meter and the host collector the same ``host.procfs``). In a container that root is the host's
procfs mounted elsewhere, whose pids are not the container's: the agent is the process that the
root's ``self`` names, not ``os.getpid()``. The agent's whole process tree (the agent, its probe
children and their workers) is never foreign.

A poll reads one stat file per process (parent and CPU times) and names only the processes that
used CPU since the previous poll. That is about 0.1 ms of CPU per process, so polls are made on
demand (two, one interval apart, when a busy check needs a name), never in a loop of their own.
CPU time of a process that starts and ends between two polls is not seen, as in top(1). A process
that ends during a poll (``NoSuchProcess``) is simply gone; one that cannot be read
(``AccessDenied``) is left out and counted in ``unreadable``; a process table that cannot be read
at all is logged and the poll answers None. Nothing raises into the agent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

_ATTRS = ("ppid", "cpu_times", "create_time")


@dataclass(frozen=True, slots=True)
class ProcessCpu:
    """One process's CPU use over an interval. ``cpus`` is CPU seconds per second of the interval:
    1.0 is one CPU busy throughout. ``name`` is None when the process could not be named."""

    pid: int
    name: str | None
    cpus: float


@dataclass(frozen=True, slots=True)
class CpuUse:
    """The foreign processes that used CPU between two polls, busiest first."""

    interval_seconds: float
    processes: tuple[ProcessCpu, ...]
    unreadable: int = 0

    @property
    def cpus(self) -> float:
        """The CPUs all foreign processes kept busy together over the interval."""
        return sum(process.cpus for process in self.processes)


@dataclass(frozen=True, slots=True)
class _Seen:
    created: float | None
    cpu_seconds: float | None  # either None: listed but not readable


@dataclass(frozen=True, slots=True)
class _Table:
    seen: dict[int, _Seen]
    parents: dict[int, int]
    processes: dict[int, psutil.Process]


def process_tree(root: int, parents: Mapping[int, int]) -> set[int]:
    """``root`` and every process descended from it, by parent pid."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    tree, pending = {root}, [root]
    while pending:
        for child in children.get(pending.pop(), ()):
            if child not in tree:
                tree.add(child)
                pending.append(child)
    return tree


class ProcessCpuMeter:
    """Answers "which foreign processes used how much CPU since the previous poll".

    Each user (the busy check, a probe's watch) keeps its own meter, since an answer covers the
    interval since that meter's previous poll.
    """

    def __init__(self, procfs: Path = Path("/proc")) -> None:
        self._procfs = os.fspath(procfs)
        psutil.PROCFS_PATH = self._procfs
        self._lock = threading.Lock()
        self._previous: dict[int, _Seen] | None = None
        self._previous_at = 0.0

    @property
    def procfs(self) -> Path:
        """The procfs root it reads (another meter on the same root answers for another user)."""
        return Path(self._procfs)

    def poll(self) -> CpuUse | None:
        """The foreign processes' CPU use since the previous poll; None for the first poll, and
        when the process table cannot be read."""
        with self._lock:
            now = time.monotonic()
            try:
                table = self._read()
            except (psutil.Error, OSError) as exc:
                log.warning("the process table under %s cannot be read: %s", self._procfs, exc)
                self._previous = None
                return None
            previous, previous_at = self._previous, self._previous_at
            self._previous, self._previous_at = table.seen, now
        if previous is None or now <= previous_at:
            return None
        own = process_tree(self._own_pid(), table.parents)
        used: list[tuple[float, int]] = []
        unreadable = 0
        for pid, seen in table.seen.items():
            if pid in own:
                continue
            if seen.created is None or seen.cpu_seconds is None:
                unreadable += 1
                continue
            before = previous.get(pid)
            if before is None or before.created not in (None, seen.created):
                # Listed now and not at the previous poll (or the pid was reused): it started
                # since then, so all of its CPU time falls in the interval.
                seconds = seen.cpu_seconds
            elif before.created is None or before.cpu_seconds is None:
                continue  # no baseline to measure from
            else:
                seconds = seen.cpu_seconds - before.cpu_seconds
            if seconds > 0:
                used.append((seconds, pid))
        interval = now - previous_at
        used.sort(key=lambda item: (-item[0], item[1]))
        return CpuUse(
            interval_seconds=interval,
            processes=tuple(
                ProcessCpu(pid, _name(table.processes[pid]), seconds / interval)
                for seconds, pid in used
            ),
            unreadable=unreadable,
        )

    def _read(self) -> _Table:
        seen: dict[int, _Seen] = {}
        parents: dict[int, int] = {}
        processes: dict[int, psutil.Process] = {}
        for process in psutil.process_iter(_ATTRS, ad_value=None):
            info = process.info
            times = info["cpu_times"]
            seen[process.pid] = _Seen(
                created=info["create_time"],
                cpu_seconds=None if times is None else times.user + times.system,
            )
            if info["ppid"] is not None:
                parents[process.pid] = info["ppid"]
            processes[process.pid] = process
        return _Table(seen, parents, processes)

    def _own_pid(self) -> int:
        """The agent's pid as the procfs root numbers it (the host's pid inside a container)."""
        try:
            return int(os.readlink(os.path.join(self._procfs, "self")))
        except (OSError, ValueError):
            return os.getpid()


def _name(process: psutil.Process) -> str | None:
    try:
        return process.name()
    except psutil.Error:
        return None
