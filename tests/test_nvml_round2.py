"""The NVML defects of issue 25, each shown on the fake driver through real pynvml bindings: the
nvidia-ml-py floor (the oldest release pyproject allows, and older ones, installed for real and
run in a subprocess), a field value the driver does not know, GPM of MIG instances, the unknown
P-state, and PCIe throughput (its unit and the 20 ms each call blocks).
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pynvml
import pytest
from conftest import FakeGpus

from collectors.base import Sample
from collectors.nvml.collector import FULL_READ_SECONDS, NvmlCollector
from collectors.nvml.xid import handle_key

Scenario = Callable[[str, float], tuple[FakeGpus, NvmlCollector]]
ROOT = Path(__file__).parent.parent
SCENARIOS = Path(__file__).parent / "fakenvml" / "scenarios"
BINDINGS = ROOT / ".venv" / "nvml-bindings"  # nvidia-ml-py releases, one directory each
MIG_A = "MIG-11111111-1111-4111-8111-111111111111"
MIG_B = "MIG-22222222-2222-4222-8222-222222222222"
MIG_C = "MIG-33333333-3333-4333-8333-333333333333"


def floor_version() -> str:
    """The oldest nvidia-ml-py pyproject.toml allows: its ``>=`` bound, a release to install."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (requirement,) = [d for d in project["dependencies"] if d.startswith("nvidia-ml-py")]
    found = re.fullmatch(r"nvidia-ml-py>=([0-9.]+)", requirement.replace(" ", ""))
    assert found, f"the nvidia-ml-py requirement has no floor: {requirement}"
    return found.group(1)


