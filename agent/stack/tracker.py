"""Knowing the stack the daemon's results run on, and noticing when it changes.

The daemon never imports torch, so its torch facts come from probe children: once from
``python -m workloads facts`` (at start-up and when the probe interpreter changes nothing else),
then from every probe's manifest, which carries the torch of the very run. The SDPA backend is the
one the last attention probe chose (kept across restarts through the archived stack, so a restart
is not a stack change). A snapshot is read on a schedule and after every probe run; a new id is a
stack change: a ``stack_changed`` event with the readable diff, the snapshot stored once, the
change counter and timestamp on /metrics.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.archive.sink import ArchiveSink
from agent.archive.stack_snapshots import STACK_CHANGED
from agent.probes.runner import CPU, ProbeRun, child_environment
from collectors.base import Event
from collectors.nvml.library import NvmlLibrary
from collectors.stack import StackSnapshot, capture, describe_diff, diff

log = logging.getLogger(__name__)

FACTS_TIMEOUT_SECONDS = 120.0
# Labels of sustain_stack_info: (label, dotted path in the snapshot).
INFO_LABELS = (
    ("driver_version", "driver.version"),
    ("cuda_driver_version", "driver.cuda_version"),
    ("torch_version", "torch.version"),
    ("torch_cuda_version", "torch.cuda"),
    ("cudnn_version", "torch.cudnn"),
    ("nccl_version", "torch.nccl"),
    ("python_version", "host.python"),
    ("kernel_version", "host.kernel"),
    ("sdpa_backend", "sdpa_backend"),
)


@dataclass(frozen=True, slots=True)
class StackStatus:
    stack_id: str | None
    labels: dict[str, str]
    changes: int
    last_change_timestamp: float | None


def _lookup(facts: Mapping[str, Any], path: str) -> Any:
    value: Any = facts
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def summary(changes: list[tuple[str, Any, Any]], limit: int = 6) -> str:
    """``driver.version 550.54 -> 555.42, torch.version 2.4.1 -> 2.5.0`` (the first few)."""
    parts = [
        f"{path} {'absent' if old is None else old} -> {'absent' if new is None else new}"
        for path, old, new in changes[:limit]
    ]
    if len(changes) > limit:
        parts.append(f"and {len(changes) - limit} more")
    return ", ".join(parts)


def torch_facts_from_child(python: str) -> dict[str, Any] | None:
    """``python -m workloads facts`` in the probes' environment; None (logged) when it fails."""
    try:
        completed = subprocess.run(
            [python, "-m", "workloads", "facts", "--device", "cpu"],
            capture_output=True,
            text=True,
            timeout=FACTS_TIMEOUT_SECONDS,
            check=False,
            env=child_environment(CPU),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("torch facts not read: %s", exc)
        return None
    if completed.returncode != 0:
        last = (completed.stderr.strip().splitlines() or ["no error output"])[-1]
        log.warning("torch facts not read: exit %d: %s", completed.returncode, last)
        return None
    try:
        facts = json.loads(completed.stdout)
    except json.JSONDecodeError:
        log.warning("torch facts not read: the child printed no JSON")
        return None
    return facts if isinstance(facts, dict) else None


class StackTracker:
    """The node's current stack: read it, remember it, report a change."""

    def __init__(
        self,
        sink: ArchiveSink | None,
        *,
        nvml: NvmlLibrary | None,
        python: str,
        previous: tuple[str, Mapping[str, Any]] | None = None,
        container_image: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._sink = sink
        self._nvml = nvml
        self._python = python
        self._container_image = container_image
        self._environ = environ
        self._lock = threading.Lock()
        self._torch: dict[str, Any] | None = None
        self._sdpa: str | None = None
        self._current: StackSnapshot | None = None
        self._previous_id: str | None = None
        self._previous_facts: Mapping[str, Any] | None = None
        if previous is not None:
            self._previous_id, self._previous_facts = previous
            sdpa = previous[1].get("sdpa_backend")
            self._sdpa = str(sdpa) if sdpa else None
        self._stored: set[str] = set()
        self._changes = 0
        self._last_change: float | None = None

    def refresh(self) -> StackSnapshot:
        """Scheduled: read the stack (and the torch facts first, if no probe has given them)."""
        with self._lock:
            need_facts = self._torch is None
        if need_facts:
            facts = torch_facts_from_child(self._python)
            if facts is not None:
                with self._lock:
                    self._torch = facts
        return self._observe()

    def after_run(self, run: ProbeRun) -> str:
        """The id of the stack a finished run ran on (its manifest has that run's torch)."""
        manifest = run.manifest
        if manifest is not None and manifest.get("torch"):
            with self._lock:
                self._torch = dict(manifest)
                kernel = manifest.get("kernel")
                if run.spec.workload == "attention" and kernel:
                    self._sdpa = str(kernel)
        return self._observe().id

    def _observe(self) -> StackSnapshot:
        with self._lock:
            torch, sdpa = self._torch, self._sdpa
        kwargs: dict[str, Any] = {} if self._environ is None else {"environ": self._environ}
        snapshot = capture(
            torch_facts=torch,
            nvml=self._nvml,
            sdpa_backend=sdpa,
            container_image=self._container_image,
            **kwargs,
        )
        now = time.time()
        with self._lock:
            old = self._current
            self._current = snapshot
            if old is not None and old.id == snapshot.id:
                return snapshot
            if old is None and self._previous_id == snapshot.id:
                return snapshot  # the same stack as before the restart
            before_id = old.id if old is not None else self._previous_id
            before = old.facts if old is not None else self._previous_facts
            changes = diff(before or {}, snapshot.facts) if before is not None else []
            self._changes += 1
            self._last_change = now
            store = snapshot.id not in self._stored
            self._stored.add(snapshot.id)
        text = summary(changes) if before is not None else "first stack recorded for this node"
        if before_id is not None:
            log.info("stack changed %s -> %s: %s", before_id[:12], snapshot.id[:12], text)
            if changes:
                log.debug("stack diff:\n%s", describe_diff(changes))
        else:
            log.info("stack %s", snapshot.id[:12])
        if self._sink is not None:
            if store:
                self._sink.add_stack(snapshot.id, dict(snapshot.facts), now)
            self._sink.add_events(
                [
                    Event(
                        kind=STACK_CHANGED,
                        device="node",
                        timestamp=now,
                        message=f"stack {snapshot.id[:12]}: {text}",
                        attributes=(
                            ("new", snapshot.id),
                            ("old", before_id or ""),
                            ("summary", text),
                        ),
                    )
                ]
            )
        return snapshot

    @property
    def current(self) -> StackSnapshot | None:
        with self._lock:
            return self._current

    def status(self) -> StackStatus:
        with self._lock:
            current, changes, last = self._current, self._changes, self._last_change
        if current is None:
            return StackStatus(None, {}, changes, last)
        labels = {}
        for label, path in INFO_LABELS:
            value = _lookup(current.facts, path)
            labels[label] = "" if value is None else str(value)
        return StackStatus(current.id, labels, changes, last)
