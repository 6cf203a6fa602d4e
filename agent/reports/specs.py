"""Published peak throughput of the GPU models we know, for the ratio achieved / spec peak.

Principle 2 of the design: a spec sheet is a ceiling, not an outcome, so the archive reports what
a device sustained and, next to it, how far that is from the vendor's figure. A wrong peak would
make every ratio wrong, so this table is deliberately small and conservative:

- Only dense figures. NVIDIA's datasheets print tensor-core figures "with sparsity" (2:4
  structured), which no dense matmul reaches. Where a datasheet prints the dense figure too (A100,
  L40S) that is the one here; where it prints only the sparse one (H100, H200) the dense figure is
  half of it (H100 SXM BF16: 1,979 TFLOPS with sparsity -> 989.5 TFLOPS dense).
- ``fp32`` is the non-tensor FP32 figure: the probe's fp32 matmul runs with TF32 switched off;
  ``tf32`` is the TF32 tensor-core figure. ``int8`` is in OP/s (TOPS), which the probe counts as
  it counts FLOP (2 m n k per multiply) and reports under its unit, FLOP/s.
- ``membw`` is the memory bandwidth of the datasheet in B/s (decimal: 1 TB/s = 1e12 B/s).
- A variant whose figures differ from its family's (H100 NVL, H200 NVL, ...) is listed explicitly
  with no figure, so that a substring match on a sibling's name never lends it the wrong ceiling;
  an A100 whose name does not say which card it is gets the compute figures (the same on every
  A100) but no bandwidth. Unknown models, workloads and precisions give None.

Sources (the figures are the boost-clock peaks the datasheets print):
- NVIDIA H100 Tensor Core GPU datasheet (H100 SXM and H100 PCIe columns).
- NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column).
- NVIDIA A100 Tensor Core GPU datasheet (compute is the same for the SXM4 and PCIe cards; the
  bandwidth depends on the card: 40GB PCIe/SXM 1,555 GB/s, 80GB PCIe 1,935 GB/s, 80GB SXM
  2,039 GB/s).
- NVIDIA L40S datasheet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

TERA = 1e12
GIGA = 1e9

# The unit each workload's spec figures are in; a result in another unit gets no ratio.
SPEC_UNITS = {"matmul": "FLOP/s", "membw": "B/s"}


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """The published peaks of one model (or variant): dense matmul per precision, and memory
    bandwidth."""

    name: str
    matmul: Mapping[str, float] = field(default_factory=dict)
    memory_bandwidth: float | None = None


def _half(sparse_tera: float) -> float:
    """The dense figure of a datasheet that prints only the with-sparsity one (in T(FL)OPS)."""
    return sparse_tera / 2 * TERA


_H100_SXM_MATMUL = {
    "fp32": 67 * TERA,
    "tf32": _half(989),
    "bf16": _half(1979),
    "fp16": _half(1979),
    "fp8": _half(3958),
    "int8": _half(3958),
}
_H100_PCIE_MATMUL = {
    "fp32": 51 * TERA,
    "tf32": _half(756),
    "bf16": _half(1513),
    "fp16": _half(1513),
    "fp8": _half(3026),
    "int8": _half(3026),
}
# Dense figures as printed; Ampere has no FP8.
_A100_MATMUL = {
    "fp32": 19.5 * TERA,
    "tf32": 156 * TERA,
    "bf16": 312 * TERA,
    "fp16": 312 * TERA,
    "int8": 624 * TERA,
}
_L40S_MATMUL = {
    "fp32": 91.6 * TERA,
    "tf32": 183 * TERA,
    "bf16": 362.05 * TERA,
    "fp16": 362.05 * TERA,
    "fp8": 733 * TERA,
    "int8": 733 * TERA,
}

# Matched in order against the NVML model name (case-insensitively): the first pattern that is a
# substring wins, so a specific variant comes before its family. NVML names, e.g.:
# "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200",
# "NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB",
# "NVIDIA A100 80GB PCIe", "NVIDIA L40S".
_TABLE: tuple[tuple[str, GpuSpec | None], ...] = (
    # A MIG instance ("NVIDIA A100-SXM4-40GB MIG 1g.5gb") has a slice of the GPU, not its peak.
    (" MIG", None),
    # H100 NVL (94 GB, other clocks and bandwidth): not in this table.
    ("H100 NVL", None),
    ("H100 PCIe", GpuSpec("NVIDIA H100 PCIe", _H100_PCIE_MATMUL, 2.0 * TERA)),
    # The SXM5 80GB card; other H100 names (64 GB and 94 GB variants, ...) are left unknown.
    ("H100 80GB HBM3", GpuSpec("NVIDIA H100 SXM", _H100_SXM_MATMUL, 3.35 * TERA)),
    ("H100", None),
    ("H200 NVL", None),
    # H200 SXM: the H100 SXM compute figures, with 141 GB of HBM3e at 4.8 TB/s.
    ("H200", GpuSpec("NVIDIA H200 SXM", _H100_SXM_MATMUL, 4.8 * TERA)),
    ("A100-SXM4-80GB", GpuSpec("NVIDIA A100 SXM4 80GB", _A100_MATMUL, 2039 * GIGA)),
    ("A100-SXM4-40GB", GpuSpec("NVIDIA A100 SXM4 40GB", _A100_MATMUL, 1555 * GIGA)),
    ("A100-PCIE-40GB", GpuSpec("NVIDIA A100 PCIe 40GB", _A100_MATMUL, 1555 * GIGA)),
    ("A100 80GB PCIe", GpuSpec("NVIDIA A100 PCIe 80GB", _A100_MATMUL, 1935 * GIGA)),
    # Any other A100 name: the compute figures are those of every A100, the bandwidth is unknown.
    ("A100", GpuSpec("NVIDIA A100", _A100_MATMUL, None)),
    ("L40S", GpuSpec("NVIDIA L40S", _L40S_MATMUL, 864 * GIGA)),
)


def gpu_spec(device_model: str | None) -> GpuSpec | None:
    """The spec of the model NVML names ``device_model``; None for a model not in the table."""
    if not device_model:
        return None
    name = device_model.casefold()
    for pattern, spec in _TABLE:
        if pattern.casefold() in name:
            return spec
    return None


def spec_peak(
    device_model: str | None, workload: str, precision: str, unit: str | None = None
) -> float | None:
    """The published dense peak for this model, workload and precision, in the workload's unit.

    None where it is not known: an unknown model, a workload with no spec figure (attention,
    inference, h2d, ...), a precision the model's datasheet gives no figure for, or a result in
    another unit than the spec's (``unit``, when given), which no ratio could compare.
    """
    spec = gpu_spec(device_model)
    expected_unit = SPEC_UNITS.get(workload)
    if spec is None or expected_unit is None:
        return None
    if unit is not None and unit != expected_unit:
        return None
    if workload == "membw":
        return spec.memory_bandwidth
    return spec.matmul.get(precision)
