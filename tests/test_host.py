"""HostCollector against the fixture tree in tests/fixtures/host, copies of it edited between two
polls, and once against this machine's own /proc and /sys."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectors.base import CollectorError, Sample
from collectors.host import FIELDS, CpuTimes, HostCollector, utilization

FIXTURE = Path(__file__).parent / "fixtures" / "host"
POWERCAP = Path("class") / "powercap"
NOBODY = 65534

# The fixture's /proc/stat cpu lines:
# user nice system idle iowait irq softirq steal guest guest_nice.
STAT_CPU = {
    "cpu": [10000, 200, 3000, 80000, 1000, 100, 200, 50, 400, 0],
    "cpu0": [2600, 50, 700, 20100, 300, 20, 60, 10, 100, 0],
    "cpu1": [2400, 60, 800, 19900, 200, 30, 40, 15, 100, 0],
    "cpu2": [2500, 40, 750, 20000, 250, 25, 50, 12, 100, 0],
    "cpu3": [2500, 50, 750, 20000, 250, 25, 50, 13, 100, 0],
}


def values(sample: Sample, key: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {reading.labels: reading.value for reading in sample.readings if reading.field == key}


def value(sample: Sample, key: str) -> float:
    found = values(sample, key)
    assert list(found) == [()], f"{key}: {found}"
    return found[()]


def poll(collector: HostCollector) -> Sample:
    samples = collector.collect()
    assert len(samples) == 1
    return samples[0]


def write_stat(proc: Path, rows: dict[str, list[int]]) -> None:
    """Rewrite the cpu lines of a copied /proc/stat, keeping the lines that follow them."""
    stat = proc / "stat"
    others = [line for line in stat.read_text().splitlines() if not line.startswith("cpu")]
    cpu_lines = [
        f"{name}{' ' if name == 'cpu' else ''} {' '.join(map(str, row))}"
        for name, row in rows.items()
    ]
    stat.write_text("\n".join(cpu_lines + others) + "\n")


def advanced(row: list[int], delta: list[int]) -> list[int]:
    return [a + b for a, b in zip(row, delta, strict=True)]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A private copy of the fixture tree that a test may edit between polls."""
    shutil.copytree(FIXTURE, tmp_path / "host")
    return tmp_path / "host"


def collector_for(root: Path) -> HostCollector:
    return HostCollector(procfs=root / "proc", sysfs=root / "sys")


def test_fields_are_keyed_and_named() -> None:
    collector = collector_for(FIXTURE)
    assert collector.name == "host"
    names = {key: field.metric_name for key, field in collector.fields.items()}
    assert names == {
        "cpu_utilization_ratio": "sustain_cpu_utilization_ratio",
        "cpu_core_utilization_ratio": "sustain_cpu_core_utilization_ratio",
        "cpu_frequency_hertz": "sustain_cpu_frequency_hertz",
        "cpu_frequency_max_hertz": "sustain_cpu_frequency_max_hertz",
        "memory_total_bytes": "sustain_memory_total_bytes",
        "memory_available_bytes": "sustain_memory_available_bytes",
        "memory_used_bytes": "sustain_memory_used_bytes",
        "load1": "sustain_load1",
        "load5": "sustain_load5",
        "load15": "sustain_load15",
        "temperature_celsius": "sustain_temperature_celsius",
        "rapl_energy_joules_total": "sustain_rapl_energy_joules_total",
    }
    assert all(key == field.key for key, field in collector.fields.items())
    assert collector.fields["rapl_energy_joules_total"].kind == "counter"
    assert collector.fields["temperature_celsius"].labels == ("chip", "sensor")
    assert collector.fields["load1"].help == "1-minute load average."


def test_first_poll_has_no_utilization_and_no_errors() -> None:
    sample = poll(collector_for(FIXTURE))
    assert (sample.collector, sample.device, sample.errors) == ("host", "host", ())
    assert values(sample, "cpu_utilization_ratio") == {}
    assert values(sample, "cpu_core_utilization_ratio") == {}


