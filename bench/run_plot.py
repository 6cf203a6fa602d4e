"""The README's run plot: a real CPU matmul probe slowed halfway by a competing process.

    .venv/bin/python bench/run_plot.py            # draw docs/images/run-plot.svg from its input
    .venv/bin/python bench/run_plot.py --record   # run the probe again (25 s), then draw

The input, docs/images/run-plot.json, is the recorded run: its iterations, its analysis and the
host telemetry sampled at 10 Hz while it ran (the CPU frequency and RAPL readings, the ones the
plot draws). Drawing goes through the path of ``sustain probe --plot``, so the picture in the
README is what the command makes; tests/test_report.py checks the committed one against it.
Prints the run's figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from agent.plots.canvas import save
from agent.plots.run_figure import draw
from agent.plots.run_sources import probe_plot
from agent.probes.analysis import RunAnalysis
from agent.probes.protocol import Iteration
from agent.probes.runner import CPU, ProbeRun, ProbeSpec
from collectors.base import Reading, Sample

ROOT = Path(__file__).resolve().parent.parent
INPUT = ROOT / "docs" / "images" / "run-plot.json"
OUTPUT = ROOT / "docs" / "images" / "run-plot.svg"
KEPT_FIELDS = ("cpu_frequency_hertz", "cpu_frequency_max_hertz", "rapl_energy_joules_total")
SECONDS = 24.0


def record(path: Path) -> None:
    """Run the probe of tests/test_report.py's acceptance test and keep what the plot needs."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_report import slowed_cpu_probe  # noqa: PLC0415 - the test's own slowed probe

    run, analysis, halfway = slowed_cpu_probe(SECONDS)
    if run.outcome != "ok" or analysis is None:
        raise SystemExit(f"bench/run_plot.py: the probe did not finish well: {run.reason}")
    document = {
        "spec": {
            "workload": run.spec.workload,
            "precision": run.spec.precision,
            "optimization": run.spec.optimization,
            "seconds": SECONDS,
        },
        "id": run.id,
        "started_at": run.started_at,
        "ended_at": run.ended_at,
        "unit": (run.manifest or {}).get("unit"),
        "competitor_started_at": halfway,
        "iterations": [[i.index, i.start, i.end, i.work, i.phase] for i in run.iterations],
        "analysis": analysis.as_dict(),
        "telemetry": [
            [
                sample.timestamp,
                [
                    [r.field, r.value, list(map(list, r.labels))]
                    for r in sample.readings
                    if r.field in KEPT_FIELDS
                ],
            ]
            for sample in run.telemetry
        ],
    }
    path.write_text(json.dumps(document, indent=1) + "\n")


def load(path: Path) -> tuple[ProbeRun, RunAnalysis]:
    data: dict[str, Any] = json.loads(path.read_text())
    spec = data["spec"]
    run = ProbeRun(
        id=data["id"],
        spec=ProbeSpec(
            spec["workload"], spec["precision"], spec["optimization"], spec["seconds"], CPU
        ),
        outcome="ok",
        reason="",
        started_at=data["started_at"],
        ended_at=data["ended_at"],
        manifest={"unit": data["unit"]},
        iterations=tuple(Iteration(*row) for row in data["iterations"]),
        telemetry=tuple(
            Sample(
                "host",
                "host",
                timestamp,
                tuple(Reading(f, v, tuple((k, x) for k, x in labels)) for f, v, labels in readings),
            )
            for timestamp, readings in data["telemetry"]
        ),
    )
    return run, RunAnalysis.from_dict(data["analysis"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="run the probe again first")
    parser.add_argument("--input", type=Path, default=INPUT)
    parser.add_argument("--out", type=Path, default=OUTPUT)
    args = parser.parse_args()
    if args.record:
        record(args.input)
    run, analysis = load(args.input)
    save(draw(probe_plot(run, analysis)), args.out)
    figures = analysis.figures
    result = {
        "classification": figures["classification"],
        "steady": figures["steady_throughput"],
        "peak": figures["peak_throughput"],
        "sustained_ratio": figures["sustained_ratio"],
        "iterations": len(run.iterations),
        "samples": len(run.telemetry),
    }
    print(f"{args.out}: {json.dumps(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
