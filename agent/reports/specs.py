"""Published peak throughput of the GPU models we know, for the ratio achieved / spec peak.

Principle 2 of the design: a spec sheet is a ceiling, not an outcome, so the archive reports what
a device sustained and, next to it, how far that is from the vendor's figure. A wrong peak would
make every ratio wrong, so this table is deliberately small and conservative:

- Only dense figures. NVIDIA's datasheets print tensor-core figures "with sparsity" (2:4
  structured), which no dense matmul reaches. Where a datasheet prints the dense figure too (A100,
  A10, L40S, MI300X) that is the one here; where it prints only the sparse one (H100, H200, GH200,
  L4, Blackwell) the dense figure is half of it (H100 SXM BF16: 1,979 TFLOPS with sparsity ->
  989.5 TFLOPS dense).
- ``fp32`` is the non-tensor FP32 figure: the probe's fp32 matmul runs with TF32 switched off;
  ``tf32`` is the TF32 tensor-core figure. ``int8`` is in OP/s (TOPS), which the probe counts as
  it counts FLOP (2 m n k per multiply) and reports under its unit, FLOP/s.
- ``membw`` is the memory bandwidth of the datasheet in B/s (decimal: 1 TB/s = 1e12 B/s).
- A model is known by its exact name, as NVML reports it (amdsmi for AMD), after folding case and
  runs of whitespace and dropping NVML's "NVIDIA " prefix (older drivers print none). Each entry
  lists the names it answers to. Nothing else matches: a variant whose figures differ from its
  family's (H100 NVL, H200 NVL, GH200 with other memory, ...), a MIG instance ("NVIDIA
  A100-SXM4-40GB MIG 1g.5gb", a slice of the GPU) and a model not listed get None, never a
  sibling's ceiling (a substring match once lent "NVIDIA GH200 480GB" the H200's 4.8 TB/s).
- A figure the vendor does not settle is left out (None), not guessed: where two revisions of
  NVIDIA's pages print different values (B200 and GB200 FP32, B200 bandwidth), or where no vendor
  datasheet is published (H20). Unknown models, workloads and precisions give None.

Sources (the figures are the boost-clock peaks the datasheets print); each entry names its own:
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


# Also the GH200's GPU: the GH200 Grace Hopper Superchip datasheet prints the H100 SXM figures.
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
# NVIDIA A10 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/products/a10-gpu/): the dense
# figures as printed beside the sparse ones (FP32 31.2 TF; TF32 62.5 | 125*; BF16 and FP16
# 125 | 250*; INT8 250 | 500* TOPS); Ampere has no FP8. 600 GB/s of GDDR6.
_A10_MATMUL = {
    "fp32": 31.2 * TERA,
    "tf32": 62.5 * TERA,
    "bf16": 125 * TERA,
    "fp16": 125 * TERA,
    "int8": 250 * TERA,
}
# NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4/): FP32 30.3 TF; the tensor
# figures only with sparsity (TF32 120, BF16 and FP16 242, FP8 485, INT8 485 TOPS). 300 GB/s.
_L4_MATMUL = {
    "fp32": 30.3 * TERA,
    "tf32": _half(120),
    "bf16": _half(242),
    "fp16": _half(242),
    "fp8": _half(485),
    "int8": _half(485),
}
# HGX B200, per GPU (NVIDIA Blackwell architecture page, nvidia.com/en-us/data-center/
# technologies/blackwell-architecture/, "HGX B200" column; the same in the Blackwell technical
# brief): with sparsity TF32 2.2 PF, BF16 and FP16 4.5 PF, FP8 9 PF, INT8 9 POPS. FP32 is left
# out: the page prints 75 TF where the brief printed 80 TF.
_B200_MATMUL = {
    "tf32": _half(2200),
    "bf16": _half(4500),
    "fp16": _half(4500),
    "fp8": _half(9000),
    "int8": _half(9000),
}
# GB200, per GPU (the same page, "GB200 NVL72" column, individual GPU): with sparsity TF32 2.5 PF,
# BF16 and FP16 5 PF, FP8 10 PF, INT8 10 POPS. FP32 is left out: 80 TF on the page, 90 TF (180 TF
# per two-GPU superchip) on the earlier GB200 NVL72 page.
_GB200_MATMUL = {
    "tf32": _half(2500),
    "bf16": _half(5000),
    "fp16": _half(5000),
    "fp8": _half(10000),
    "int8": _half(10000),
}
# HGX B300 (nvidia.com/en-us/data-center/hgx/, "HGX B300" column, eight GPUs): with sparsity TF32
# 18 PF, BF16 and FP16 36 PF, FP8 72 PF; FP32 600 TF; here per GPU. INT8 is left out: the table
# prints 2 POPS for the eight, which no other NVIDIA figure for Blackwell Ultra confirms.
_B300_MATMUL = {
    "fp32": 600 / 8 * TERA,
    "tf32": _half(18000 / 8),
    "bf16": _half(36000 / 8),
    "fp16": _half(36000 / 8),
    "fp8": _half(72000 / 8),
}
# AMD Instinct MI300X data sheet (amd.com/content/dam/amd/en/documents/instinct-tech-docs/
# data-sheets/amd-instinct-mi300x-data-sheet.pdf): dense peaks as printed beside the sparse ones
# (FP32 vector 163.4 TF, TF32 653.7 TF, BF16 and FP16 1,307.4 TF, FP8 2,614.9 TF, INT8
# 2,614.9 TOPS); 5.3 TB/s of HBM3.
_MI300X_MATMUL = {
    "fp32": 163.4 * TERA,
    "tf32": 653.7 * TERA,
    "bf16": 1307.4 * TERA,
    "fp16": 1307.4 * TERA,
    "fp8": 2614.9 * TERA,
    "int8": 2614.9 * TERA,
}

# Each entry with the device names it answers to, as NVML (amdsmi for AMD) reports them.
_TABLE: tuple[tuple[GpuSpec, tuple[str, ...]], ...] = (
    (GpuSpec("NVIDIA H100 PCIe", _H100_PCIE_MATMUL, 2.0 * TERA), ("NVIDIA H100 PCIe",)),
    # The SXM5 80GB card; other H100 names (64 GB and 94 GB variants, NVL, ...) are left unknown.
    (GpuSpec("NVIDIA H100 SXM", _H100_SXM_MATMUL, 3.35 * TERA), ("NVIDIA H100 80GB HBM3",)),
    # H200 SXM: the H100 SXM compute figures, with 141 GB of HBM3e at 4.8 TB/s. H200 NVL unknown.
    (GpuSpec("NVIDIA H200 SXM", _H100_SXM_MATMUL, 4.8 * TERA), ("NVIDIA H200",)),
    # NVIDIA GH200 Grace Hopper Superchip datasheet (nvidia.com/en-us/data-center/
    # grace-hopper-superchip/): the H100 SXM compute figures; 96 GB of HBM3 at 4 TB/s, or 144 GB
    # of HBM3e at 4.9 TB/s. "480GB" is the Grace's LPDDR5X beside the 96 GB HBM3 GPU.
    (GpuSpec("NVIDIA GH200 96GB HBM3", _H100_SXM_MATMUL, 4.0 * TERA), ("NVIDIA GH200 480GB",)),
    (
        GpuSpec("NVIDIA GH200 144GB HBM3e", _H100_SXM_MATMUL, 4.9 * TERA),
        ("NVIDIA GH200 144G HBM3e",),
    ),
    # Bandwidth left out: 7.7 TB/s on the Blackwell architecture page, 8 TB/s in the Blackwell
    # technical brief and 64 TB/s for eight in the DGX B200 datasheet.
    (GpuSpec("NVIDIA B200", _B200_MATMUL, None), ("NVIDIA B200",)),
    # 186 GB of HBM3e at 8 TB/s per GPU (Blackwell architecture page, GB200 NVL72 column).
    (GpuSpec("NVIDIA GB200", _GB200_MATMUL, 8.0 * TERA), ("NVIDIA GB200",)),
    # 288 GB of HBM3e at 8 TB/s (NVIDIA technical blog "Inside NVIDIA Blackwell Ultra: The Chip
    # Powering the AI Factory Era", developer.nvidia.com/blog/).
    (GpuSpec("NVIDIA B300", _B300_MATMUL, 8.0 * TERA), ("NVIDIA B300 SXM6 AC",)),
    # NVIDIA publishes no datasheet for the H20; the figures going round (148 TFLOPS BF16,
    # 4.0 TB/s) are the press's, not the vendor's, so the model is known and has no figure.
    (GpuSpec("NVIDIA H20"), ("NVIDIA H20",)),
    (
        GpuSpec("NVIDIA A100 SXM4 80GB", _A100_MATMUL, 2039 * GIGA),
        ("NVIDIA A100-SXM4-80GB",),
    ),
    (
        GpuSpec("NVIDIA A100 SXM4 40GB", _A100_MATMUL, 1555 * GIGA),
        ("NVIDIA A100-SXM4-40GB",),
    ),
    (
        GpuSpec("NVIDIA A100 PCIe 40GB", _A100_MATMUL, 1555 * GIGA),
        ("NVIDIA A100-PCIE-40GB",),
    ),
    (
        GpuSpec("NVIDIA A100 PCIe 80GB", _A100_MATMUL, 1935 * GIGA),
        ("NVIDIA A100 80GB PCIe",),
    ),
    # An A100 whose name does not say which datasheet card it is ("A100-SXM-80GB", on some HGX
    # boards): the compute figures of every A100, the bandwidth unknown.
    (GpuSpec("NVIDIA A100", _A100_MATMUL, None), ("NVIDIA A100-SXM-80GB",)),
    (GpuSpec("NVIDIA L40S", _L40S_MATMUL, 864 * GIGA), ("NVIDIA L40S",)),
    (GpuSpec("NVIDIA A10", _A10_MATMUL, 600 * GIGA), ("NVIDIA A10",)),
    (GpuSpec("NVIDIA L4", _L4_MATMUL, 300 * GIGA), ("NVIDIA L4",)),
    (GpuSpec("AMD Instinct MI300X", _MI300X_MATMUL, 5.3 * TERA), ("AMD Instinct MI300X",)),
)


def _normalized(device_model: str) -> str:
    """The name as compared: case and runs of whitespace folded, NVML's "NVIDIA " prefix dropped
    (older drivers printed "A100-SXM4-40GB" for what newer ones call "NVIDIA A100-SXM4-40GB")."""
    return " ".join(device_model.split()).casefold().removeprefix("nvidia ")


def _by_name(table: tuple[tuple[GpuSpec, tuple[str, ...]], ...]) -> dict[str, GpuSpec]:
    """The entries by normalized name; a name listed twice would make the answer depend on order,
    so it is refused."""
    index: dict[str, GpuSpec] = {}
    for spec, names in table:
        for name in names:
            key = _normalized(name)
            if key in index:
                raise ValueError(f"GPU model name {name!r} is listed twice")
            index[key] = spec
    return index


_BY_NAME = _by_name(_TABLE)


def gpu_spec(device_model: str | None) -> GpuSpec | None:
    """The spec of the model NVML names ``device_model``; None for a name not in the table."""
    if not device_model:
        return None
    return _BY_NAME.get(_normalized(device_model))


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
