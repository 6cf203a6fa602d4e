"""Does a probe measure what the device can do? Its figure against independent references.

A probe that reports less than the device sustains would turn every later figure (steady state,
throttling, drift) into a statement about the probe. So, on this machine's CPU:

- matmul fp32: the probe's steady FLOP/s (median of the last half of its iterations, run as the
  agent runs it: `python -m workloads run`, default size, 10 s) against the best of a sweep of
  plain torch.matmul fp32 over square sizes 512..4096 measured in the same process as the bench;
- membw copy: the probe's steady copy bandwidth against numpy copying an array of the same size
  (np.copyto, counted as STREAM counts: 2 * N * 8 bytes) three ways: one thread; as many threads
  as torch uses (glibc's memcpy, which writes large copies with streaming stores); and as many
  threads with glibc's streaming stores and `rep movsb` switched off through GLIBC_TUNABLES,
  leaving a vector loop with ordinary stores, as torch's own copy kernel is (each destination
  line is read before it is written: traffic that STREAM's byte count does not include).

The machine is shared and its speed wanders: each comparison is made in several rounds, each
reference measured just before and just after its probe run, and judged on the median ratio.
Target >= 0.95, at least 0.90. Prints a markdown table with the machine and versions, and as its
last line `RESULT {json}` for bench/run_all.py.

    .venv/bin/python bench/probe_fidelity.py [--rounds 3]    # about 5 minutes with 3 rounds
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from workloads.device import cpu_model
from workloads.device import probe as probe_device
from workloads.membw import Membw

K = TypeVar("K")
T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
SWEEP = (512, 1024, 1536, 2048, 3072, 4096)
SWEEP_SECONDS = 1.5
PROBE_SECONDS = 10.0
ROUNDS = 3
COPY_SECONDS = 3.0
UNREACHABLE = 1 << 40
"""A glibc copy threshold no copy here reaches (glibc ignores values near 2**63)."""
TARGET = 0.95
FLOOR = 0.90


def steady(values: list[float]) -> float:
    """Median of the last half: a crude steady state, enough until the agent's analysis exists."""
    return statistics.median(values[len(values) // 2 :])


def timed_series(work: Callable[[], object], seconds: float) -> list[float]:
    """Durations of repeated calls for about `seconds`, after one untimed warm-up call."""
    work()
    durations: list[float] = []
    began = time.perf_counter()
    while time.perf_counter() - began < seconds or len(durations) < 3:
        start = time.perf_counter()
        work()
        durations.append(time.perf_counter() - start)
    return durations


def matmul_sweep() -> dict[int, float]:
    """Steady FLOP/s of plain torch.matmul fp32 per square size."""
    figures: dict[int, float] = {}
    for n in SWEEP:
        a = torch.randn(n, n)
        b = torch.randn(n, n)
        durations = timed_series(partial(torch.matmul, a, b), SWEEP_SECONDS)
        figures[n] = steady([2 * n**3 / d for d in durations])
    return figures


def around(
    measure: Callable[[], dict[K, float]], probe: Callable[[], T]
) -> tuple[dict[K, float], T]:
    """References measured before and after the probe, averaged.

    The machine is shared and its speed wanders by 10-20 % over a minute; a reference taken on
    one side of the probe only would compare two different moments.
    """
    before = measure()
    result = probe()
    after = measure()
    return {key: (before[key] + after[key]) / 2 for key in before}, result


def run_probe(workload: str, precision: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the real child process, as the agent will; return its manifest and iterations."""
    command = [
        sys.executable,
        "-m",
        "workloads",
        "run",
        f"--workload={workload}",
        f"--precision={precision}",
        "--device=cpu",
        f"--duration={PROBE_SECONDS}",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    manifest = lines[0]
    if manifest["event"] != "manifest":
        raise SystemExit(f"{workload} {precision}: {manifest}")
    return manifest, [line for line in lines if line["event"] == "iteration"]


def rates(iterations: list[dict[str, Any]], phase: str | None = None) -> list[float]:
    return [i["work"] / (i["end"] - i["start"]) for i in iterations if i.get("phase") == phase]


def numpy_copy(array_bytes: int, threads: int) -> float:
    """Steady bandwidth of np.copyto between two float64 arrays, split over `threads`."""
    n = array_bytes // 8
    source = np.ones(n)
    target = np.zeros(n)
    chunks = [slice(i * n // threads, (i + 1) * n // threads) for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:

        def copy() -> None:
            # np.copyto releases the GIL, so the chunks are copied in parallel.
            for _ in pool.map(lambda part: np.copyto(target[part], source[part]), chunks):
                pass

        durations = timed_series(copy, COPY_SECONDS)
    return steady([2 * n * 8 / d for d in durations])


def copy_reference(array_bytes: int, threads: int, *, ordinary_stores: bool = False) -> float:
    """numpy_copy in a fresh process: its own memory, and glibc tunables of its own.

    np.copyto is glibc's memcpy. For large copies it writes with non-temporal (streaming) stores,
    and for medium ones with `rep movsb`, both of which spare the memory system the
    write-allocate read of each destination line; torch's CPU copy kernel is a vector loop with
    ordinary stores, which pays it. Raising both glibc thresholds out of reach leaves memcpy's own
    vector loop with ordinary stores: the like-for-like reference.
    """
    env = dict(os.environ)
    if ordinary_stores:
        env["GLIBC_TUNABLES"] = (
            f"glibc.cpu.x86_non_temporal_threshold={UNREACHABLE:#x}"
            f":glibc.cpu.x86_rep_movsb_threshold={UNREACHABLE:#x}"
        )
    command = [sys.executable, __file__, "--copy-reference", str(array_bytes), str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return float(done.stdout)


def verdict(ratio: float) -> str:
    if ratio >= TARGET:
        return "meets target"
    return "below target, above floor" if ratio >= FLOOR else "BELOW FLOOR"


@dataclass(frozen=True, slots=True)
class Round:
    """One probe run with its references measured around it."""

    probe: float
    references: dict[str, float]
    manifest: dict[str, Any]
    iterations: list[dict[str, Any]]
    sweep: dict[int, float] | None = None


def matmul_round() -> Round:
    sweep, (manifest, iterations) = around(matmul_sweep, partial(run_probe, "matmul", "fp32"))
    best = max(sweep, key=lambda n: sweep[n])
    name = f"best of a torch.matmul fp32 sweep, n in {SWEEP[0]}..{SWEEP[-1]}"
    return Round(steady(rates(iterations)), {name: sweep[best]}, manifest, iterations, sweep)


def membw_round(array_bytes: int, threads: int) -> Round:
    def references() -> dict[str, float]:
        return {
            "np.copyto, 1 thread": copy_reference(array_bytes, 1),
            f"np.copyto, {threads} threads (glibc memcpy: streaming stores)": copy_reference(
                array_bytes, threads
            ),
            f"np.copyto, {threads} threads, ordinary stores (like for like)": copy_reference(
                array_bytes, threads, ordinary_stores=True
            ),
        }

    figures, (manifest, iterations) = around(references, partial(run_probe, "membw", "fp32"))
    if manifest["parameters"]["array_bytes"] != array_bytes:
        raise SystemExit(f"the membw probe used other arrays: {manifest['parameters']}")
    return Round(steady(rates(iterations, "copy")), figures, manifest, iterations)


def report(title: str, unit: tuple[str, float], rounds: list[Round]) -> list[dict[str, Any]]:
    """One row per reference: every round's ratio, and the verdict on their median."""
    symbol, scale = unit
    rows: list[dict[str, Any]] = []
    for name in rounds[0].references:
        ratios = [r.probe / r.references[name] for r in rounds]
        median = statistics.median(ratios)
        probes = ", ".join(f"{r.probe / scale:.1f}" for r in rounds)
        figures = ", ".join(f"{r.references[name] / scale:.1f}" for r in rounds)
        print(
            f"| {title} | {probes} {symbol} | {name} | {figures} {symbol} "
            f"| {', '.join(f'{x:.3f}' for x in ratios)} | **{median:.3f}** | {verdict(median)} |"
        )
        rows.append(
            {
                "probe": title,
                "reference": name,
                "probe_steady": [r.probe for r in rounds],
                "reference_figures": [r.references[name] for r in rounds],
                "unit": symbol,
                "ratios": ratios,
                "median_ratio": median,
                "verdict": verdict(median),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="probe runs of each workload")
    rounds = parser.parse_args().rounds
    threads = torch.get_num_threads()
    load_before = os.getloadavg()[0]
    matmul = [matmul_round() for _ in range(rounds)]
    # The probe's array size, by the rule the probe applies (checked against its manifest).
    array_bytes = Membw.array_bytes(probe_device("cpu"))
    membw = [membw_round(array_bytes, threads) for _ in range(rounds)]

    side = matmul[0].manifest["parameters"]["m"]
    cache = membw[0].manifest["parameters"]["cache_bytes"]
    print(f"# Probe fidelity, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n")
    print(
        f"Machine: {cpu_model()}, {threads} torch threads, last-level cache "
        f"{cache / 2**20:.0f} MiB, {' '.join(platform.libc_ver())}. "
        f"Python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}. "
        f"Load average (1 min) {load_before:.2f} at the start, {os.getloadavg()[0]:.2f} at the "
        f"end. {rounds} rounds, each a {PROBE_SECONDS:.0f} s probe run with its references "
        "measured just before and just after it (averaged); the verdict is on the median ratio.\n"
    )
    print("| probe | probe steady | reference | reference | ratio | median | verdict |")
    print("|---|---|---|---|---|---|---|")
    rows = report(f"matmul fp32 {side}^3", ("GFLOP/s", 1e9), matmul)
    rows += report(f"membw copy, {array_bytes / 2**20:.0f} MiB arrays", ("GB/s", 1e9), membw)
    for index, r in enumerate(matmul, 1):
        assert r.sweep is not None
        figures = ", ".join(f"{n}: {f / 1e9:.1f}" for n, f in r.sweep.items())
        print(f"\nmatmul sweep, round {index} (GFLOP/s): {figures}")
    triad = ", ".join(f"{steady(rates(r.iterations, 'triad')) / 1e9:.1f}" for r in membw)
    print(f"\nmembw triad, per round: {triad} GB/s")
    result = {
        "rounds": rounds,
        "torch_threads": threads,
        "target": TARGET,
        "floor": FLOOR,
        "load_average": [load_before, os.getloadavg()[0]],
        "rows": rows,
    }
    print("RESULT " + json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--copy-reference"]:
        print(numpy_copy(int(sys.argv[2]), int(sys.argv[3])))
    else:
        main()
