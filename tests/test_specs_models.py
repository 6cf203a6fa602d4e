"""A device model gets the published peaks of its own datasheet entry or none: names match exactly
(issue 25 item 5), so a sibling's name that contains a known one ("NVIDIA GH200 480GB" contains
"H200") is never lent that model's ceiling."""

from __future__ import annotations

import pytest

from agent.reports.specs import TERA, gpu_spec, spec_peak


def test_gh200_is_not_an_h200() -> None:
    """The defect: a substring match gave the GH200 the H200's 4.8 TB/s."""
    spec = gpu_spec("NVIDIA GH200 480GB")
    assert spec is not None
    assert spec.name == "NVIDIA GH200 96GB HBM3"
    assert spec.memory_bandwidth == pytest.approx(4.0e12)
    assert spec_peak("NVIDIA GH200 480GB", "membw", "fp32", "B/s") == pytest.approx(4.0e12)
    assert spec != gpu_spec("NVIDIA H200")


@pytest.mark.parametrize(
    ("model", "name", "membw"),
    [
        # The spellings NVML reports for the models the table had before.
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM", 3.35e12),
        ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe", 2.0e12),
        ("NVIDIA H200", "NVIDIA H200 SXM", 4.8e12),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 SXM4 80GB", 2039e9),
        ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 SXM4 40GB", 1555e9),
        ("NVIDIA A100-PCIE-40GB", "NVIDIA A100 PCIe 40GB", 1555e9),
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100 PCIe 80GB", 1935e9),
        ("NVIDIA L40S", "NVIDIA L40S", 864e9),
        # The models added with exact matching.
        ("NVIDIA GH200 144G HBM3e", "NVIDIA GH200 144GB HBM3e", 4.9e12),
        ("NVIDIA GB200", "NVIDIA GB200", 8.0e12),
        ("NVIDIA B300 SXM6 AC", "NVIDIA B300", 8.0e12),
        ("NVIDIA A10", "NVIDIA A10", 600e9),
        ("NVIDIA L4", "NVIDIA L4", 300e9),
        ("AMD Instinct MI300X", "AMD Instinct MI300X", 5.3e12),
    ],
)
def test_known_names(model: str, name: str, membw: float) -> None:
    spec = gpu_spec(model)
    assert spec is not None
    assert spec.name == name
    assert spec.memory_bandwidth == pytest.approx(membw)


@pytest.mark.parametrize(
    ("model", "precision", "peak"),
    [
        ("NVIDIA GH200 480GB", "bf16", 989.5e12),
        ("NVIDIA GH200 480GB", "fp32", 67e12),
        ("NVIDIA GH200 144G HBM3e", "fp8", 1979e12),
        ("NVIDIA B200", "bf16", 2250e12),
        ("NVIDIA B200", "fp8", 4500e12),
        ("NVIDIA B200", "tf32", 1100e12),
        ("NVIDIA GB200", "bf16", 2500e12),
        ("NVIDIA GB200", "int8", 5000e12),
        ("NVIDIA B300 SXM6 AC", "bf16", 2250e12),
        ("NVIDIA B300 SXM6 AC", "fp32", 75e12),
        ("NVIDIA B300 SXM6 AC", "tf32", 1125e12),
        ("NVIDIA A10", "fp32", 31.2e12),
        ("NVIDIA A10", "bf16", 125e12),
        ("NVIDIA A10", "int8", 250e12),
        ("NVIDIA L4", "tf32", 60e12),
        ("NVIDIA L4", "fp16", 121e12),
        ("NVIDIA L4", "fp8", 242.5e12),
        ("AMD Instinct MI300X", "fp32", 163.4e12),
        ("AMD Instinct MI300X", "bf16", 1307.4e12),
        ("AMD Instinct MI300X", "fp8", 2614.9e12),
    ],
)
def test_new_models_matmul_peaks(model: str, precision: str, peak: float) -> None:
    assert spec_peak(model, "matmul", precision, "FLOP/s") == pytest.approx(peak)


@pytest.mark.parametrize(
    ("model", "workload", "precision"),
    [
        # Figures the vendor does not settle are absent, not guessed.
        ("NVIDIA B200", "membw", "fp32"),
        ("NVIDIA B200", "matmul", "fp32"),
        ("NVIDIA GB200", "matmul", "fp32"),
        ("NVIDIA B300 SXM6 AC", "matmul", "int8"),
        ("NVIDIA H20", "matmul", "bf16"),
        ("NVIDIA H20", "membw", "fp32"),
        # No FP8 on Ampere.
        ("NVIDIA A10", "matmul", "fp8"),
    ],
)
def test_unsettled_figures_are_absent(model: str, workload: str, precision: str) -> None:
    assert gpu_spec(model) is not None
    assert spec_peak(model, workload, precision) is None


@pytest.mark.parametrize(
    "model",
    [
        "NVIDIA H200X",
        "NVIDIA H1000",
        "NVIDIA H200 NVL",
        "NVIDIA H100 NVL",
        "NVIDIA H100",
        "NVIDIA GH200",
        "NVIDIA GH200 120GB",
        "NVIDIA B200X",
        "NVIDIA A100",
        "NVIDIA A10G",
        "NVIDIA L40",
        "NVIDIA L4S",
        "NVIDIA H100 80GB HBM3 MIG",
        "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
        "AMD Instinct MI300A",
        "AMD Instinct MI300X VF",
        "Tesla V100-SXM2-16GB",
        "",
    ],
)
def test_unknown_names_get_nothing(model: str) -> None:
    assert gpu_spec(model) is None
    assert spec_peak(model, "membw", "fp32") is None
    assert spec_peak(model, "matmul", "bf16") is None


@pytest.mark.parametrize(
    "model",
    [
        "nvidia h100 80gb hbm3",
        "  NVIDIA   H100 80GB  HBM3 ",
        "H100 80GB HBM3",
        "NVIDIA\tH100 80GB HBM3",
    ],
)
def test_case_whitespace_and_prefix_are_folded(model: str) -> None:
    assert gpu_spec(model) == gpu_spec("NVIDIA H100 80GB HBM3")
    assert spec_peak(model, "membw", "fp32") == pytest.approx(3.35 * TERA)


def test_a100_of_unnamed_card_gets_compute_only() -> None:
    """ "A100-SXM-80GB" names no datasheet card: the compute of every A100, no bandwidth."""
    assert spec_peak("NVIDIA A100-SXM-80GB", "matmul", "bf16") == pytest.approx(312e12)
    assert spec_peak("NVIDIA A100-SXM-80GB", "membw", "fp32") is None
