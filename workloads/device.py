"""The device a probe runs on, and the few facts about it that problem sizes depend on.

Sizes follow the device rather than a constant so that a probe measures the same regime
everywhere: a memory-bandwidth buffer must be far larger than the last-level cache of *this*
device, and a matmul must be large enough to keep *this* device's units busy.
"""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import torch

from workloads.protocol import Unsupported

CPU_CACHE: Final = Path("/sys/devices/system/cpu/cpu0/cache")
MEMINFO: Final = Path("/proc/meminfo")
CPUINFO: Final = Path("/proc/cpuinfo")

_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
_SIZE_SUFFIX: Final = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    kind: Literal["cpu", "cuda"]
    torch_device: str
    name: str
    capability: tuple[int, int] | None
    memory_total_bytes: int | None
    memory_free_bytes: int | None
    cache_bytes: int | None
    """Last-level cache: L3 (or the largest level) on a CPU, L2 on a GPU."""
    cuda_device_count: int


def parse(spec: str) -> tuple[Literal["cpu", "cuda"], int | None]:
    """Split 'cpu', 'cuda' or 'cuda:N'; raise ValueError for anything else (a usage error)."""
    match = _DEVICE.match(spec)
    if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
        raise ValueError(f"device must be cpu, cuda or cuda:N, not {spec!r}")
    kind: Literal["cpu", "cuda"] = "cpu" if match.group(1) == "cpu" else "cuda"
    return kind, None if match.group(2) is None else int(match.group(2))


def probe(spec: str) -> DeviceInfo:
    """Describe the device; Unsupported when it is not there (a CPU build, a missing index)."""
    kind, index = parse(spec)
    if kind == "cpu":
        return DeviceInfo(
            kind="cpu",
            torch_device="cpu",
            name=cpu_model(),
            capability=None,
            memory_total_bytes=_meminfo_bytes("MemTotal"),
            memory_free_bytes=_meminfo_bytes("MemAvailable"),
            cache_bytes=last_level_cache_bytes(),
            cuda_device_count=0,
        )
    if torch.version.cuda is None and torch.version.hip is None:
        raise Unsupported(f"torch {torch.__version__} is a CPU build: no CUDA device")
    if not torch.cuda.is_available():
        raise Unsupported("no CUDA device is available (torch.cuda.is_available() is False)")
    return _cuda_info(torch.cuda.current_device() if index is None else index)


def _cuda_info(index: int) -> DeviceInfo:  # GPU-only: not exercised on CPU
    count = torch.cuda.device_count()
    if index >= count:
        raise Unsupported(f"cuda:{index} does not exist ({count} CUDA devices)")
    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    return DeviceInfo(
        kind="cuda",
        torch_device=f"cuda:{index}",
        name=props.name,
        capability=(props.major, props.minor),
        memory_total_bytes=total,
        memory_free_bytes=free,
        cache_bytes=props.L2_cache_size,
        cuda_device_count=count,
    )


def last_level_cache_bytes(root: Path = CPU_CACHE) -> int | None:
    """The size of the highest data or unified cache level of cpu0; None where sysfs lacks it."""
    best: tuple[int, int] | None = None
    for index in root.glob("index*"):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue  # a cache level sysfs cannot describe is one we cannot size buffers by
        if kind != "Instruction" and (best is None or level > best[0]):
            best = (level, size)
    return None if best is None else best[1]


def parse_size(text: str) -> int:
    """Parse sysfs cache sizes such as '307200K' or '32M'."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text)
    if match is None:
        raise ValueError(f"not a cache size: {text!r}")
    return int(match.group(1)) * _SIZE_SUFFIX[match.group(2)]


def _meminfo_bytes(field: str) -> int | None:
    try:
        lines = MEMINFO.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    return None


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The instruction-set flags of the first CPU: x86's `flags`, aarch64's `Features`; empty
    where /proc/cpuinfo cannot be read or names none."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return frozenset()
    for line in lines:
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_model() -> str:
    try:
        lines = CPUINFO.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        name, _, value = line.partition(":")
        if name.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine()
