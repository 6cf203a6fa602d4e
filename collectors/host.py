"""Host CPU, memory, load, temperature and RAPL energy, under configurable procfs and sysfs roots.

Memory comes from psutil (``psutil.virtual_memory()``), which reads meminfo under
``psutil.PROCFS_PATH`` and, where MemAvailable is missing or implausible (old kernels, LXC),
estimates what is available as free(1) does. ``PROCFS_PATH`` is a process-wide global: the
collector sets it to its procfs root when it is built, so one process has one procfs root (the
daemon gives the process table in collectors/processes.py the same ``host.procfs``).

The rest is read by hand, because psutil has no equivalent under a configurable root:

- CPU times (/proc/stat): ``psutil.cpu_times(percpu=True)`` is a list by position that drops the
  CPU number, so with a CPU offline the per-core labels would shift and stop matching cpufreq's;
- load averages (/proc/loadavg): ``psutil.getloadavg()`` is ``os.getloadavg()``, which ignores
  ``PROCFS_PATH``;
- cpufreq, hwmon and thermal zones: ``psutil.cpu_freq()`` and ``psutil.sensors_temperatures()``
  read a fixed /sys (cpu_freq even picks its source when psutil is imported);
- RAPL energy (powercap): psutil has no API for it.

So tests point the collector at a fixture tree, and a poll at 1-10 Hz reads only the few files it
needs. The sensor paths (cpufreq, hwmon, thermal zones, powercap zones) are found by a directory
walk once, and again at most once a minute so that hotplugged sensors appear. The exposition it
feeds::

    sustain_cpu_utilization_ratio 0.45
    sustain_cpu_frequency_hertz{cpu="0"} 3.4e+09
    sustain_memory_used_bytes 1.1394895872e+10
    sustain_load1 1.52
    sustain_temperature_celsius{chip="coretemp",sensor="Package id 0"} 48.0
    sustain_rapl_energy_joules_total{zone="package-0/dram"} 9876.54321
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import psutil

from collectors.base import BOTH, MEAN, PEAK, CollectorError, Field, Labels, Reading, Sample

REDISCOVER_SECONDS = 60.0

# user nice system idle iowait irq softirq steal: guest and guest_nice follow, but the kernel
# already counts them inside user and nice, so adding them would count guest time twice.
_CPU_TIME_COLUMNS = 8
_IDLE, _IOWAIT = 3, 4

_FIELDS = (
    Field(
        "cpu_utilization",
        "ratio",
        "gauge",
        "Busy share of all CPUs since the previous poll.",
        windowed=BOTH,
    ),
    Field(
        "cpu_core_utilization",
        "ratio",
        "gauge",
        "Busy share of one CPU since the previous poll.",
        ("cpu",),
        rollup=False,
    ),
    Field(
        "cpu_frequency", "hertz", "gauge", "Current frequency of one CPU.", ("cpu",), windowed=MEAN
    ),
    Field(
        "cpu_frequency_max",
        "hertz",
        "gauge",
        "Highest frequency one CPU can reach.",
        ("cpu",),
        rollup=False,
    ),
    Field("memory_total", "bytes", "gauge", "Usable physical memory.", rollup=False),
    Field(
        "memory_available",
        "bytes",
        "gauge",
        "Memory available for new work without swapping (MemAvailable).",
    ),
    Field("memory_used", "bytes", "gauge", "Memory in use: total minus available."),
    Field("load1", "", "gauge", "1-minute load average."),
    Field("load5", "", "gauge", "5-minute load average."),
    Field("load15", "", "gauge", "15-minute load average."),
    Field(
        "temperature",
        "celsius",
        "gauge",
        "Temperature of one hwmon sensor or thermal zone.",
        ("chip", "sensor"),
        windowed=PEAK,
    ),
    Field(
        "rapl_energy",
        "joules",
        "counter",
        "Energy used by one RAPL power zone, carried across the hardware counter's wrap.",
        ("zone",),
    ),
)
FIELDS: Mapping[str, Field] = MappingProxyType({field.key: field for field in _FIELDS})


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Cumulative jiffies of one /proc/stat cpu line; busy excludes idle and iowait."""

    busy: int
    total: int


@dataclass(frozen=True, slots=True)
class _CpuFreq:
    cpu: str
    current: str
    maximum: str


@dataclass(frozen=True, slots=True)
class _TemperatureSensor:
    chip: str
    sensor: str
    path: str