def test_utilization_from_two_snapshots_does_not_count_guest_twice(tree: Path) -> None:
    collector = collector_for(tree)
    poll(collector)
    # user +600 (of which guest +300), system +200, idle +1000, iowait +100, softirq +50,
    # steal +50: total 2000 jiffies, busy 2000 - 1000 - 100 = 900.
    rows = dict(STAT_CPU)
    rows["cpu"] = advanced(STAT_CPU["cpu"], [600, 0, 200, 1000, 100, 0, 50, 50, 300, 0])
    write_stat(tree / "proc", rows)
    assert value(poll(collector), "cpu_utilization_ratio") == pytest.approx(900 / 2000)


def test_per_core_utilization(tree: Path) -> None:
    collector = collector_for(tree)
    poll(collector)
    rows = {
        "cpu": advanced(STAT_CPU["cpu"], [1000, 0, 0, 1000, 0, 0, 0, 0, 0, 0]),
        # cpu0 fully busy: 400 user + 100 system.
        "cpu0": advanced(STAT_CPU["cpu0"], [400, 0, 100, 0, 0, 0, 0, 0, 0, 0]),
        # cpu1: 100 busy (nice 50, irq 50), 300 idle, 100 iowait -> 100 / 500.
        "cpu1": advanced(STAT_CPU["cpu1"], [0, 50, 0, 300, 100, 50, 0, 0, 0, 0]),
        # cpu2 idle throughout.
        "cpu2": advanced(STAT_CPU["cpu2"], [0, 0, 0, 500, 0, 0, 0, 0, 0, 0]),
        # cpu3 did not advance at all (offline, say): no ratio.
        "cpu3": STAT_CPU["cpu3"],
    }
    write_stat(tree / "proc", rows)
    sample = poll(collector)
    assert values(sample, "cpu_core_utilization_ratio") == {
        (("cpu", "0"),): pytest.approx(1.0),
        (("cpu", "1"),): pytest.approx(100 / 500),
        (("cpu", "2"),): pytest.approx(0.0),
    }
    assert value(sample, "cpu_utilization_ratio") == pytest.approx(0.5)


def test_utilization_absent_when_no_time_passed() -> None:
    collector = collector_for(FIXTURE)
    poll(collector)
    sample = poll(collector)
    assert values(sample, "cpu_utilization_ratio") == {}
    assert values(sample, "cpu_core_utilization_ratio") == {}


@given(
    before=st.lists(st.integers(0, 10**12), min_size=8, max_size=10),
    delta=st.lists(st.integers(-(10**6), 10**9), min_size=10, max_size=10),
)
def test_utilization_is_a_ratio_whatever_the_counters_do(
    before: list[int], delta: list[int]
) -> None:
    # iowait may step backwards on tickless kernels; the ratio must still stay within 0-1.
    after = [a + b for a, b in zip(before, delta, strict=False)]

    def times(row: list[int]) -> CpuTimes:
        total = sum(row[:8])
        return CpuTimes(busy=total - row[3] - row[4], total=total)

    ratio = utilization(times(before), times(after))
    if times(after).total <= times(before).total:
        assert ratio is None
    else:
        assert ratio is not None
        assert 0.0 <= ratio <= 1.0


def test_frequency_from_cpufreq_in_hertz() -> None:
    sample = poll(collector_for(FIXTURE))
    assert values(sample, "cpu_frequency_hertz") == {
        (("cpu", "0"),): 3.4e9,
        (("cpu", "1"),): 1.2e9,
        (("cpu", "2"),): 4.1e9,
        (("cpu", "3"),): 0.8e9,
    }
    assert values(sample, "cpu_frequency_max_hertz") == {
        (("cpu", str(cpu)),): 4.2e9 for cpu in range(4)
    }