def installed_binding(version: str) -> Path:
    """nvidia-ml-py ``version`` installed with the venv's pip into a directory of its own (once:
    kept under .venv/nvml-bindings; workers racing to install it keep the first)."""
    target = BINDINGS / version
    if (target / "pynvml.py").is_file():
        return target
    BINDINGS.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=BINDINGS, prefix=f".{version}-"))
    staging.chmod(0o755)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    done = subprocess.run(
        [*pip, "--no-deps", "--target", str(staging), f"nvidia-ml-py=={version}"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        pytest.fail(f"pip could not install nvidia-ml-py=={version}:\n{done.stderr}")
    try:
        staging.rename(target)
    except OSError:  # another worker installed it first
        shutil.rmtree(staging, ignore_errors=True)
    return target


@pytest.fixture(scope="session")
def binding() -> Callable[[str], Path]:
    return functools.cache(installed_binding)


POLL_AND_REPORT = """
import json, logging, time
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
import importlib.metadata, pynvml
from collectors.nvml.collector import NvmlCollector
collector = NvmlCollector()
polls = []
for _ in range(3):
    polls.append([
        {"device": s.device, "errors": list(s.errors),
         "readings": [[r.field, dict(r.labels), r.value] for r in s.readings]}
        for s in collector.collect()
    ])
    time.sleep(0.55)  # past FULL_READ_SECONDS: every poll reads the slow fields too
collector.close()
version = importlib.metadata.version("nvidia-ml-py")
print(json.dumps({"pynvml": pynvml.__file__, "version": version, "polls": polls}))
"""


def run_on_binding(binding: Path, fake_nvml: Path) -> tuple[dict[str, Any], str]:
    """The collector, three polls of mig_node.scn in a subprocess whose pynvml is ``binding``'s
    (first on sys.path); its report and its log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML"))}
    env["PYTHONPATH"] = os.pathsep.join((str(binding), str(ROOT)))
    env["LD_LIBRARY_PATH"] = str(fake_nvml.parent)
    env["FAKENVML_SCENARIO"] = str(SCENARIOS / "mig_node.scn")
    done = subprocess.run(
        [sys.executable, "-c", POLL_AND_REPORT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    assert Path(report["pynvml"]).parent == binding
    return report, done.stderr


def gpu_polls(report: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every sample of a whole GPU in every poll."""
    for poll in report["polls"]:
        yield from (sample for sample in poll if sample["device"].startswith("GPU-"))


def readings(sample: dict[str, Any], key: str) -> list[tuple[dict[str, str], float]]:
    return [(labels, value) for field, labels, value in sample["readings"] if field == key]


def readings_by(sample: dict[str, Any], key: str, label: str) -> list[tuple[str, float]]:
    return [(labels[label], value) for labels, value in readings(sample, key)]


def test_the_collector_runs_on_the_oldest_nvidia_ml_py_the_floor_allows(
    binding: Callable[[str], Path], fake_nvml: Path
) -> None:
    """Acceptance: the floor of pyproject.toml installed for real; both GPUs found and every poll
    complete (temperature through nvmlDeviceGetTemperatureV, the NUMA node, MIG, GPM), no error,
    and nothing it lacks."""
    version = floor_version()
    report, log = run_on_binding(binding(version), fake_nvml)
    assert report["version"] == version
    samples = list(gpu_polls(report))
    assert len(samples) == 2 * 3  # both GPUs found, every poll done
    for sample in samples:
        assert sample["errors"] == []
        assert [value for _, value in readings(sample, "gpu_healthy")] == [1.0]
        temperatures = dict(readings_by(sample, "gpu_temperature_celsius", "sensor"))
        assert temperatures["gpu"] in {54.0, 61.0}
        (topology,) = readings(sample, "gpu_topology_info")
        assert topology[0]["numa_node"] == topology[0]["cpu_affinity"]  # mig_node.scn: 0, 1
    last = {sample["device"]: sample for sample in report["polls"][-1]}
    for mig in (MIG_A, MIG_B):
        (occupancy,) = readings(last[mig], "gpu_mig_sm_occupancy_ratio")
        assert occupancy[1] == pytest.approx(0.31)
    assert "lacks" not in log, log


@pytest.mark.parametrize(
    ("version", "lacking"),
    [
        ("12.560.30", ["nvmlDeviceGetTemperatureV"]),
        ("12.535.161", ["nvmlDeviceGetTemperatureV", "nvmlDeviceGetNumaNodeId"]),
    ],
)
def test_an_older_nvidia_ml_py_degrades_like_an_older_driver(
    binding: Callable[[str], Path], fake_nvml: Path, version: str, lacking: list[str]
) -> None:
    """Below the floor: a function the bindings lack is logged once and its field is absent or
    read by the fallback (nvmlDeviceGetTemperature), never a failed poll; 12.535 also lacks the
    NVML_VALUE_TYPE_UNSIGNED_SHORT constant the collector's module once needed to import."""
    report, log = run_on_binding(binding(version), fake_nvml)
    assert report["version"] == version
    samples = list(gpu_polls(report))
    assert len(samples) == 2 * 3  # both GPUs found, every poll done
    for sample in samples:
        assert sample["errors"] == []
        temperatures = dict(readings_by(sample, "gpu_temperature_celsius", "sensor"))
        assert temperatures["gpu"] in {54.0, 61.0}  # the fallback's reading
        (topology,) = readings(sample, "gpu_topology_info")
        assert topology[0]["cpu_affinity"] in {"0", "1"}
        if "nvmlDeviceGetNumaNodeId" in lacking:
            assert topology[0]["numa_node"] == ""  # as on a driver without the function
        else:
            assert topology[0]["numa_node"] == topology[0]["cpu_affinity"]
    for name in lacking:
        assert log.count(f"nvidia-ml-py {version} lacks {name}") == 1, log
    assert log.count("lacks") == len(lacking), log


def by_device(samples: Sequence[Sample], key: str) -> dict[str, list[float]]:
    """The values of ``key`` in each sample, by the sample's device (a GPU or MIG UUID)."""
    return {
        sample.device: [r.value for r in sample.readings if r.field == key]
        for sample in samples
        if sample.device != "system"
    }


def counting(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> list[tuple[int | None, tuple[Any, ...]]]:
    """Every call of pynvml's ``name`` from now on, as (handle key, other arguments); the real
    function still answers (the collector looks it up on the module at each call)."""
    real = getattr(pynvml, name)
    calls: list[tuple[int | None, tuple[Any, ...]]] = []

    @functools.wraps(real)
    def spy(handle: Any, *args: Any) -> Any:
        calls.append((handle_key(handle), args))
        return real(handle, *args)

    monkeypatch.setattr(pynvml, name, spy)
    return calls


def gpu_keys(count: int) -> list[int | None]:
    """The handle keys of GPUs 0..count-1 (NVML is started by the collector under test)."""
    return [handle_key(pynvml.nvmlDeviceGetHandleByIndex(index)) for index in range(count)]


class SteppedClock:
    """The collector's clock, moved by the test: its polls happen at exactly the times the test
    says, however loaded the machine (the fake's values here do not change over time)."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


Stepped = Callable[[str], tuple[SteppedClock, NvmlCollector]]


@pytest.fixture
def stepped(scenario: Scenario) -> Iterator[Stepped]:
    """Start a scenario and a collector on a ``SteppedClock``; closed after the test."""
    collectors: list[NvmlCollector] = []

    def start(text: str) -> tuple[SteppedClock, NvmlCollector]:
        scenario(text, 1.0)  # the fake's scenario (the fixture's own collector stays unused)
        clock = SteppedClock()
        collectors.append(NvmlCollector(clock=clock))
        return clock, collectors[-1]

    yield start
    for collector in collectors:
        collector.close()


def test_a_field_the_driver_does_not_know_is_asked_once_and_never_counted(
    stepped: Stepped, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 8: GPU 0's driver answers NVML_ERROR_INVALID_ARGUMENT for the power fields 185 and
    186 (as drivers older than those fields do). Over 20 polls: no error counted, one log line
    per field, the fields not asked again after the first poll, the power gauge from
    nvmlDeviceGetPowerUsage; GPU 1 keeps both fields."""
    text = (
        "device 0 power_mw 612000 power_average_mw 401000\n"
        "device 1 power_mw 612000 power_average_mw 401000\n"
        "fault 0 invalid_argument field:185 - -\n"
        "fault 0 invalid_argument field:186 - -\n"
    )
    clock, collector = stepped(text)
    calls = counting(monkeypatch, "nvmlDeviceGetFieldValues")
    caplog.set_level(logging.INFO, logger="collectors.nvml.collector")
    errors: Counter[str] = Counter()
    polls = []
    for _ in range(20):
        clock.now += 0.2
        polls.append(collector.collect())
        errors.update(kind for sample in polls[-1] for kind in sample.errors)
    gpu0, gpu1 = gpu_keys(2)
    assert errors == Counter()
    asked = [ids for key, (ids,) in calls if key == gpu0]
    assert len(asked) == 20
    assert {185, 186} <= set(asked[0])
    assert all(not {185, 186} & set(ids) for ids in asked[1:])
    assert all({185, 186} <= set(ids) for key, (ids,) in calls if key == gpu1)
    unknown = [r for r in caplog.records if "does not know field" in r.getMessage()]
    assert len(unknown) == 2
    assert {r.args[2] for r in unknown if isinstance(r.args, tuple)} == {185, 186}
    power = by_device(polls[-1], "gpu_power_watts")
    average = by_device(polls[-1], "gpu_power_average_watts")
    uuid0, uuid1 = (s.device for s in polls[-1] if s.device != "system")
    assert power == {uuid0: [401.0], uuid1: [612.0]}  # GPU 0: nvmlDeviceGetPowerUsage
    assert average == {uuid0: [], uuid1: [401.0]}


def test_the_fake_answers_invalid_argument_for_a_field_fault(
    scenario: Scenario,
) -> None:
    """The fake's new fault kind, through pynvml: the entry's nvmlReturn, the call succeeding."""
    _, collector = scenario("device 0\nfault 0 invalid_argument field:82 - -\n", 1.0)
    collector.collect()
    values = pynvml.nvmlDeviceGetFieldValues(pynvml.nvmlDeviceGetHandleByIndex(0), [82, 74])
    assert [value.nvmlReturn for value in values] == [pynvml.NVML_ERROR_INVALID_ARGUMENT, 0]


MIG_GPU = """
device 0 mig_mode 1
device 0 gpm_sm_occupancy_pct 40 gpm_dram_bw_util_pct 25 gpm_tensor_util_pct 10
mig 0 1 0 {a} 42949672960
"""


def two_slow_polls(clock: SteppedClock, collector: NvmlCollector) -> Sequence[Sample]:
    """Two polls FULL_READ_SECONDS apart: the second has GPM (the metrics need two samples)."""
    collector.collect()
    clock.now += FULL_READ_SECONDS
    return collector.collect()


def test_mig_gpm_support_is_the_gpus_answer_not_its_own_sampling(stepped: Stepped) -> None:
    """Item 3: the GPU says it supports GPM (nvmlGpmQueryDeviceSupport) but, in MIG mode, its
    own nvmlGpmSampleGet answers NOT_SUPPORTED; its GPU instances' nvmlGpmMigSampleGet answer.
    The instances keep their GPM: their support is not a copy of the GPU's sampling outcome."""
    text = (
        MIG_GPU.format(a=MIG_A)
        + f"mig 0 2 0 {MIG_B} 42949672960\n"
        + "fault 0 unsupported nvmlGpmSampleGet - -\n"
    )
    samples = two_slow_polls(*stepped(text))
    occupancy = by_device(samples, "gpu_mig_sm_occupancy_ratio")
    assert occupancy[MIG_A] == [pytest.approx(0.4)]
    assert occupancy[MIG_B] == [pytest.approx(0.4)]
    (gpu,) = [s.device for s in samples if s.device.startswith("GPU-")]
    assert by_device(samples, "gpu_sm_occupancy_ratio")[gpu] == []
    assert [kind for sample in samples for kind in sample.errors] == []


def test_gpm_of_a_gpu_instance_is_exported_once_not_per_compute_instance(
    stepped: Stepped, fake_nvml: Path
) -> None:
    """Item 3: GPU instance 1 has two compute instances (MIG devices A and B), GPU instance 2
    one (C). GPM samples a GPU instance whole, so its ratios are exported once, on A (its lowest
    compute instance), not on B too: a sum over MIG devices counts each instance once."""
    text = (
        MIG_GPU.format(a=MIG_A)
        + f"mig 0 1 1 {MIG_B} 42949672960\n"
        + f"mig 0 2 0 {MIG_C} 42949672960\n"
    )
    clock, collector = stepped(text)
    outstanding = ctypes.CDLL(str(fake_nvml)).fakenvml_gpm_samples_outstanding
    samples = two_slow_polls(clock, collector)
    for key, ratio in (
        ("gpu_mig_sm_occupancy_ratio", 0.4),
        ("gpu_mig_dram_bandwidth_utilization_ratio", 0.25),
        ("gpu_mig_tensor_activity_ratio", 0.1),
    ):
        values = by_device(samples, key)
        assert {mig: values[mig] for mig in (MIG_A, MIG_B, MIG_C)} == {
            MIG_A: [pytest.approx(ratio)],
            MIG_B: [],
            MIG_C: [pytest.approx(ratio)],
        }, key
    assert by_device(samples, "gpu_mig_memory_total_bytes")[MIG_B] == [42949672960]
    assert outstanding() == 3  # one kept per stream: the GPU's and its two GPU instances'
    collector.close()
    assert outstanding() == 0


def test_an_unknown_performance_state_is_absent(scenario: Scenario) -> None:
    """Item 4: NVML_PSTATE_UNKNOWN (32) is no P-state: absent, not exported as 32."""
    _, collector = scenario("device 0 pstate 32\ndevice 1 pstate 2\n", 1.0)
    states = by_device(collector.collect(), "gpu_performance_state")
    assert sorted(states.values()) == [[], [2.0]]


def test_pcie_throughput_kilobytes_are_1000_bytes(scenario: Scenario) -> None:
    """Item 5: nvmlDeviceGetPcieThroughput answers KB/s (nvml.h), 1000 bytes a second each."""
    _, collector = scenario("device 0 pcie_tx_kbps 1000 pcie_rx_kbps 2500\n", 1.0)
    (gpu,) = [s for s in collector.collect() if s.device != "system"]
    throughput = {
        dict(r.labels)["direction"]: r.value
        for r in gpu.readings
        if r.field == "gpu_pcie_throughput_bytes_per_second"
    }
    assert throughput == {"tx": 1_000_000.0, "rx": 2_500_000.0}


def test_pcie_throughput_is_read_on_staggered_turns_not_all_gpus_at_once(
    stepped: Stepped, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 5: each call blocks 20 ms on a real GPU (two per GPU: 320 ms for 8). Sampled at
    10 Hz for 3 s on 8 GPUs: the first poll reads every GPU; after it no poll reads more than
    two GPUs' throughput (at HEAD every slow read, every 0.5 s, read all eight at once), each GPU
    is read about once a second, and every poll still carries every GPU's two values."""
    clock, collector = stepped("".join(f"device {d} pcie_tx_kbps 7\n" for d in range(8)))
    calls = counting(monkeypatch, "nvmlDeviceGetPcieThroughput")
    per_poll = []
    first: dict[str, list[float]] = {}
    for step in range(31):
        clock.now += 0.1 if step else 0.0
        before = len(calls)
        throughput = by_device(collector.collect(), "gpu_pcie_throughput_bytes_per_second")
        per_poll.append(calls[before:])
        first = first or throughput
        assert throughput == first
    assert sorted(map(len, first.values())) == [2] * 8
    assert len(per_poll[0]) == 16
    assert max(len(poll) for poll in per_poll[1:]) <= 4
    reads = Counter(key for poll in per_poll[1:] for key, _ in poll)
    assert set(reads) == set(gpu_keys(8))
    assert all(2 * 2 <= count <= 3 * 2 for count in reads.values()), reads
