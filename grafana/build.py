"""Writes the sustain Grafana dashboards: ``python grafana/build.py`` -> grafana/dashboards/*.json.

The JSON files are what ships (Grafana provisions or imports them, see grafana/README.md); the
Python beside this script keeps them consistent: panels.py holds one datasource reference, one
set of variables, the same legends, units and layout rules for every board, and each board has
its module (node.py, probes.py, fleet.py, stack_and_drift.py), one function per row. Edit those,
run this, commit both.
``python grafana/build.py --check`` exits 1 when a committed file differs from what it would write;
tests/test_dashboards.py checks the same.

Every metric name comes from docs/metrics.md. Targets Grafana 10/11 (schemaVersion 39).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# grafana/ is not a package: its modules import each other by their own names. Running this as a
# script puts grafana/ on sys.path; loading it by path (tests/test_dashboards.py) does not.
sys.path.append(str(Path(__file__).resolve().parent))

from fleet import fleet
from node import node
from panels import Json
from probes import probes
from stack_and_drift import stack_and_drift

DASHBOARDS = Path(__file__).resolve().parent / "dashboards"

BUILDERS: dict[str, Callable[[], Json]] = {
    "node.json": node,
    "probes.json": probes,
    "fleet.json": fleet,
    "stack-and-drift.json": stack_and_drift,
}


def render() -> dict[str, str]:
    """File name (in grafana/dashboards) -> the JSON text this script writes there."""
    return {
        name: json.dumps(build(), indent=2, ensure_ascii=False) + "\n"
        for name, build in BUILDERS.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a committed file differs; write nothing"
    )
    args = parser.parse_args(argv)
    stale = []
    for name, content in render().items():
        path = DASHBOARDS / name
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == content:
            continue
        stale.append(name)
        if not args.check:
            DASHBOARDS.mkdir(parents=True, exist_ok=True)
            path.write_text(content, encoding="utf-8")
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python grafana/build.py", file=sys.stderr)
        return 1
    for name in stale:
        print(f"wrote grafana/dashboards/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