def test_frequency_falls_back_to_cpuinfo_without_cpufreq(tree: Path) -> None:
    for cpu in range(4):
        shutil.rmtree(tree / "sys" / "devices" / "system" / "cpu" / f"cpu{cpu}" / "cpufreq")
    sample = poll(collector_for(tree))
    assert values(sample, "cpu_frequency_hertz") == {
        (("cpu", "0"),): pytest.approx(3399.998e6),
        (("cpu", "1"),): pytest.approx(1200.102e6),
        (("cpu", "2"),): pytest.approx(4100.004e6),
        (("cpu", "3"),): pytest.approx(799.960e6),
    }
    assert values(sample, "cpu_frequency_max_hertz") == {}
    assert sample.errors == ()


def test_frequency_absent_without_cpufreq_or_cpuinfo(tree: Path) -> None:
    shutil.rmtree(tree / "sys" / "devices")
    (tree / "proc" / "cpuinfo").unlink()
    sample = poll(collector_for(tree))
    assert values(sample, "cpu_frequency_hertz") == {}
    assert sample.errors == ()


def test_memory_in_bytes() -> None:
    sample = poll(collector_for(FIXTURE))
    assert value(sample, "memory_total_bytes") == 32594180 * 1024
    assert value(sample, "memory_available_bytes") == 21466352 * 1024
    assert value(sample, "memory_used_bytes") == (32594180 - 21466352) * 1024


def test_memory_is_read_by_psutil_under_the_collectors_procfs_root(tree: Path) -> None:
    collector = collector_for(tree)
    assert str(tree / "proc") == psutil.PROCFS_PATH  # one process, one procfs root
    meminfo = tree / "proc" / "meminfo"
    meminfo.write_text(meminfo.read_text().replace("21466352 kB", "1048576 kB"))
    sample = poll(collector)
    assert value(sample, "memory_available_bytes") == 1048576 * 1024
    assert value(sample, "memory_used_bytes") == (32594180 - 1048576) * 1024


def test_memory_without_memavailable_is_estimated(tree: Path) -> None:
    # Kernels before 3.14 have no MemAvailable; psutil estimates it as free(1) does.
    meminfo = tree / "proc" / "meminfo"
    lines = meminfo.read_text().splitlines(keepends=True)
    meminfo.write_text("".join(line for line in lines if not line.startswith("MemAvailable:")))
    sample = poll(collector_for(tree))
    total = value(sample, "memory_total_bytes")
    available = value(sample, "memory_available_bytes")
    assert 9812344 * 1024 <= available <= total  # at least MemFree
    assert value(sample, "memory_used_bytes") == total - available
    assert sample.errors == ()


def test_unparsable_meminfo_is_counted(tree: Path) -> None:
    (tree / "proc" / "meminfo").write_text("MemTotal: lots kB\n")
    sample = poll(collector_for(tree))
    assert values(sample, "memory_total_bytes") == {}
    assert sample.errors == ("parse",)
    assert values(sample, "load1")


def test_load_averages() -> None:
    sample = poll(collector_for(FIXTURE))
    assert (value(sample, "load1"), value(sample, "load5"), value(sample, "load15")) == (
        1.52,
        0.87,
        0.45,
    )


def test_temperatures_in_celsius_with_chip_and_sensor() -> None:
    sample = poll(collector_for(FIXTURE))
    assert values(sample, "temperature_celsius") == {
        (("chip", "coretemp"), ("sensor", "Package id 0")): 48.0,
        (("chip", "coretemp"), ("sensor", "Core 0")): 45.0,
        (("chip", "nvme"), ("sensor", "temp1")): 38.85,
        (("chip", "thermal_zone0"), ("sensor", "x86_pkg_temp")): 49.0,
    }


