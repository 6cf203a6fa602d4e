"""What a workload declares and what the runner asks of it.

A workload is a class with a declaration (`Spec`), a static capability check that `list` and
`run` share, and, once constructed for a device and precision (allocation happens there), an
endless stream of `Step`s. The runner owns timing, stopping and output, so every workload is
timed and reported the same way. Anything a generator does between two yields (a cache flush,
choosing the next token) runs outside the timed window.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from workloads import precision as precisions
from workloads.device import DeviceInfo

Size = Literal["small", "default"]


@dataclass(frozen=True, slots=True)
class Spec:
    name: str
    version: int
    """Bumped whenever the method changes: results of different versions are not comparable."""
    unit: str
    work_unit: str
    precisions: tuple[str, ...]
    optimizations: tuple[str, ...]
    default_duration: float
    devices: tuple[Literal["cpu", "cuda"], ...]


@dataclass(frozen=True, slots=True)
class Request:
    precision: str
    optimization: str
    size: Size
    flush_cache: bool = False
    causal: bool = False
    ranks: int | None = None
    """allreduce on a CPU: how many ranks (processes) to run; on GPUs one per visible GPU."""
    shrink: int = 0
    """How many times the problem's leading dimensions are halved so that the minimum of
    iterations fits the duration (workloads/calibration.py); 0: the size as chosen."""

    @property
    def size_label(self) -> str:
        """The size as the manifest records it: "default", "small", or "default/4" for the
        default problem with its leading dimensions divided by 4 (results of different sizes are
        not comparable)."""
        return self.size if self.shrink == 0 else f"{self.size}/{1 << self.shrink}"


@dataclass(frozen=True, slots=True)
class Step:
    work: float
    run: Callable[[], None]
    phase: str | None = None


@dataclass(frozen=True, slots=True)
class Record:
    """One timed iteration, as emitted."""

    start: float
    end: float
    work: float
    phase: str | None


class Workload(ABC):
    spec: ClassVar[Spec]
    max_shrink: ClassVar[int] = 0
    """How often ``Request.shrink`` may halve the problem; 0 where the size is what is measured
    (membw: arrays far beyond the caches) or an iteration is short by design (inference)."""

    def __init__(self, request: Request, device: DeviceInfo) -> None:
        self.request = request
        self.device = device
        self.torch_device = torch.device(device.torch_device)
        self.shapes: dict[str, Any] = {}
        self.parameters: dict[str, Any] = {}
        self.kernel: str | None = None

    @classmethod
    def unsupported_reason(
        cls, device: DeviceInfo, precision: str, optimization: str
    ) -> str | None:
        """Why this device cannot run the workload at this precision and level, or None."""
        # Only inference (compiled) and matmul (fast_accum) have another level; each checks it.
        del optimization
        if device.kind not in cls.spec.devices:
            return f"{cls.spec.name} needs a CUDA device"
        return precisions.unsupported_reason(precision, device)

    @abstractmethod
    def steps(self) -> Generator[Step, None, None]:
        """Endless: the runner decides when to stop."""

    def agree_stop(self, stop: bool) -> bool:
        """Whether to stop now; a multi-process workload makes its processes agree here."""
        return stop

    def close(self) -> None:  # noqa: B027 - most workloads hold nothing that outlives them
        """Release what would outlive the run otherwise (worker processes, process groups)."""

    def summary(self, records: Sequence[Record]) -> dict[str, Any]:
        """Workload-specific fields for the result line."""
        del records
        return {}

    def phase_summary(self, phase: str, records: Sequence[Record]) -> dict[str, Any]:
        """Workload-specific fields of one phase's entry in the result line's ``phases``
        (``records`` are that phase's): what only that phase has, such as a latency."""
        del phase, records
        return {}
