"""Run every benchmark and write one results table to docs/performance.md (and print it).

Each benchmark runs as its own process, in the repository root, with this interpreter; its output
is echoed to standard error as it comes, and its last line, ``RESULT {json}``, is what the table
is made of. A benchmark that fails or prints no RESULT line becomes a FAILED row, the others still
run, and the exit status is 1. The table replaces what stands between the markers
``<!-- results:start -->`` and ``<!-- results:end -->`` in docs/performance.md.

    .venv/bin/python bench/run_all.py            # full: 16-25 minutes on 2 busy cores
    .venv/bin/python bench/run_all.py --quick    # shorter windows, 100,000 capacity results

--quick shortens every window (20 s idle overhead, 10 s per sampler rate, 15 s of scrape load,
smaller ingest and capacity archives, one probe fidelity round); its figures are noisier and say
so in the table's heading.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import create_engine, text
from sqlalchemy.exc import SQLAlchemyError

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
START_MARKER = "<!-- results:start -->"
END_MARKER = "<!-- results:end -->"
POSTGRES_MAINTENANCE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@dataclass(frozen=True, slots=True)
class Step:
    key: str
    script: str
    full: tuple[str, ...]
    quick: tuple[str, ...]
    timeout: float


FLEET_SHORT = ("--agents", "20", "--minutes", "0.5")

STEPS = (
    Step("overhead", "overhead.py", (), ("--seconds", "20"), 600),
    Step("sampler_1", "sampler.py", ("--gpus", "1"), ("--gpus", "1", "--seconds", "10"), 600),
    Step("sampler_8", "sampler.py", ("--gpus", "8"), ("--gpus", "8", "--seconds", "10"), 600),
    Step("scrape", "scrape.py", (), ("--seconds", "15", "--rest-requests", "20"), 600),
    Step(
        "scrape_8",
        "scrape.py",
        ("--gpus", "8", "--rest-requests", "120"),
        ("--gpus", "8", "--seconds", "15", "--rest-requests", "60"),
        600,
    ),
    Step("analysis", "analysis.py", (), ("--quick",), 600),
    Step("ingest", "ingest.py", (), ("--batches", "20", "--runs", "50"), 1200),
    Step("capacity", "capacity.py", (), ("--results", "100000"), 3600),
    # The traffic of 10,000 nodes from 20 agents for 30 s (the acceptance run is 200 agents for
    # 5 minutes: bench/fleet_scale.py with its defaults, docs/scale.md).
    Step("fleet_scale", "fleet_scale.py", FLEET_SHORT, FLEET_SHORT, 900),
    Step("probe_fidelity", "probe_fidelity.py", (), ("--rounds", "1"), 2400),
)


@dataclass
class Outcome:
    step: Step
    seconds: float
    result: dict[str, Any] | None
    problem: str = ""


def run_step(step: Step, quick: bool) -> Outcome:
    """Run one benchmark, echoing its output to standard error; parse its RESULT line."""
    arguments = step.quick if quick else step.full
    command = [sys.executable, str(ROOT / "bench" / step.script), *arguments]
    print(f"\n== {step.key}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    started = time.monotonic()
    lines: list[str] = []
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True) as process:
        echo = threading.Thread(target=relay, args=(process, step.key, lines), daemon=True)
        echo.start()
        try:
            code = process.wait(timeout=step.timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            problem = f"timed out after {step.timeout:g} s"
            return Outcome(step, time.monotonic() - started, None, problem)
        finally:
            echo.join(10)
    seconds = time.monotonic() - started
    last = next((line for line in reversed(lines) if line.strip()), "").strip()
    result = json.loads(last[len("RESULT ") :]) if last.startswith("RESULT ") else None
    if result is None:
        return Outcome(step, seconds, None, f"exit {code}, no RESULT line")
    return Outcome(step, seconds, result, "" if code == 0 else f"exit {code}")


def relay(process: subprocess.Popen[str], key: str, lines: list[str]) -> None:
    """Echo the benchmark's output to standard error as it comes, and keep it."""
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        print(f"[{key}] {line}", end="", file=sys.stderr, flush=True)


