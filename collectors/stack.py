"""The hardware x software stack a result was measured on, as a content-addressed snapshot.

A throughput change means little until it is tied to its cause, so every probe result names the
stack it ran on by the stack's id: the SHA-256 of the snapshot's canonical JSON. Only settled
configuration goes in (versions, modes, limits, link capabilities, an allow-list of environment
variables); nothing volatile (timestamps, current clocks, temperatures, PIDs) and nothing that
names one machine (UUIDs, serials, bus ids), so identical nodes share one id and a new id is a
stack change. Anything not readable is ``None``, never guessed. torch facts come from the probe
child (``python -m workloads facts``): the daemon never imports torch. A snapshot looks like::

    {"driver":{"cuda_version":"12.4","nvml_version":"12.550.54.15","version":"550.54.15"},
     "environment":{"CUDA_VISIBLE_DEVICES":"0,1"},"gpu_count":2,"gpus":[{"model":"NVIDIA H100 ...",
     "power_limit_watts":700.0,"vbios":"96.00.99.00.01",...}],"host":{"kernel":"6.8.0",...},...}

Secrets never enter: an allow-listed variable whose name suggests a credential is dropped, and
so is any value that is a database URL or a URL carrying user information.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from collectors.base import CollectorError
from collectors.nvml.library import Absent, CallFailed, DeviceLost, NvmlLibrary, cuda_version_text

ENV_PREFIXES = ("CUDA_", "NCCL_", "TORCH_", "TORCHINDUCTOR_", "NVIDIA_", "CUBLAS_", "CUDNN_")
ENV_NAMES = frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_LIBRARY_PATH"})
CREDENTIAL_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH")
CONTAINER_IMAGE_VARIABLE = "SUSTAIN_CONTAINER_IMAGE"
# scheme://user[:password]@host anywhere in a value, and any database URL at all.
_USERINFO_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]*@", re.IGNORECASE)
_DATABASE_URL = re.compile(
    r"\b(postgres(ql)?|mysql|mariadb|sqlite|mssql|oracle|mongodb|redis)(\+[a-z0-9]+)?://",
    re.IGNORECASE,
)
# Probe-child backend facts lifted to torch.<name>; the rest stay under torch.backends.
_TORCH_LIBRARIES = ("cuda", "hip", "cudnn", "nccl")
# Set by each probe from its precision (a manifest shows them as in effect for that run), so they
# describe the run, not the stack.
_PER_RUN_SWITCHES = frozenset({"tf32_matmul", "tf32_cudnn", "float32_matmul_precision"})
_NVML_ERRORS = (Absent, CallFailed, DeviceLost)


@dataclass(frozen=True, slots=True)
class StackSnapshot:
    """One stack: ``facts`` is plain JSON data; ``id`` is the SHA-256 hex of its canonical JSON."""

    facts: Mapping[str, Any]

    def canonical_json(self) -> str:
        return json.dumps(self.facts, sort_keys=True, separators=(",", ":"), allow_nan=False)

    @property
    def id(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


def capture(
    *,
    torch_facts: Mapping[str, Any] | None,
    nvml: NvmlLibrary | None,
    environ: Mapping[str, str] = os.environ,
    procfs: Path = Path("/proc"),
    sysfs: Path = Path("/sys"),
    sdpa_backend: str | None = None,
    container_image: str | None = None,
) -> StackSnapshot:
    """Read the stack now. ``nvml`` is started here if it is not yet; its owner shuts it down."""
    driver, gpus = _nvml_facts(nvml)
    if driver["version"] is None:
        driver["version"] = _read(sysfs / "module" / "nvidia" / "version")
    return StackSnapshot(
        {
            "driver": driver,
            "gpu_count": None if gpus is None else len(gpus),
            "gpus": gpus,
            "host": {
                "kernel": _read(procfs / "sys" / "kernel" / "osrelease"),
                "cpu_model": _cpu_model(procfs / "cpuinfo"),
                "python": platform.python_version(),
            },
            "torch": None if torch_facts is None else _torch(torch_facts),
            "sdpa_backend": sdpa_backend,
            "container_image": container_image or environ.get(CONTAINER_IMAGE_VARIABLE) or None,
            "environment": allowed_environment(environ),
        }
    )


def may_hold_secret(name: str, value: str, harmless: Collection[str] = ()) -> bool:
    """A name that reads like a credential (unless listed as ``harmless``), or a value with a URL
    carrying user information: what neither a snapshot nor a probe child's environment holds."""
    credential_name = name not in harmless and any(
        word in name.upper() for word in CREDENTIAL_WORDS
    )
    return credential_name or bool(_USERINFO_URL.search(value))