def test_duplicate_chip_names_are_made_unique(tree: Path) -> None:
    hwmon = tree / "sys" / "class" / "hwmon"
    shutil.copytree(hwmon / "hwmon0", hwmon / "hwmon3")  # a second socket
    (hwmon / "hwmon3" / "temp1_input").write_text("51000\n")
    # A chip that labels two sensors alike keeps both, the second under its file name.
    (hwmon / "hwmon1" / "temp2_input").write_text("40000\n")
    (hwmon / "hwmon1" / "temp1_label").write_text("Composite\n")
    (hwmon / "hwmon1" / "temp2_label").write_text("Composite\n")
    temperatures = values(poll(collector_for(tree)), "temperature_celsius")
    assert temperatures == {
        (("chip", "coretemp"), ("sensor", "Package id 0")): 48.0,
        (("chip", "coretemp"), ("sensor", "Core 0")): 45.0,
        (("chip", "nvme"), ("sensor", "Composite")): 38.85,
        (("chip", "nvme"), ("sensor", "Composite.temp2")): 40.0,
        (("chip", "coretemp.hwmon3"), ("sensor", "Package id 0")): 51.0,
        (("chip", "coretemp.hwmon3"), ("sensor", "Core 0")): 45.0,
        (("chip", "thermal_zone0"), ("sensor", "x86_pkg_temp")): 49.0,
    }


def test_unreadable_temperature_is_absent_and_counted(tree: Path) -> None:
    collector = collector_for(tree)
    core = tree / "sys" / "class" / "hwmon" / "hwmon0" / "temp2_input"
    core.unlink()
    core.mkdir()  # reading it raises IsADirectoryError, as a sensor returning EIO would fail
    (tree / "sys" / "class" / "thermal" / "thermal_zone0" / "temp").write_text("n/a\n")
    sample = poll(collector)
    assert values(sample, "temperature_celsius") == {
        (("chip", "coretemp"), ("sensor", "Package id 0")): 48.0,
        (("chip", "nvme"), ("sensor", "temp1")): 38.85,
    }
    assert sorted(sample.errors) == ["parse", "read"]


def test_rapl_zones_in_joules() -> None:
    sample = poll(collector_for(FIXTURE))
    assert values(sample, "rapl_energy_joules_total") == {
        (("zone", "package-0"),): 83412.345678,
        (("zone", "package-0/core"),): 51234.56789,
        (("zone", "package-0/dram"),): 9876.54321,
    }


def test_rapl_counter_carries_across_the_wrap(tree: Path) -> None:
    dram = tree / "sys" / POWERCAP / "intel-rapl:0:1"
    collector = collector_for(tree)
    poll(collector)  # 9876543210 uJ
    (dram / "energy_uj").write_text("65712000000\n")
    assert values(poll(collector), "rapl_energy_joules_total")[(("zone", "package-0/dram"),)] == (
        65712.0
    )
    # Wraps at max_energy_range_uj = 65712999613: 999613 uJ to the top, then 1500000 more.
    (dram / "energy_uj").write_text("1500000\n")
    after_wrap = 65712.0 + (65712999613 - 65712000000 + 1500000) / 1e6
    energy = values(poll(collector), "rapl_energy_joules_total")
    assert energy[(("zone", "package-0/dram"),)] == pytest.approx(after_wrap, abs=1e-6)
    (dram / "energy_uj").write_text("2500000\n")
    energy = values(poll(collector), "rapl_energy_joules_total")
    assert energy[(("zone", "package-0/dram"),)] == pytest.approx(after_wrap + 1.0, abs=1e-6)


def test_rapl_counter_without_max_range_treats_a_drop_as_a_reset(tree: Path) -> None:
    package = tree / "sys" / POWERCAP / "intel-rapl:0"
    (package / "max_energy_range_uj").unlink()
    collector = collector_for(tree)
    poll(collector)  # 83412345678 uJ
    (package / "energy_uj").write_text("1000000\n")
    sample = poll(collector)
    assert values(sample, "rapl_energy_joules_total")[(("zone", "package-0"),)] == 83412.345678
    assert sample.errors == ()
    (package / "energy_uj").write_text("4000000\n")
    energy = values(poll(collector), "rapl_energy_joules_total")
    assert energy[(("zone", "package-0"),)] == pytest.approx(83412.345678 + 3.0, abs=1e-6)


