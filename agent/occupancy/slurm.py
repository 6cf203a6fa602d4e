"""The Slurm job of a process, from what slurmstepd leaves under /proc.

slurmstepd puts every task in a cgroup named after its job, in both cgroup versions::

    4:devices:/slurm/uid_1000/job_4242/step_0/task_0                 (v1)
    0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0      (v2)

and sets ``SLURM_JOB_ID`` in the task's environment, the fallback where cgroups are not used
(proctrack/linuxproc). The environment of another user's process is readable only by root or
that user: then the job is unknown. A pid can be reused by another process, so an answer is
cached per (pid, start time), the start time being field 22 of /proc/PID/stat.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Collection
from pathlib import Path

_CGROUP_JOB = re.compile(r"/job_(\d+)(?=/|$)", re.MULTILINE)
_ENVIRON_JOB = b"SLURM_JOB_ID="


def start_time(procfs: Path, pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot); None when the process is gone."""
    try:
        stat = (procfs / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields 3.. follow the last ")".
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def job_from_cgroup(text: str) -> str | None:
    found = _CGROUP_JOB.search(text)
    return None if found is None else found.group(1)


def job_from_environ(data: bytes) -> str | None:
    for entry in data.split(b"\0"):
        if entry.startswith(_ENVIRON_JOB):
            job = entry[len(_ENVIRON_JOB) :].decode(errors="replace")
            return job if job.isdigit() else None
    return None


def read_job(procfs: Path, pid: int) -> str | None:
    """The process's Slurm job id, or None: not a Slurm task, gone, or not ours to read."""
    directory = procfs / str(pid)
    try:
        job = job_from_cgroup((directory / "cgroup").read_text())
    except OSError:
        job = None
    if job is not None:
        return job
    try:
        return job_from_environ((directory / "environ").read_bytes())
    except OSError:  # PermissionError for another user's process; gone
        return None


class SlurmJobs:
    """Slurm job ids of processes, read once per process (pid and start time)."""

    def __init__(self, procfs: Path) -> None:
        self.procfs = procfs
        self._lock = threading.Lock()
        self._cache: dict[int, tuple[int, str | None]] = {}  # pid -> (start time, job)

    def job_of(self, pid: int) -> str | None:
        started = start_time(self.procfs, pid)
        if started is None:
            return None
        with self._lock:
            cached = self._cache.get(pid)
        if cached is not None and cached[0] == started:
            return cached[1]
        job = read_job(self.procfs, pid)
        with self._lock:
            self._cache[pid] = (started, job)
        return job

    def keep_only(self, pids: Collection[int]) -> None:
        """Forget the processes that are no longer seen on any device."""
        with self._lock:
            for pid in [pid for pid in self._cache if pid not in pids]:
                del self._cache[pid]

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)