# The environment ------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def postgres_version() -> str:
    engine = create_engine(POSTGRES_MAINTENANCE_URL)
    try:
        with engine.connect() as connection:
            return str(connection.execute(text("SHOW server_version")).scalar_one())
    except SQLAlchemyError as exc:
        return f"unreachable ({str(exc).splitlines()[0][:80]})"
    finally:
        engine.dispose()


def environment() -> dict[str, str]:
    memory = psutil.virtual_memory().total
    return {
        "machine": (
            f"{cpu_model()}, {os.cpu_count()} cores ({platform.machine()}), "
            f"{memory / 2**30:.1f} GiB memory, Linux {platform.release()}"
        ),
        "versions": (
            f"Python {platform.python_version()}, torch {version('torch')}, "
            f"sustain {version('sustain')}, PostgreSQL {postgres_version()}, "
            f"SQLite {sqlite3.sqlite_version}, SQLAlchemy {version('SQLAlchemy')}, "
            f"prometheus_client {version('prometheus_client')}"
        ),
    }


# The table ------------------------------------------------------------------------------------

Row = tuple[str, str, str, str, str]  # benchmark, figure, result, target, verdict


def verdict(ok: bool) -> str:
    return "meets" if ok else "**missed**"


def overhead_rows(r: dict[str, Any]) -> Iterator[Row]:
    name = f"idle overhead, {r['seconds']:.0f} s (`overhead.py`)"
    cpu = r["cpu_percent"]
    yield name, "CPU, % of one core", f"{cpu:.2f} %", "< 1 %", verdict(cpu < 1.0)
    peak = r["rss_peak_mib"]
    yield (
        name,
        "peak RSS (RSS at the end)",
        f"{peak:.1f} MiB ({r['rss_end_mib']:.1f} MiB)",
        "< 100 MB",
        verdict(peak * 2**20 < 100e6),
    )


def sampler_rows(r: dict[str, Any]) -> Iterator[Row]:
    for figure in r["rates"]:
        at_target = r["gpus"] == 8 and figure["rate_hz"] == 1.0
        cpu = figure["cpu_percent"]
        yield (
            f"sampler, {r['gpus']} fake GPU{'s' if r['gpus'] > 1 else ''} (`sampler.py`)",
            f"CPU at {figure['rate_hz']:g} Hz, % of one core",
            f"{cpu:.2f} % ({figure['cpu_per_poll_ms']:.2f} ms per poll)",
            "<= 2 %" if at_target else "",
            verdict(cpu <= 2.0) if at_target else "",
        )


def scrape_rows(r: dict[str, Any]) -> Iterator[Row]:
    rest, load = r["rest"], r["load"]
    name = f"scrape /metrics, {r['gpus']} fake GPUs, {r['body_bytes'] / 1024:.0f} KiB (`scrape.py`)"
    eight = r["gpus"] >= 8  # issue 17: p99 at rest <= 10 ms on an 8-GPU node
    yield (
        name,
        f"latency at rest, {rest['requests']} requests {rest.get('gap_s', 0.1):g} s apart",
        f"p50 {rest['p50_ms']:.1f} ms, p99 {rest['p99_ms']:.1f} ms",
        "p99 <= 10 ms" if eight else "",
        verdict(rest["p99_ms"] <= 10.0) if eight else "",
    )
    rate = load["achieved_rps"]
    yield (
        name,
        f"rate under load, {load['threads']} threads, {load['offered_rps']:g}/s offered, "
        f"{load['seconds']:g} s",
        f"{rate:.1f} req/s (agent CPU {load['agent_cpu_percent']:.0f} % of one core)",
        ">= 200 req/s",
        verdict(rate >= 200),
    )
    yield (
        name,
        "latency under load",
        f"p50 {load['p50_ms']:.1f} ms, p99 {load['p99_ms']:.1f} ms",
        "",
        "",
    )
    lag = max(load["worst_lag_ms"].values(), default=float("nan"))
    yield (
        name,
        "errors; worst sampler lag under load",
        f"{load['errors']} of {load['requests']}; {lag:.1f} ms",
        "0; < 100 ms",
        verdict(load["errors"] == 0 and lag < 100),
    )