def test_unreadable_rapl_zone_is_absent_not_zero(tree: Path) -> None:
    # As root a chmod does not stop a read, so an energy_uj that is a directory stands in for an
    # unreadable counter (IsADirectoryError, counted as "read"); see the next test for EACCES.
    core = tree / "sys" / POWERCAP / "intel-rapl:0:0" / "energy_uj"
    collector = collector_for(tree)
    poll(collector)  # core at 51234567890 uJ
    core.unlink()
    core.mkdir()
    sample = poll(collector)
    energy = values(sample, "rapl_energy_joules_total")
    assert (("zone", "package-0/core"),) not in energy
    assert set(energy) == {(("zone", "package-0"),), (("zone", "package-0/dram"),)}
    assert sample.errors == ("read",)
    # Readable again: the counter carries on from where it was, not from zero.
    core.rmdir()
    core.write_text("51236567890\n")
    energy = values(poll(collector), "rapl_energy_joules_total")
    assert energy[(("zone", "package-0/core"),)] == pytest.approx(51236.56789, abs=1e-6)


@pytest.fixture
def shared_tree() -> Iterator[Path]:
    """A fixture copy that an unprivileged user can traverse (pytest's tmp_path is 0700)."""
    base = Path(tempfile.mkdtemp(prefix="sustain-host-"))
    base.chmod(0o755)
    shutil.copytree(FIXTURE, base / "host")
    yield base / "host"
    shutil.rmtree(base)


