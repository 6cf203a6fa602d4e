"""Every PromQL expression of the sustain dashboards (grafana/dashboards/*.json), ready to run.

grafana/ is not a Python package: load this file by path.

    spec = importlib.util.spec_from_file_location("grafana_queries", "grafana/queries.py")
    module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
    for dashboard, title, expr in module.dashboard_queries(): ...

``dashboard_queries()`` reads the committed JSON (what Grafana gets), not grafana/build.py, and
returns one ``(dashboard, title, expr)`` per query: ``dashboard`` is the file's stem (``node``,
``probes``, ``fleet``, ``stack-and-drift``); ``title`` the panel's title, ``annotation: NAME`` for
an annotation query, ``variable: NAME`` for the series selector of a ``label_values()`` variable.
In ``expr`` Grafana's variables are replaced the way Grafana would with "All" selected: template
variables by a regex matching everything (``.*``; the dashboards only use them in ``=~``
matchers), ``$__rate_interval`` and ``$__interval`` by ``1m``, ``$__range`` by ``1h``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Json = dict[str, Any]

DASHBOARDS = Path(__file__).resolve().parent / "dashboards"
DURATIONS = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h"}
MATCH_ALL = ".*"

# $name, ${name}, ${name:format}, [[name]]
VARIABLE_REFERENCE = re.compile(
    r"\$\{(?P<braced>\w+)(?::[^}]*)?\}|\$(?P<plain>\w+)|\[\[(?P<bracketed>\w+)(?::[^\]]*)?\]\]"
)
LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?P<selector>.+),\s*(?P<label>\w+)\s*\)\s*$", re.S)


def variable_references(text: str) -> list[str]:
    """Names of the Grafana variables ``text`` refers to, in order (built-ins included)."""
    return [
        match["braced"] or match["plain"] or match["bracketed"]
        for match in VARIABLE_REFERENCE.finditer(text)
    ]


def substitute(expr: str, value: str = MATCH_ALL) -> str:
    """``expr`` with built-in intervals replaced by durations and template variables by ``value``.

    An unknown built-in (``$__something``) is a ValueError: add its duration to DURATIONS.
    """

    def replace(match: re.Match[str]) -> str:
        name = match["braced"] or match["plain"] or match["bracketed"]
        if name in DURATIONS:
            return DURATIONS[name]
        if name.startswith("__"):
            raise ValueError(f"no substitute for Grafana's ${name} in {expr!r}")
        return value

    return VARIABLE_REFERENCE.sub(replace, expr)


def panels(dashboard: Json) -> Iterator[Json]:
    """Every panel, those inside (collapsed) rows included, rows themselves included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def annotation_expr(item: Json) -> str:
    """The PromQL of a Prometheus annotation (Grafana 10/11 keep it in ``target``)."""
    target = item.get("target") or {}
    return str(target.get("expr") or item.get("expr") or "")


def variable_selector(variable: Json) -> str | None:
    """The series selector of a ``label_values(selector, label)`` query variable, else None."""
    query = variable.get("query")
    if isinstance(query, dict):
        query = query.get("query")
    match = LABEL_VALUES.match(str(query or variable.get("definition") or ""))
    return match["selector"] if match else None


def load(directory: Path | None = None) -> dict[str, Json]:
    """Dashboard file stem -> its parsed JSON, sorted by name."""
    folder = directory or DASHBOARDS
    return {
        path.stem: json.loads(path.read_text(encoding="utf-8"))
        for path in sorted(folder.glob("*.json"))
    }


def raw_queries(directory: Path | None = None) -> list[tuple[str, str, str]]:
    """As dashboard_queries(), with Grafana's variables left in the expressions."""
    found: list[tuple[str, str, str]] = []
    for stem, dashboard in load(directory).items():
        for variable in dashboard.get("templating", {}).get("list", []):
            selector = variable_selector(variable) if variable.get("type") == "query" else None
            if selector is not None:
                found.append((stem, f"variable: {variable['name']}", selector))
        for item in dashboard.get("annotations", {}).get("list", []):
            if not item.get("builtIn"):
                found.append((stem, f"annotation: {item['name']}", annotation_expr(item)))
        for panel in panels(dashboard):
            for target in panel.get("targets", []):
                if target.get("expr"):
                    found.append((stem, str(panel.get("title", "")), str(target["expr"])))
    return found


def dashboard_queries(directory: Path | None = None) -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) for every query of every dashboard, variables replaced."""
    return [(stem, title, substitute(expr)) for stem, title, expr in raw_queries(directory)]