def analysis_rows(r: dict[str, Any]) -> Iterator[Row]:
    for size in r["sizes"]:
        label = f"steady-state analysis, best/median of {r['runs']} (`analysis.py`)"
        if size["n"] <= 5000 and size["target_s"] is not None:
            yield (
                label,
                f"analysis time, n = {size['n']}",
                f"{size['analysis_s'] * 1000:.1f} ms ({size['classification']})",
                f"<= {size['target_s'] * 1000:.0f} ms",
                verdict(size["analysis_s"] <= size["target_s"]),
            )
        elif size["target_s"] is not None:
            yield (
                label,
                f"child's time and peak RSS, n = {size['n']}",
                f"{size['median_s']:.2f} s, {size['peak_rss_mb']:.0f} MB",
                f"<= {size['target_s']:g} s, <= {size['target_mb']:g} MB",
                verdict(
                    size["median_s"] <= size["target_s"]
                    and size["peak_rss_mb"] <= size["target_mb"]
                ),
            )


def backends_in_order(figures: dict[str, Any]) -> list[tuple[str, Any]]:
    """SQLite (every node's archive) first, then PostgreSQL (a fleet's)."""
    return sorted(figures.items(), key=lambda item: (item[0] != "sqlite", item[0]))


def ingest_rows(r: dict[str, Any]) -> Iterator[Row]:
    for backend, figures in backends_in_order(r["backends"]):
        rollups, runs = figures["rollups"], figures["probe_runs"]
        name = f"archive ingest, {backend} (`ingest.py`)"
        yield (
            name,
            f"rollup rows, {rollups['batches']} batches of {rollups['rows_per_batch']}: "
            "end to end (into the spool; drained)",
            f"{rollups['end_to_end_rows_per_s']:,.0f}/s ({rollups['append_rows_per_s']:,.0f}/s; "
            f"{rollups['drain_rows_per_s']:,.0f}/s)",
            "",
            "",
        )
        yield (
            name,
            f"probe runs of {runs['iterations_per_run']} iterations, {runs['runs']} runs: "
            "end to end (into the spool; drained)",
            f"{runs['end_to_end_runs_per_s']:,.1f}/s ({runs['append_runs_per_s']:,.1f}/s; "
            f"{runs['drain_runs_per_s']:,.1f}/s)",
            "",
            "",
        )


def capacity_rows(r: dict[str, Any]) -> Iterator[Row]:
    for backend, queries in backends_in_order(r["backends"]):
        slowest = max(queries, key=lambda query: query["seconds"])
        others = ", ".join(f"{q['seconds']:.3f}" for q in queries if q is not slowest)
        yield (
            f"capacity query, {backend}, {r['results']:,} results (`capacity.py`)",
            f"slowest of {len(queries)} queries, best of {r['repeats']}",
            f"{slowest['seconds']:.3f} s (`{slowest['query']}`; others {others} s)",
            f"<= {r['target_s']:g} s",
            verdict(slowest["seconds"] <= r["target_s"]),
        )


def fleet_rows(r: dict[str, Any]) -> Iterator[Row]:
    name = f"fleet writes, {r['agents']} agents as {r['nodes']:,} nodes (`fleet_scale.py`)"
    check = r["check"]
    yield (
        name,
        f"rows stored a second, {r['minutes']:g} min (items)",
        f"{r['stored_rows_per_s']:,.0f}/s ({r['stored_items_per_s']:,.0f}/s) of "
        f"{r['offered_rows_per_s']:,.0f}/s handed over",
        "",
        "",
    )
    yield (
        name,
        "apply of one spool item; database bytes per node-day",
        f"p50 {r['apply_ms']['p50']:.1f} ms, p99 {r['apply_ms']['p99']:.1f} ms; "
        f"{r['bytes_per_node_day'] / 2**20:,.1f} MiB",
        "",
        "",
    )
    yield (
        name,
        "nothing lost or doubled, nothing rejected",
        "; ".join(check["problems"]) or f"{check['runs']:,} runs, {check['events']:,} events",
        "every id once",
        verdict(not check["problems"]),
    )


