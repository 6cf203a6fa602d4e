"""The process table's CPU attribution (collectors/processes.py) against real busy processes: one
outside this process's tree (foreign) and this process's own child and grandchild (standing in for
the agent's probe children). Every busy
process ends by itself within ``LIFETIME_SECONDS`` and is killed at the end of its test.

The machine may be loaded by anything else, so no test assumes how much CPU a busy loop gets: the
meter's figures are checked against the process's own CPU times read around the two polls."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from collectors.processes import CpuUse, ProcessCpuMeter, process_tree

LIFETIME_SECONDS = 60
BUSY = textwrap.dedent(
    f"""
    import time
    end = time.monotonic() + {LIFETIME_SECONDS}
    while time.monotonic() < end:
        pass
    """
)
TICK_SECONDS = 0.02  # CPU times are counted in clock ticks (10 ms); two readings, two ticks


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def burning(process: psutil.Process) -> psutil.Process:
    """Wait until ``process`` runs its busy loop (past the interpreter's start)."""
    deadline = time.monotonic() + 60
    start = cpu_seconds(process)
    while cpu_seconds(process) < start + 0.05:
        if time.monotonic() > deadline:
            pytest.fail(f"pid {process.pid} used no CPU in 60 s")
        time.sleep(0.05)
    return process


@contextlib.contextmanager
def foreign_busy_process() -> Iterator[psutil.Process]:
    """A busy process outside this process's tree: its launcher exits at once, so it is
    re-parented (to init or the nearest subreaper above us), as production work would be."""
    launcher = textwrap.dedent(
        f"""
        import subprocess, sys
        child = subprocess.Popen(
            [sys.executable, "-c", {BUSY!r}],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        print(child.pid, flush=True)
        """
    )
    started = subprocess.run(
        [sys.executable, "-c", launcher], capture_output=True, text=True, timeout=30, check=True
    )
    process = psutil.Process(int(started.stdout))
    try:
        assert process.pid not in process_tree(os.getpid(), parents())
        yield burning(process)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()  # psutil checks that the pid still names the same process


@contextlib.contextmanager
def own_busy_children() -> Iterator[tuple[psutil.Process, psutil.Process]]:
    """A busy child of this process, and a busy grandchild under a waiting child (a probe child
    and its worker)."""
    spawn = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {BUSY!r}])\n"
    child = subprocess.Popen([sys.executable, "-c", BUSY])
    middle = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        deadline = time.monotonic() + 60
        while not (grandchildren := psutil.Process(middle.pid).children()):
            if time.monotonic() > deadline:
                pytest.fail("the grandchild did not start in 60 s")
            time.sleep(0.05)
        yield burning(psutil.Process(child.pid)), burning(grandchildren[0])
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            for grandchild in psutil.Process(middle.pid).children():
                grandchild.kill()
        for process in (middle, child):
            process.kill()
            process.wait(10)


def parents() -> dict[int, int]:
    return {p.pid: p.info["ppid"] for p in psutil.process_iter(["ppid"]) if p.info["ppid"]}


def measure(meter: ProcessCpuMeter, watched: psutil.Process) -> tuple[CpuUse, float, float]:
    """Two polls a second apart, with ``watched``'s CPU seconds read around each: the meter's
    figure for it must lie between what it surely used (between the polls) and what it could
    have used (around them)."""
    outer_start = cpu_seconds(watched)
    assert meter.poll() is None  # the first poll is the baseline
    inner_start = cpu_seconds(watched)
    time.sleep(1.0)
    inner_end = cpu_seconds(watched)
    use = meter.poll()
    outer_end = cpu_seconds(watched)
    assert use is not None
    return use, inner_end - inner_start, outer_end - outer_start


def by_pid(use: CpuUse) -> dict[int, float]:
    return {process.pid: process.cpus for process in use.processes}


def test_a_foreign_busy_process_is_named_with_the_cpu_it_used() -> None:
    meter = ProcessCpuMeter()
    with foreign_busy_process() as foreign:
        use, surely, at_most = measure(meter, foreign)
    assert 0.5 < use.interval_seconds < 5.0
    found = {process.pid: process for process in use.processes}
    assert foreign.pid in found, use
    assert found[foreign.pid].name == foreign.name()
    seconds = found[foreign.pid].cpus * use.interval_seconds
    assert surely - TICK_SECONDS <= seconds <= at_most + TICK_SECONDS
    cpus = [process.cpus for process in use.processes]
    assert cpus == sorted(cpus, reverse=True)
    assert all(cpu > 0 for cpu in cpus)
    assert use.cpus == pytest.approx(sum(cpus))


def test_the_agents_own_process_tree_is_never_foreign() -> None:
    meter = ProcessCpuMeter()
    with own_busy_children() as (child, grandchild):
        use, surely, _ = measure(meter, child)
        grandchild_used = cpu_seconds(grandchild)
    assert surely > TICK_SECONDS  # the child did use CPU between the polls...
    assert grandchild_used > 0.05
    found = by_pid(use)
    assert child.pid not in found  # ...and is not counted: it is ours
    assert grandchild.pid not in found
    assert os.getpid() not in found


def test_a_process_started_between_two_polls_counts_from_its_start() -> None:
    meter = ProcessCpuMeter()
    assert meter.poll() is None
    with foreign_busy_process() as foreign:  # burning() waits until it has used CPU
        used = cpu_seconds(foreign)
        use = meter.poll()
    assert use is not None
    assert by_pid(use).get(foreign.pid, 0.0) * use.interval_seconds >= used - TICK_SECONDS


def test_an_unreadable_process_table_answers_none(tmp_path: Path) -> None:
    meter = ProcessCpuMeter(tmp_path / "no-proc")
    assert meter.poll() is None
    assert meter.poll() is None


def test_process_tree_follows_parents_down_only() -> None:
    parents = {10: 1, 11: 10, 12: 11, 13: 1, 14: 13, 15: 12}
    assert process_tree(10, parents) == {10, 11, 12, 15}
    assert process_tree(13, parents) == {13, 14}
    assert process_tree(99, parents) == {99}
