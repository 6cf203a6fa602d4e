"""Sampler cost of the NVML collector: N fake GPUs polled at 1 Hz and at 10 Hz.

Runs the real collector through the real pynvml against the fake NVML driver (tests/fakenvml,
built with gcc), with the agent's sinks (ring buffers and rollups), and reports the CPU time of
the whole process (sampler and XID threads) as % of one core. Target (issue 3): at most 2 % at
1 Hz with 8 GPUs. The fake driver's own cost is in the figure too; a real driver's calls cost
more or less, so take the result as the agent's side of the bill.

    .venv/bin/python bench/sampler.py [--gpus 8] [--seconds 30] [--rates 1 10]

The last line is `RESULT {json}` for bench/run_all.py.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fakenvml.build import build  # noqa: E402  (tests/ is put on the path just above)

from agent.telemetry.rollup import RollupBuilder  # noqa: E402
from agent.telemetry.sampler import SamplerLoop  # noqa: E402
from agent.telemetry.store import TelemetryStore  # noqa: E402
from collectors.nvml.collector import NvmlCollector  # noqa: E402


def scenario(gpus: int) -> str:
    lines = ["set driver_version 550.54.15"]
    for index in range(gpus):
        lines += [
            f'device {index} name "NVIDIA H100 80GB HBM3" uuid GPU-{index:08d}-0000-0000-0000-0000',
            f"device {index} gpm_supported 1 max_sm_clock_mhz 1980 power_limit_mw 700000",
            f"at 0 {index} sm_clock_mhz 1410 power_mw 610000 gpu_temp_c 71 reasons 0x4",
            f"at 0 {index} gpu_util_pct 100 gpm_sm_occupancy_pct 45 gpm_dram_bw_util_pct 55",
            f"process {index} {5000 + index} 1073741824 - -",
        ]
    return "\n".join(lines) + "\n"


def measure(gpus: int, rate: float, seconds: float) -> tuple[float, int, float]:
    collector = NvmlCollector()
    store = TelemetryStore(1024)
    rollups = RollupBuilder({"nvml": dict(collector.fields)}, 60, time.time())
    polls = 0

    def count(_: object) -> None:
        nonlocal polls
        polls += 1

    loop = SamplerLoop(
        collector, 1 / rate, sinks=(store.record, rollups.add, count), stall_seconds=30
    )
    collector.collect()  # start NVML and discover the GPUs outside the measured window
    cpu_start, wall_start = time.process_time(), time.monotonic()
    loop.start()
    time.sleep(seconds)
    loop.request_stop()
    loop.join(5)
    cpu, wall = time.process_time() - cpu_start, time.monotonic() - wall_start
    collector.close()
    per_poll_ms = 1000 * cpu / max(1, polls // (gpus + 1))
    return 100 * cpu / wall, polls // (gpus + 1), per_poll_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 10.0])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as work:
        library = build(Path(work) / "lib")
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        path = Path(work) / "bench.scn"
        path.write_text(scenario(args.gpus))
        os.environ["FAKENVML_SCENARIO"] = str(path)
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} cpus, "
            f"Python {platform.python_version()}; {args.gpus} fake GPUs, {args.seconds:g} s each"
        )
        print("| rate | polls | CPU, % of one core | CPU per poll (all GPUs) |")
        print("|------|-------|--------------------|-------------------------|")
        figures = []
        for rate in args.rates:
            percent, polls, per_poll = measure(args.gpus, rate, args.seconds)
            print(f"| {rate:g} Hz | {polls} | {percent:.2f} % | {per_poll:.2f} ms |")
            figures.append(
                {
                    "rate_hz": rate,
                    "polls": polls,
                    "cpu_percent": percent,
                    "cpu_per_poll_ms": per_poll,
                }
            )
    result = {"gpus": args.gpus, "seconds": args.seconds, "rates": figures}
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