def fidelity_rows(r: dict[str, Any]) -> Iterator[Row]:
    for row in r["rows"]:
        ratios = ", ".join(f"{ratio:.3f}" for ratio in row["ratios"])
        yield (
            f"probe fidelity, {r['rounds']} round{'s' if r['rounds'] > 1 else ''} "
            "(`probe_fidelity.py`)",
            f"{row['probe']} against {row['reference']}",
            f"median ratio {row['median_ratio']:.3f} ({ratios})",
            f">= {r['target']:g} (floor {r['floor']:g})",
            row["verdict"] if row["median_ratio"] >= r["target"] else f"**{row['verdict']}**",
        )


ROWS: dict[str, Callable[[dict[str, Any]], Iterator[Row]]] = {
    "overhead": overhead_rows,
    "sampler_1": sampler_rows,
    "sampler_8": sampler_rows,
    "scrape": scrape_rows,
    "scrape_8": scrape_rows,
    "analysis": analysis_rows,
    "ingest": ingest_rows,
    "capacity": capacity_rows,
    "fleet_scale": fleet_rows,
    "probe_fidelity": fidelity_rows,
}


def table(
    outcomes: list[Outcome], env: dict[str, str], quick: bool, load: tuple[float, float]
) -> str:
    when = datetime.datetime.now(datetime.UTC)
    mode = "`--quick` (short windows: noisier figures)" if quick else "full"
    lines = [
        f"`bench/run_all.py`, {mode}: finished {when:%Y-%m-%d %H:%M} UTC after "
        f"{sum(o.seconds for o in outcomes) / 60:.0f} minutes.",
        "",
        f"- Machine: {env['machine']}; load average (1 min) {load[0]:.2f} at the start, "
        f"{load[1]:.2f} at the end.",
        f"- Versions: {env['versions']}.",
        "",
        "| benchmark | figure | result | target | verdict |",
        "|---|---|---|---|---|",
    ]
    for outcome in outcomes:
        rows: list[Row] = []
        if outcome.result is not None:
            try:
                rows = list(ROWS[outcome.step.key](outcome.result))
            except (KeyError, TypeError, ValueError) as exc:
                outcome.problem = f"unreadable RESULT: {exc!r}"
        if outcome.problem and not rows:
            rows = [(f"`{outcome.step.script}`", outcome.step.key, outcome.problem, "", "FAILED")]
        elif outcome.problem:
            rows.append((f"`{outcome.step.script}`", "exit status", outcome.problem, "0", "FAILED"))
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write(doc: Path, results: str) -> None:
    text_now = doc.read_text() if doc.exists() else ""
    block = f"{START_MARKER}\n{results}{END_MARKER}"
    if START_MARKER in text_now and END_MARKER in text_now:
        head, rest = text_now.split(START_MARKER, 1)
        tail = rest.split(END_MARKER, 1)[1]
        doc.write_text(head + block + tail)
    else:
        doc.write_text(text_now + ("\n" if text_now else "") + block + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short windows, small archives")
    parser.add_argument("--output", type=Path, default=DOC, help="markdown file with the markers")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    args = parser.parse_args()

    env = environment()
    load_start = os.getloadavg()[0]
    outcomes = [run_step(step, args.quick) for step in STEPS]
    results = table(outcomes, env, args.quick, (load_start, os.getloadavg()[0]))
    if not args.no_write:
        write(args.output, results)
        print(f"\nwritten to {args.output}", file=sys.stderr)
    print(results)
    return 0 if all(not outcome.problem for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
