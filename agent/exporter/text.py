"""The exposition formats, rendered faster for a registry whose series repeat scrape after scrape.

prometheus_client's encoders validate and escape every label name and value of every sample on
every scrape: on an 8-GPU node that is most of a /metrics request's CPU. The agent's label sets
come back unchanged each scrape, so ``Encoder`` keeps each sample's rendered ``name{labels}``
prefix and formats only the value. The output is what prometheus_client writes (Prometheus text
0.0.4, and OpenMetrics 1.0.0 with its ``# EOF``), byte for byte, for the metric types the agent
exports (gauge, counter, untyped, info); a family of another type, or a sample with a timestamp
or an exemplar, renders that whole scrape through prometheus_client instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import cast

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

OPENMETRICS = "application/openmetrics-text"
_go_float = cast(Callable[[float], str], floatToGoString)  # the library's own float format
PREFIX_CACHE_LIMIT = 200_000  # label sets remembered; past it the cache starts over


class _Unsupported(Exception):
    """A family the fast path does not render: the scrape goes through prometheus_client."""


def _escape_label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(text: str, openmetrics: bool) -> str:
    text = text.replace("\\", r"\\").replace("\n", r"\n")
    return text.replace('"', r"\"") if openmetrics else text


class Encoder:
    """Renders a registry in either format, remembering each series' rendered prefix."""

    def __init__(self) -> None:
        self._prefixes: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}
        self._lock = threading.Lock()

    def render(self, registry: Collector, content_type: str) -> bytes:
        openmetrics = content_type.startswith(OPENMETRICS)
        metrics = list(registry.collect())
        try:
            return self._render(metrics, openmetrics).encode()
        except _Unsupported:
            return (generate_openmetrics if openmetrics else generate_latest)(_Fixed(metrics))

    def _prefix(self, name: str, labels: dict[str, str]) -> str:
        key = (name, tuple(labels.items()))
        prefix = self._prefixes.get(key)
        if prefix is None:
            if any(not label.isidentifier() for label in labels):
                raise _Unsupported  # a label name that needs quoting: prometheus_client's job
            rendered = ",".join(
                f'{k}="{_escape_label_value(v)}"' for k, v in sorted(labels.items())
            )
            prefix = f"{name}{{{rendered}}} " if labels else f"{name} "
            with self._lock:
                if len(self._prefixes) >= PREFIX_CACHE_LIMIT:
                    self._prefixes.clear()
                self._prefixes[key] = prefix
        return prefix

    def _render(self, metrics: Iterable[Metric], openmetrics: bool) -> str:
        lines: list[str] = []
        append = lines.append
        for metric in metrics:
            kind = metric.type
            if kind not in {"gauge", "counter", "unknown", "info"} or metric.unit:
                raise _Unsupported
            name = metric.name
            if openmetrics:
                append(f"# HELP {name} {_escape_help(metric.documentation, True)}\n")
                append(f"# TYPE {name} {kind}\n")
            else:
                shown = {"counter": name + "_total", "info": name + "_info"}.get(kind, name)
                text_kind = {"unknown": "untyped", "info": "gauge"}.get(kind, kind)
                append(f"# HELP {shown} {_escape_help(metric.documentation, False)}\n")
                append(f"# TYPE {shown} {text_kind}\n")
            for sample in metric.samples:
                if sample.timestamp is not None or sample.exemplar is not None:
                    raise _Unsupported
                if sample.name.endswith("_created") and kind == "counter":
                    raise _Unsupported  # prometheus_client moves these to a family of their own
                append(self._prefix(sample.name, sample.labels))
                append(_go_float(sample.value))
                append("\n")
        if openmetrics:
            append("# EOF\n")
        return "".join(lines)


class _Fixed:
    """Metrics already collected, as a registry for prometheus_client's encoders."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return iter(self._metrics)
