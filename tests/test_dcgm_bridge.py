"""The DCGM bridge (deploy/prometheus/dcgm-bridge.yml) against promtool, the catalogue and its page.

- `promtool check rules` and its unit tests (deploy/prometheus/tests/dcgm_bridge.yml, which
  test_rules.py runs with the others too); every rule of the bridge is evaluated by a
  `promql_expr_test` there.
- It reads only catalogued sustain series, with labels they have, and none of its names is a
  rule of rules.yml (the two files are loaded side by side).
- docs/dcgm-bridge.md accounts for every field of dcgm-exporter's default lists: bridged (a rule
  of that name) or not bridged, with the reason. The end-to-end check, queries written the way
  NVIDIA's dashboard writes them against a real Prometheus, is in test_prometheus_e2e.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_rules import (
    IDENTIFIER,
    MATCHER,
    ROOT,
    SELECTOR,
    STRING,
    TARGET_LABELS,
    _catalogue,
    _load_yaml,
    _rules,
    _run_promtool,
)

BRIDGE = ROOT / "deploy" / "prometheus" / "dcgm-bridge.yml"
BRIDGE_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "dcgm_bridge.yml"
PAGE = ROOT / "docs" / "dcgm-bridge.md"

# The fields dcgm-exporter collects out of the box: the uncommented lines of its
# etc/default-counters.csv (the binary's default) and those etc/dcp-metrics-included.csv (what its
# container image and Helm chart load) adds; DCGM_FI_DRIVER_VERSION there is a label.
DEFAULT_COUNTERS = (
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_MEM_CLOCK",
    "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_PCIE_TX_THROUGHPUT",
    "DCGM_FI_DEV_PCIE_RX_THROUGHPUT",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_ENC_UTIL",
    "DCGM_FI_DEV_DEC_UTIL",
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
)
DCP_METRICS_INCLUDED = (
    "DCGM_FI_DEV_FB_RESERVED",
    "DCGM_FI_DEV_RETIRED_SBE",
    "DCGM_FI_DEV_RETIRED_DBE",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    "DCGM_FI_PROF_DRAM_ACTIVE",
    "DCGM_FI_PROF_PCIE_TX_BYTES",
    "DCGM_FI_PROF_PCIE_RX_BYTES",
)
# The labels dcgm-exporter puts on a GPU's series (its Hostname from the node it runs on).
DCGM_LABELS = ("gpu", "UUID", "device", "modelName", "pci_bus_id", "Hostname")


def _records() -> dict[str, str]:
    return {
        rule["record"]: str(rule["expr"])
        for group in _load_yaml(BRIDGE)["groups"]
        for rule in group["rules"]
    }


def _page_table(heading: str) -> dict[str, str]:
    """Field -> the rest of its row, from the table under a heading of docs/dcgm-bridge.md."""
    text = PAGE.read_text(encoding="utf-8")
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(DCGM_[A-Z0-9_]+)` \|(.*)$", section, re.M)
    assert rows, f"docs/dcgm-bridge.md has no table under '## {heading}'"
    return dict(rows)


def test_promtool_checks_the_bridge_and_runs_its_tests() -> None:
    _run_promtool("check", "rules", str(BRIDGE.relative_to(ROOT)))
    _run_promtool("test", "rules", str(BRIDGE_TESTS.relative_to(ROOT)))


def test_every_rule_is_evaluated_by_a_test() -> None:
    suite = _load_yaml(BRIDGE_TESTS)
    loaded = {(BRIDGE_TESTS.parent / name).resolve() for name in suite["rule_files"]}
    assert BRIDGE.resolve() in loaded
    tested = {
        token
        for case in suite["tests"]
        for check in case.get("promql_expr_test", [])
        for token in IDENTIFIER.findall(STRING.sub("", check["expr"]))
    }
    untested = sorted(set(_records()) - tested)
    assert not untested, f"no promql_expr_test evaluates {untested}"


def test_reads_catalogued_series_with_their_labels_and_clashes_with_no_rule() -> None:
    records = _records()
    catalogue = _catalogue()
    problems = [
        f"{name} is a rule of rules.yml too" for name in records if name in _rules().records
    ]
    for name, expr in records.items():
        code = STRING.sub('""', expr)
        for token in IDENTIFIER.findall(code):
            if token.startswith("sustain_") and token not in catalogue:
                problems.append(f"{name}: {token} is not in docs/metrics.md")
            elif ":" in token and token not in records:
                problems.append(f"{name}: {token} is no rule of the bridge")
        for match in SELECTOR.finditer(code):
            family, matchers = match.groups()
            for label in MATCHER.findall(matchers):
                if family in catalogue and label not in catalogue[family] | TARGET_LABELS:
                    problems.append(f"{name}: {family} has no label {label} in docs/metrics.md")
    assert not problems, "\n".join(problems)


def test_every_field_gets_the_dcgm_labels() -> None:
    for name, expr in _records().items():
        if name.startswith("DCGM_"):
            assert "instance_device:sustain_gpu_info:dcgm_labels" in expr, name
            assert "max without (uuid" in expr, f"{name} keeps sustain's uuid label"
    labels = _records()["instance_device:sustain_gpu_info:dcgm_labels"]
    for label in (*DCGM_LABELS, "DCGM_FI_DRIVER_VERSION"):
        assert label in labels, label


def test_the_page_accounts_for_every_default_field() -> None:
    bridged = _page_table("What maps to what")
    skipped = _page_table("Not bridged")
    fields = {name for name in _records() if name.startswith("DCGM_")}
    assert set(bridged) == fields, "the table of mapped fields and the rules differ"
    assert not set(bridged) & set(skipped)
    unaccounted = [
        name
        for name in (*DEFAULT_COUNTERS, *DCP_METRICS_INCLUDED)
        if name not in {*bridged, *skipped}
    ]
    assert not unaccounted, f"docs/dcgm-bridge.md says nothing of {unaccounted}"
    for name, row in skipped.items():
        assert len(row.strip(" |")) > 20, f"{name}: no reason given"


def test_the_docs_tell_how_to_load_it() -> None:
    page = PAGE.read_text(encoding="utf-8")
    assert "dcgm-bridge.yml" in page
    assert "rule_files:" in page
    for path in (ROOT / "docs" / "deploy.md", ROOT / "README.md"):
        assert "dcgm-bridge.md" in Path(path).read_text(encoding="utf-8"), path