@dataclass(frozen=True, slots=True)
class _EnergyZone:
    zone: str
    energy: str
    max_range: str


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where the sensors are, found by one walk; ``errors`` are the walk's own read failures."""

    cpufreq: tuple[_CpuFreq, ...]
    temperatures: tuple[_TemperatureSensor, ...]
    energy_zones: tuple[_EnergyZone, ...]
    errors: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _EnergyCounter:
    """Integer microjoules, so that years of accumulation lose nothing to float rounding."""

    raw_uj: int
    total_uj: int


class _Poll:
    """Readings and error kinds gathered during one poll (or one discovery walk).

    A file that does not exist is a sensor this host lacks and is silently absent; any other
    failure to read or parse it is counted by kind, so that nothing is swallowed.
    """

    __slots__ = ("errors", "readings")

    def __init__(self) -> None:
        self.readings: list[Reading] = []
        self.errors: list[str] = []

    def add(self, key: str, value: float, labels: Labels = ()) -> None:
        self.readings.append(Reading(key, value, labels))

    def text(self, path: str) -> str | None:
        try:
            with open(path, encoding="utf-8") as handle:
                return handle.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except PermissionError:
            self.errors.append("permission")
        except OSError:
            self.errors.append("read")
        except UnicodeDecodeError:
            self.errors.append("parse")
        return None

    def integer(self, path: str) -> int | None:
        text = self.text(path)
        if text is None:
            return None
        try:
            return int(text)
        except ValueError:
            self.errors.append("parse")
            return None

    def entries(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except PermissionError:
            self.errors.append("permission")
        except OSError:
            self.errors.append("read")
        return []


def _numbered(names: Iterable[str], prefix: str, suffix: str = "") -> list[tuple[int, str]]:
    """``prefix<N>suffix`` names with their N, in numeric order (cpu10 after cpu9)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)" + re.escape(suffix))
    found = [(int(match[1]), name) for name in names if (match := pattern.fullmatch(name))]
    return sorted(found)


def _natural(name: str) -> tuple[str | int, ...]:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _unique(base: str, suffix: str, taken: set[str]) -> str:
    name = base if base not in taken else f"{base}.{suffix}"
    taken.add(name)
    return name


def parse_cpu_times(text: str) -> dict[str, CpuTimes]:
    """The cpu lines of /proc/stat by CPU: "" for the aggregate line, "N" for cpuN."""
    times: dict[str, CpuTimes] = {}
    for line in text.splitlines():
        if not line.startswith("cpu"):
            break  # the cpu lines come first; intr alone can be kilobytes long
        name, *columns = line.split()
        values = [int(column) for column in columns[:_CPU_TIME_COLUMNS]]
        total = sum(values)
        idle = values[_IDLE] + (values[_IOWAIT] if len(values) > _IOWAIT else 0)
        times[name[3:]] = CpuTimes(busy=total - idle, total=total)
    return times


def utilization(previous: CpuTimes, current: CpuTimes) -> float | None:
    """Busy share between two snapshots, None when no time passed.

    Clamped because iowait is known to step backwards on tickless kernels.
    """
    total = current.total - previous.total
    if total <= 0:
        return None
    return min(1.0, max(0.0, (current.busy - previous.busy) / total))


def parse_cpuinfo_hertz(text: str) -> dict[str, float]:
    """``cpu MHz`` per ``processor`` number, in hertz (x86 only; other cpuinfo lacks it)."""
    hertz: dict[str, float] = {}
    processor = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            processor = value.strip()
        elif key == "cpu MHz":
            hertz[processor] = float(value) * 1e6
    return hertz


class HostCollector:
    """Reads the host's procfs and sysfs; keeps the previous CPU times and the RAPL counters."""

    name = "host"

    def __init__(
        self,
        procfs: Path = Path("/proc"),
        sysfs: Path = Path("/sys"),
        *,
        rediscover_seconds: float = REDISCOVER_SECONDS,
    ) -> None:
        self._stat = os.path.join(procfs, "stat")
        self._meminfo = os.path.join(procfs, "meminfo")
        # Process-wide: the last collector built sets the root for every psutil read in the process.
        psutil.PROCFS_PATH = os.fspath(procfs)
        self._loadavg = os.path.join(procfs, "loadavg")
        self._cpuinfo = os.path.join(procfs, "cpuinfo")
        self._sysfs = str(sysfs)
        self._rediscover_seconds = rediscover_seconds
        self._cpu_times: dict[str, CpuTimes] = {}
        self._energy: dict[str, _EnergyCounter] = {}
        self._layout = self._discover()
        self._pending_errors = self._layout.errors
        self._discovered_at = time.monotonic()

    @property
    def fields(self) -> Mapping[str, Field]:
        return FIELDS

    def collect(self) -> Sequence[Sample]:
        timestamp = time.time()
        now = time.monotonic()
        if now - self._discovered_at >= self._rediscover_seconds:
            self._layout = self._discover()
            self._pending_errors = self._layout.errors
            self._discovered_at = now
        poll = _Poll()
        poll.errors.extend(self._pending_errors)
        self._pending_errors = ()
        stat_read = self._collect_cpu_times(poll)
        memory_read = self._collect_memory(poll)
        load_read = self._collect_load(poll)
        if not (stat_read or memory_read or load_read):
            raise CollectorError(
                f"none of {self._stat}, {self._meminfo}, {self._loadavg} could be read"
            )
        self._collect_frequency(poll)
        self._collect_temperatures(poll)
        self._collect_energy(poll)
        return (
            Sample(
                collector=self.name,
                device="host",
                timestamp=timestamp,
                readings=tuple(poll.readings),
                errors=tuple(poll.errors),
            ),
        )

    def close(self) -> None:
        self._cpu_times.clear()
        self._energy.clear()

    def _collect_cpu_times(self, poll: _Poll) -> bool:
        text = poll.text(self._stat)
        if text is None:
            return False
        try:
            current = parse_cpu_times(text)
        except (ValueError, IndexError):
            poll.errors.append("parse")
            return False
        previous, self._cpu_times = self._cpu_times, current
        for cpu, times in current.items():
            before = previous.get(cpu)
            ratio = utilization(before, times) if before is not None else None
            if ratio is None:
                continue
            if cpu:
                poll.add("cpu_core_utilization_ratio", ratio, (("cpu", cpu),))
            else:
                poll.add("cpu_utilization_ratio", ratio)
        return True

    def _collect_memory(self, poll: _Poll) -> bool:
        try:
            memory = psutil.virtual_memory()
        except (FileNotFoundError, NotADirectoryError):
            return False
        except PermissionError:
            poll.errors.append("permission")
            return False
        except OSError:
            poll.errors.append("read")
            return False
        except (ValueError, IndexError, KeyError):
            poll.errors.append("parse")
            return False
        poll.add("memory_total_bytes", memory.total)
        poll.add("memory_available_bytes", memory.available)
        # Not psutil's own ``used``, whose definition has changed between psutil versions.
        poll.add("memory_used_bytes", memory.total - memory.available)
        return True

    def _collect_load(self, poll: _Poll) -> bool:
        text = poll.text(self._loadavg)
        if text is None:
            return False
        try:
            load1, load5, load15 = (float(value) for value in text.split()[:3])
        except ValueError:
            poll.errors.append("parse")
            return False
        poll.add("load1", load1)
        poll.add("load5", load5)
        poll.add("load15", load15)
        return True

    def _collect_frequency(self, poll: _Poll) -> None:
        if not self._layout.cpufreq:
            self._collect_cpuinfo_frequency(poll)
            return
        for cpu in self._layout.cpufreq:
            labels = (("cpu", cpu.cpu),)
            current_khz = poll.integer(cpu.current)
            if current_khz is not None:
                poll.add("cpu_frequency_hertz", current_khz * 1e3, labels)
            max_khz = poll.integer(cpu.maximum)
            if max_khz is not None:
                poll.add("cpu_frequency_max_hertz", max_khz * 1e3, labels)

    def _collect_cpuinfo_frequency(self, poll: _Poll) -> None:
        """Virtual machines have no cpufreq; their cpuinfo still reports the clock."""
        text = poll.text(self._cpuinfo)
        if text is None:
            return
        try:
            hertz = parse_cpuinfo_hertz(text)
        except ValueError:
            poll.errors.append("parse")
            return
        for cpu, value in hertz.items():
            poll.add("cpu_frequency_hertz", value, (("cpu", cpu),))

    def _collect_temperatures(self, poll: _Poll) -> None:
        for sensor in self._layout.temperatures:
            millidegrees = poll.integer(sensor.path)
            if millidegrees is not None:
                labels = (("chip", sensor.chip), ("sensor", sensor.sensor))
                poll.add("temperature_celsius", millidegrees / 1e3, labels)

    def _collect_energy(self, poll: _Poll) -> None:
        """Carry each zone's microjoule counter across its wrap at ``max_energy_range_uj``.

        A zone that cannot be read this poll (energy_uj is root-only on current kernels) is
        absent, not zero, and keeps its counter for the next poll that can read it.
        """
        for zone in self._layout.energy_zones:
            raw = poll.integer(zone.energy)
            if raw is None:
                continue
            counter = self._energy.get(zone.energy)
            if counter is None:
                total = raw
            elif raw >= counter.raw_uj:
                total = counter.total_uj + raw - counter.raw_uj
            else:
                max_range = poll.integer(zone.max_range)
                wrapped = raw + max_range - counter.raw_uj if max_range is not None else 0
                total = counter.total_uj + max(0, wrapped)
            self._energy[zone.energy] = _EnergyCounter(raw_uj=raw, total_uj=total)
            poll.add("rapl_energy_joules_total", total / 1e6, (("zone", zone.zone),))

    def _discover(self) -> _Layout:
        walk = _Poll()
        return _Layout(
            cpufreq=self._discover_cpufreq(walk),
            temperatures=self._discover_hwmon(walk) + self._discover_thermal(walk),
            energy_zones=self._discover_powercap(walk),
            errors=tuple(walk.errors),
        )

    def _discover_cpufreq(self, walk: _Poll) -> tuple[_CpuFreq, ...]:
        root = os.path.join(self._sysfs, "devices", "system", "cpu")
        found = []
        for index, name in _numbered(walk.entries(root), "cpu"):
            cpufreq = os.path.join(root, name, "cpufreq")
            if os.path.isdir(cpufreq):
                found.append(
                    _CpuFreq(
                        cpu=str(index),
                        current=os.path.join(cpufreq, "scaling_cur_freq"),
                        maximum=os.path.join(cpufreq, "cpuinfo_max_freq"),
                    )
                )
        return tuple(found)

    def _discover_hwmon(self, walk: _Poll) -> tuple[_TemperatureSensor, ...]:
        """Chips sharing a driver name (two coretemp sockets) get their hwmon dir appended."""
        root = os.path.join(self._sysfs, "class", "hwmon")
        chips: set[str] = set()
        found = []
        for _, name in _numbered(walk.entries(root), "hwmon"):
            directory = os.path.join(root, name)
            chip = _unique(
                (walk.text(os.path.join(directory, "name")) or "").strip() or name, name, chips
            )
            sensors: set[str] = set()
            for index, filename in _numbered(walk.entries(directory), "temp", "_input"):
                label_path = os.path.join(directory, f"temp{index}_label")
                label = (walk.text(label_path) or "").strip() or f"temp{index}"
                sensor = _unique(label, f"temp{index}", sensors)
                found.append(_TemperatureSensor(chip, sensor, os.path.join(directory, filename)))
        return tuple(found)

    def _discover_thermal(self, walk: _Poll) -> tuple[_TemperatureSensor, ...]:
        root = os.path.join(self._sysfs, "class", "thermal")
        found = []
        for _, name in _numbered(walk.entries(root), "thermal_zone"):
            directory = os.path.join(root, name)
            zone_type = (walk.text(os.path.join(directory, "type")) or "").strip() or name
            found.append(_TemperatureSensor(name, zone_type, os.path.join(directory, "temp")))
        return tuple(found)

    def _discover_powercap(self, walk: _Poll) -> tuple[_EnergyZone, ...]:
        """Every powercap zone with a name and an energy counter, sub-zones named under their
        parent ("package-0/dram"). intel-rapl goes first so that it keeps the plain names when
        intel-rapl-mmio repeats them."""
        root = os.path.join(self._sysfs, "class", "powercap")
        names: dict[str, str] = {}
        for entry in walk.entries(root):
            if os.path.exists(os.path.join(root, entry, "energy_uj")):
                name = (walk.text(os.path.join(root, entry, "name")) or "").strip()
                if name:
                    names[entry] = name
        order = sorted(
            names, key=lambda entry: (entry.split(":")[0] != "intel-rapl", _natural(entry))
        )
        taken: set[str] = set()
        found = []
        for entry in order:
            zone = names[entry]
            parent, _, _ = entry.rpartition(":")
            if ":" in parent:
                parent_name = names.get(parent) or parent
                zone = f"{parent_name}/{zone}"
            directory = os.path.join(root, entry)
            found.append(
                _EnergyZone(
                    zone=_unique(zone, entry, taken),
                    energy=os.path.join(directory, "energy_uj"),
                    max_range=os.path.join(directory, "max_energy_range_uj"),
                )
            )
        return tuple(found)