def collect_in_child(procfs: Path, sysfs: Path, uid: int | None) -> dict[str, Any]:
    """One poll in a forked child, as ``uid`` when given; the interpreter lives under /root here,
    so a fresh ``python`` could not be started as another user, but a fork needs no exec."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child must never return into pytest
        code = 1
        try:
            os.close(read_end)
            report: dict[str, Any]
            try:
                if uid is not None:
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
            except PermissionError as exc:
                report = {"skip": str(exc)}
            else:
                sample = HostCollector(procfs, sysfs).collect()[0]
                report = {
                    "errors": list(sample.errors),
                    "energy": {
                        dict(r.labels)["zone"]: r.value
                        for r in sample.readings
                        if r.field == "rapl_energy_joules_total"
                    },
                }
            with os.fdopen(write_end, "w") as out:
                json.dump(report, out)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as incoming:
        text = incoming.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child poll failed"
    report = json.loads(text)
    assert isinstance(report, dict)
    return report


def test_rapl_zone_denied_by_permission_is_absent(shared_tree: Path) -> None:
    # energy_uj is root-only on current kernels. Root reads through chmod 000, so when the tests
    # run as root the poll runs in a child that has dropped to nobody, to meet a real EACCES.
    (shared_tree / "sys" / POWERCAP / "intel-rapl:0" / "energy_uj").chmod(0o000)
    uid = NOBODY if os.geteuid() == 0 else None
    report = collect_in_child(shared_tree / "proc", shared_tree / "sys", uid)
    if "skip" in report:
        pytest.skip(f"cannot drop to an unprivileged user here: {report['skip']}")
    assert report["errors"] == ["permission"]
    assert report["energy"] == {"package-0/core": 51234.56789, "package-0/dram": 9876.54321}


def test_amd_and_mmio_zones_are_found_and_kept_apart(tree: Path) -> None:
    powercap = tree / "sys" / POWERCAP
    shutil.copytree(powercap / "intel-rapl:0", powercap / "intel-rapl-mmio:0")
    (powercap / "intel-rapl-mmio:0" / "energy_uj").write_text("1000000\n")
    (powercap / "amd-rapl:1").mkdir()
    (powercap / "amd-rapl:1" / "name").write_text("package-1\n")
    (powercap / "amd-rapl:1" / "energy_uj").write_text("2000000\n")
    (powercap / "no-name:0").mkdir()  # a zone without a name is not reported
    (powercap / "no-name:0" / "energy_uj").write_text("3000000\n")
    energy = values(poll(collector_for(tree)), "rapl_energy_joules_total")
    assert energy == {
        (("zone", "package-0"),): 83412.345678,
        (("zone", "package-0/core"),): 51234.56789,
        (("zone", "package-0/dram"),): 9876.54321,
        (("zone", "package-0.intel-rapl-mmio:0"),): 1.0,
        (("zone", "package-1"),): 2.0,
    }


def test_missing_sysfs_leaves_only_procfs_fields(tmp_path: Path) -> None:
    collector = HostCollector(procfs=FIXTURE / "proc", sysfs=tmp_path / "no-sys")
    sample = poll(collector)
    fields = {reading.field for reading in sample.readings}
    assert fields == {
        "cpu_frequency_hertz",  # from cpuinfo
        "memory_total_bytes",
        "memory_available_bytes",
        "memory_used_bytes",
        "load1",
        "load5",
        "load15",
    }
    assert sample.errors == ()


def test_partly_missing_procfs_still_collects(tree: Path) -> None:
    (tree / "proc" / "meminfo").unlink()
    (tree / "proc" / "loadavg").write_text("garbage\n")
    sample = poll(collector_for(tree))
    assert values(sample, "memory_total_bytes") == {}
    assert values(sample, "load1") == {}
    assert sample.errors == ("parse",)
    assert values(sample, "temperature_celsius")


def test_nothing_readable_raises(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "stat").mkdir()  # present but unreadable
    collector = HostCollector(procfs=tmp_path / "proc", sysfs=FIXTURE / "sys")
    with pytest.raises(CollectorError, match="could be read"):
        collector.collect()


def test_hotplugged_sensor_appears_after_rediscovery(tree: Path) -> None:
    collector = HostCollector(tree / "proc", tree / "sys", rediscover_seconds=0.0)
    poll(collector)
    hwmon = tree / "sys" / "class" / "hwmon" / "hwmon2"
    hwmon.mkdir()
    (hwmon / "name").write_text("amdgpu\n")
    (hwmon / "temp1_input").write_text("61000\n")
    (hwmon / "temp1_label").write_text("edge\n")
    temperatures = values(poll(collector), "temperature_celsius")
    assert temperatures[(("chip", "amdgpu"), ("sensor", "edge"))] == 61.0


def test_readings_match_their_fields(tree: Path) -> None:
    collector = collector_for(tree)
    poll(collector)
    rows = {
        name: advanced(row, [10, 0, 10, 80, 0, 0, 0, 0, 0, 0]) for name, row in STAT_CPU.items()
    }
    write_stat(tree / "proc", rows)
    sample = poll(collector)
    assert {reading.field for reading in sample.readings} == set(FIELDS)
    for reading in sample.readings:
        field = collector.fields[reading.field]
        assert tuple(name for name, _ in reading.labels) == field.labels
    series = [(reading.field, reading.labels) for reading in sample.readings]
    assert len(series) == len(set(series))
    collector.close()


def test_this_machine() -> None:
    collector = HostCollector()
    try:
        poll(collector)
        sample = poll(collector)
    finally:
        collector.close()
    frequencies = values(sample, "cpu_frequency_hertz")
    assert frequencies, "no cpufreq and no cpu MHz in /proc/cpuinfo"
    assert all(1e8 < hertz < 1e10 for hertz in frequencies.values())
    total = value(sample, "memory_total_bytes")
    available = value(sample, "memory_available_bytes")
    assert 64 * 2**20 < total < 2**50
    assert 0 < available <= total
    assert value(sample, "memory_used_bytes") == total - available
    for key in ("load1", "load5", "load15"):
        assert 0 <= value(sample, key) < 10_000
    for ratio in values(sample, "cpu_utilization_ratio").values():
        assert 0.0 <= ratio <= 1.0
