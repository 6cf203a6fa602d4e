"""GPM (GPU Performance Monitoring, Hopper and newer): metrics computed between two samples.

A stream is a GPU (``nvmlGpmSampleGet``) or one GPU instance of a MIG GPU
(``nvmlGpmMigSampleGet``: the GPU's handle and the instance id). Each poll takes a sample and
asks ``nvmlGpmMetricsGet`` for the metrics between the previous poll's sample and this one.

Whether a GPU has GPM is ``nvmlGpmQueryDeviceSupport`` on its own handle. NVML has no
per-instance query, and DCGM too takes a GPU instance's GPM support from its GPU
(``DcgmCacheManager``: ``m_gpus[gpuId].supportGpm`` for GPU and compute instance entities); an
instance's own answer comes from sampling it: NOT_SUPPORTED or NOT_FOUND from
``nvmlGpmMigSampleGet`` turns GPM off for that instance alone, and the GPU's own sampling failing
(as it may in MIG mode) for none of its instances. A GPU instance is sampled whole (DCGM: "a MIG
sample is a GPU-I level aggregation of GPU-CI counters"), so the collector exports it once, not
once per compute instance.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

from collectors.nvml.fields import GPM_METRICS
from collectors.nvml.library import Absent, CallFailed, DeviceLost, NvmlLibrary, Refused

log = logging.getLogger(__name__)


@dataclass
class Gpm:
    """One GPM stream (a GPU, or one GPU instance of a MIG GPU): the last sample taken, which
    the next poll's metrics are computed against."""

    supported: bool | None = None
    refused: bool = False
    sample: Any = None


class GpmReader:
    """GPM through the collector's NVML session; every sample it allocates is freed on every
    path (a refused or failed take, failed metrics, a lost GPU: see ``drop``)."""

    def __init__(self, library: NvmlLibrary) -> None:
        self._library = library

    def supported(self, handle: Any, errors: list[str]) -> bool | None:
        """nvmlGpmQueryDeviceSupport of the GPU ``handle``; None when it failed this time (the
        kind appended to ``errors``: ask again later)."""
        try:
            support = self._library.call(pynvml.nvmlGpmQueryDeviceSupport, handle)
        except Absent:
            return False
        except CallFailed as exc:
            errors.append(exc.kind)
            return None
        return bool(support.isSupportedDevice)

    def read(
        self,
        stream: Gpm,
        take: Callable[[Any], Any],
        errors: list[str],
        where: tuple[int, str],
    ) -> dict[str, float]:
        """The GPM ratios (family key -> 0-1) between the stream's previous sample and a new one
        that ``take`` fills; {} on the first sample, or where GPM is off, refused or failed.

        NVML_ERROR_NO_PERMISSION (a non-privileged container, NVIDIA/DCGM#214) is logged once
        (``where``: the GPU's index and the stream's UUID), counted once as ``gpm_no_permission``
        and not asked again until the GPU is re-acquired: the GPM fields are then absent."""
        if not stream.supported or stream.refused:
            return {}
        current = self._take(stream, take, errors, where)
        if current is None:
            return {}
        previous, stream.sample = stream.sample, current
        if previous is None:
            return {}
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1 = previous
        request.sample2 = current
        for position, (_, metric_id) in enumerate(GPM_METRICS):
            request.metrics[position].metricId = metric_id
        try:
            self._library.call(pynvml.nvmlGpmMetricsGet, request)
        except (Absent, CallFailed) as exc:
            if isinstance(exc, CallFailed):
                errors.append(exc.kind)
            return {}
        finally:
            self._free(previous)
        return {
            key: request.metrics[position].value / 100
            for position, (key, _) in enumerate(GPM_METRICS)
            if request.metrics[position].nvmlReturn == pynvml.NVML_SUCCESS
        }

    def _take(
        self, stream: Gpm, take: Callable[[Any], Any], errors: list[str], where: tuple[int, str]
    ) -> Any:
        """A new sample, taken; None when it cannot be (freed again, the reason recorded)."""
        try:
            current = self._library.call(pynvml.nvmlGpmSampleAlloc)
        except (Absent, CallFailed) as exc:
            if isinstance(exc, CallFailed):
                errors.append(exc.kind)
            return None
        try:
            take(current)
        except Refused:
            self._free(current)
            self.drop(stream)
            stream.refused = True
            errors.append("gpm_no_permission")
            log.warning(
                "GPU %d (%s): GPM refused (NVML_ERROR_NO_PERMISSION); GPM fields absent until "
                "the GPU is re-acquired or the agent restarts with the permission",
                *where,
            )
            return None
        except (Absent, CallFailed) as exc:
            self._free(current)
            if isinstance(exc, CallFailed):
                errors.append(exc.kind)
            else:
                stream.supported = False
            return None
        except BaseException:  # a lost GPU: the caller drops the stream's sample too
            self._free(current)
            raise
        return current

    def _free(self, sample: Any) -> None:
        with contextlib.suppress(Absent, CallFailed, DeviceLost):
            self._library.call(pynvml.nvmlGpmSampleFree, sample)

    def drop(self, stream: Gpm) -> None:
        """Free the stream's kept sample (the device was lost, refused GPM, or the agent stops)."""
        if stream.sample is not None:
            self._free(stream.sample)
            stream.sample = None
