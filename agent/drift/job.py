"""The daemon's side of drift detection: run it in a child, archive what it finds, export it.

Drift detection needs numpy and scipy, which the daemon keeps out of its memory; so a scheduled
job starts ``python -m agent.drift.detect`` (the agent's own interpreter), hands it the database
URL and the settings on standard input (never on the command line, where ``ps`` shows it), and
reads back this node's drifts and fleet comparisons as JSON. Each drift becomes a ``drift`` event
with an id derived from the change (found again next hour, it is the same event), and the latest
drift and the fleet ratio of every series are exported as ``sustain_drift_*``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from agent.archive.sink import ArchiveSink
from agent.config.settings import DriftSection
from collectors.base import Event

log = logging.getLogger(__name__)

DRIFT_TIMEOUT_SECONDS = 600.0
SERIES_LABELS = ["device", "uuid", "workload", "precision", "optimization"]  # series_labels()


@dataclass(frozen=True, slots=True)
class DriftStatus:
    runs: dict[str, int]  # outcome -> count
    last_run: float | None
    latest: dict[tuple[str, ...], dict[str, Any]]  # series labels -> the latest drift
    fleet: dict[tuple[str, ...], dict[str, Any]] = field(default_factory=dict)


def series_labels(item: dict[str, Any]) -> tuple[str, ...]:
    label = str(item["device_label"])
    uuid = "" if item["device"] == "host" else str(item["device"])
    return (label, uuid, item["workload"], item["precision"], item["optimization"])


class DriftJob:
    def __init__(
        self,
        settings: DriftSection,
        database_url: str,
        node: str,
        sink: ArchiveSink | None,
        baseline_days: float = 7.0,
    ) -> None:
        """``baseline_days``: health's fleet baseline period, for the fleet's pass of
        agent.archive.fleet_baselines that this node's child may be the one to make."""
        self._settings = settings
        self._baseline_days = baseline_days
        self._url = database_url
        self._node = node
        self._sink = sink
        self._lock = threading.Lock()
        self._runs: Counter[str] = Counter()
        self._last_run: float | None = None
        self._latest: dict[tuple[str, ...], dict[str, Any]] = {}
        self._fleet: dict[tuple[str, ...], dict[str, Any]] = {}
        self._seen: set[str] = set()

    def run(self) -> dict[str, Any] | None:
        request = {
            "database_url": self._url,
            "node": self._node,
            "window": self._settings.window,
            "max_pvalue": self._settings.max_pvalue,
            "min_magnitude": self._settings.min_magnitude,
            "history": self._settings.history,
            "outlier_ratio": self._settings.outlier_ratio,
            "interval_seconds": self._settings.interval_seconds,
            "baseline_days": self._baseline_days,
        }
        try:
            completed = subprocess.run(
                [sys.executable, "-m", "agent.drift.detect"],
                input=json.dumps(request),
                capture_output=True,
                text=True,
                timeout=DRIFT_TIMEOUT_SECONDS,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._failed(f"did not run: {exc}")
            return None
        if completed.returncode != 0:
            last = (completed.stderr.strip().splitlines() or ["no error output"])[-1]
            self._failed(f"exit {completed.returncode}: {last}")
            return None
        try:
            answer: dict[str, Any] = json.loads(completed.stdout)
        except json.JSONDecodeError:
            self._failed("the child printed no JSON")
            return None
        self.take(answer)
        return answer

    def _failed(self, reason: str) -> None:
        log.error("drift detection failed: %s", reason)
        with self._lock:
            self._runs["failed"] += 1
            self._last_run = time.time()

    def take(self, answer: dict[str, Any]) -> None:
        latest: dict[tuple[str, ...], dict[str, Any]] = {}
        events = []
        for drift in answer["drifts"]:
            latest[series_labels(drift)] = drift  # sorted by time: the last one wins
            if drift["event_id"] in self._seen:
                continue
            self._seen.add(drift["event_id"])
            events.append(
                Event(
                    kind="drift",
                    device=drift["device"],
                    timestamp=_timestamp(drift["at"]),
                    message=(
                        f"{drift['workload']} {drift['precision']} {drift['optimization']} "
                        f"{drift['direction']} {drift['change']:+.1%} ({drift['cause']}): "
                        f"{drift['explanation']}"
                    ),
                    attributes=tuple(
                        (name, str(drift[name]))
                        for name in (
                            "workload",
                            "precision",
                            "optimization",
                            "before",
                            "after",
                            "change",
                            "pvalue",
                            "direction",
                            "cause",
                            "explanation",
                            "run_id",
                            "stack_before",
                            "stack_after",
                        )
                    ),
                    id=drift["event_id"],
                )
            )
        for event in events:
            log.warning("drift on %s: %s", event.device, event.message)
        if events and self._sink is not None:
            self._sink.add_events(events)  # idempotent by id across restarts
        fleet = {series_labels(o): o for o in answer["outliers"]}
        with self._lock:
            self._runs["ok"] += 1
            self._last_run = time.time()
            self._latest = latest
            self._fleet = fleet

    def status(self) -> DriftStatus:
        with self._lock:
            return DriftStatus(
                dict(self._runs), self._last_run, dict(self._latest), dict(self._fleet)
            )


def _timestamp(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()