def allowed_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The allow-listed variables, less credential-like names and URLs that could carry secrets."""
    return {
        name: value
        for name, value in environ.items()
        if (name.startswith(ENV_PREFIXES) or name in ENV_NAMES)
        and not may_hold_secret(name, value)
        and not _DATABASE_URL.search(value)
    }


def diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """Leaf-by-leaf differences as (dotted path, old, new), sorted by path; missing is None."""
    old, new = flatten(a), flatten(b)
    return [
        (path, old.get(path), new.get(path))
        for path in sorted(old.keys() | new.keys())
        if old.get(path) != new.get(path)
    ]


def describe_diff(changes: list[tuple[str, Any, Any]]) -> str:
    """One ``path: old -> new`` line per change."""
    return "\n".join(f"{path}: {_show(old)} -> {_show(new)}" for path, old, new in changes)


def _nvml_facts(
    nvml: NvmlLibrary | None,
) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    driver: dict[str, Any] = {"version": None, "cuda_version": None, "nvml_version": None}
    if nvml is None:
        return driver, None
    try:
        nvml.start()
    except CollectorError:  # not installed here, or a driver that fails to start
        return driver, None

    def get(function: Callable[..., Any], *args: Any) -> Any:
        try:
            return nvml.call(function, *args)
        except _NVML_ERRORS:
            return None

    driver["version"] = _text(get(pynvml.nvmlSystemGetDriverVersion))
    driver["nvml_version"] = _text(get(pynvml.nvmlSystemGetNVMLVersion))
    cuda = get(pynvml.nvmlSystemGetCudaDriverVersion)
    driver["cuda_version"] = None if cuda is None else cuda_version_text(int(cuda))
    count = get(pynvml.nvmlDeviceGetCount)
    if count is None:
        return driver, None
    gpus = []
    for index in range(count):
        handle = get(pynvml.nvmlDeviceGetHandleByIndex, index)
        gpus.append({} if handle is None else _gpu(get, handle))
    return driver, gpus


def _gpu(get: Callable[..., Any], handle: Any) -> dict[str, Any]:
    def current(function: Callable[..., Any]) -> bool | None:
        modes = get(function, handle)  # [current, pending]
        return None if modes is None else bool(modes[0])

    def hertz(clock: int) -> int | None:
        mhz = get(pynvml.nvmlDeviceGetApplicationsClock, handle, clock)
        return None if mhz is None else int(mhz) * 1_000_000

    persistence = get(pynvml.nvmlDeviceGetPersistenceMode, handle)
    milliwatts = get(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    return {
        "model": _text(get(pynvml.nvmlDeviceGetName, handle)),
        "vbios": _text(get(pynvml.nvmlDeviceGetVbiosVersion, handle)),
        "ecc_enabled": current(pynvml.nvmlDeviceGetEccMode),
        "persistence_enabled": None if persistence is None else bool(persistence),
        "mig_enabled": current(pynvml.nvmlDeviceGetMigMode),
        "power_limit_watts": None if milliwatts is None else milliwatts / 1000,
        "application_clock_hertz": {
            "sm": hertz(pynvml.NVML_CLOCK_SM),
            "memory": hertz(pynvml.NVML_CLOCK_MEM),
        },
        # The link's capability only: the current generation and width drop on an idle GPU to
        # save power, which would read as a stack change every time; they are telemetry
        # (gpu_pcie_link_generation, gpu_pcie_link_width) and the dashboards compare them.
        "pcie": {
            "generation_max": get(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
            "width_max": get(pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        },
    }


def _torch(facts: Mapping[str, Any]) -> dict[str, Any]:
    """What a probe child reports of its torch, from ``python -m workloads facts`` or from a
    probe's manifest: the keys both carry, so the two sources give the same stack id."""
    backends = {
        name: value
        for name, value in (facts.get("backends") or {}).items()
        if name not in _PER_RUN_SWITCHES
    }
    lifted = {name: backends.pop(name, None) for name in _TORCH_LIBRARIES}
    return {
        "version": facts.get("torch"),
        "python": facts.get("python"),
        **lifted,
        "backends": backends,
        "threads": facts.get("threads"),
    }


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _cpu_model(cpuinfo: Path) -> str | None:
    for line in (_read(cpuinfo) or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves by dotted path (``gpus.0.model``); an empty mapping or list is one leaf."""
    if isinstance(value, Mapping) and value:
        items = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, list) and value:
        items = [(str(i), v) for i, v in enumerate(value)]
    else:
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in items:
        out.update(flatten(item, f"{prefix}.{key}" if prefix else key))
    return out


def _show(value: Any) -> str:
    if value is None:
        return "absent"
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
