"""Stack snapshots: NVML facts through the real pynvml bindings on the fake driver, host facts
from a procfs fixture tree, torch facts as the probe child reports them."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import start_agent
from sqlalchemy import text
from test_daemon import STARTUP_SECONDS
from test_database_urls import forked_sustain

from agent.archive.database import open_engine
from collectors.nvml.library import NvmlLibrary
from collectors.stack import StackSnapshot, capture, describe_diff, diff

PROC = Path(__file__).parent / "fixtures" / "host" / "proc"

SCENARIO = """
set driver_version 550.54.15
set nvml_version 12.550.54.15
set cuda_driver_version 12040
device 0 name "NVIDIA H100 80GB HBM3" uuid GPU-00000000-1111-2222-3333-444444444444 serial 1
device 1 name "NVIDIA H100 80GB HBM3" uuid GPU-55555555-6666-7777-8888-999999999999 serial 2
device 1 vbios_version 96.00.9A.00.01
device 0 power_limit_mw 650000 max_pcie_gen 5 max_pcie_width 16
at 0 0 pcie_gen 4 pcie_width 8
"""

TORCH = {
    "torch": "2.4.1",
    "python": "3.11.7",
    "backends": {
        "cuda": "12.4",
        "hip": None,
        "cudnn": 90100,
        "nccl": "2.20.5",
        "tf32_matmul": False,
        "sdpa": {"flash": True, "mem_efficient": True, "math": True, "cudnn": False},
    },
    "device": {"memory_free_bytes": 123},
    "threads": 2,
    "interop_threads": 2,
}


@pytest.fixture
def nvml(fake_nvml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NvmlLibrary]:
    path = tmp_path / "scenario.scn"
    path.write_text(SCENARIO)
    monkeypatch.setenv("FAKENVML_SCENARIO", str(path))
    library = NvmlLibrary()
    yield library
    library.shutdown()


@pytest.fixture
def procfs(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    shutil.copytree(PROC, root)
    (root / "sys" / "kernel").mkdir(parents=True)
    (root / "sys" / "kernel" / "osrelease").write_text("6.8.0-45-generic\n")
    return root


@pytest.fixture
def take(procfs: Path, tmp_path: Path) -> Callable[..., StackSnapshot]:
    def take(**kwargs: Any) -> StackSnapshot:
        kwargs = {"torch_facts": TORCH, "nvml": None, "environ": {}, **kwargs}
        return capture(procfs=procfs, sysfs=tmp_path / "sys", **kwargs)

    return take


def test_nvml_facts_from_the_scenario(
    nvml: NvmlLibrary, take: Callable[..., StackSnapshot]
) -> None:
    facts = take(nvml=nvml).facts
    assert facts["driver"] == {
        "version": "550.54.15",
        "nvml_version": "12.550.54.15",
        "cuda_version": "12.4",
    }
    assert facts["gpu_count"] == 2
    gpu0, gpu1 = facts["gpus"]
    assert gpu0["model"] == "NVIDIA H100 80GB HBM3"
    assert gpu0["vbios"] == "96.00.99.00.01"
    assert gpu1["vbios"] == "96.00.9A.00.01"
    assert gpu0["power_limit_watts"] == 650.0
    assert gpu0["pcie"] == {"generation_max": 5, "width_max": 16}  # current: telemetry only
    # Functions the fake driver lacks read as absent, never as a value.
    assert gpu0["ecc_enabled"] is None
    assert gpu0["mig_enabled"] is False  # the fake answers nvmlDeviceGetMigMode: mig_mode 0
    assert gpu0["application_clock_hertz"] == {"sm": None, "memory": None}
    assert "GPU-0000" not in take(nvml=nvml).canonical_json()  # no per-machine identity


def test_host_and_torch_facts(take: Callable[..., StackSnapshot]) -> None:
    snapshot = take(sdpa_backend="flash", container_image="nvcr.io/nvidia/pytorch:24.05")
    facts = snapshot.facts
    assert facts["host"]["kernel"] == "6.8.0-45-generic"
    assert facts["host"]["cpu_model"] == "Intel(R) Core(TM) i7-8650U CPU @ 1.90GHz"
    assert facts["torch"]["version"] == "2.4.1"
    assert facts["torch"]["cudnn"] == 90100
    assert facts["torch"]["backends"]["sdpa"]["cudnn"] is False
    assert facts["sdpa_backend"] == "flash"
    assert facts["container_image"] == "nvcr.io/nvidia/pytorch:24.05"
    assert "memory_free_bytes" not in snapshot.canonical_json()


def test_container_image_from_the_environment(take: Callable[..., StackSnapshot]) -> None:
    facts = take(environ={"SUSTAIN_CONTAINER_IMAGE": "registry/img:1"}).facts
    assert facts["container_image"] == "registry/img:1"
    assert facts["environment"] == {}


def test_missing_osrelease_is_absent(tmp_path: Path) -> None:
    facts = capture(torch_facts=None, nvml=None, environ={}, procfs=PROC, sysfs=tmp_path).facts
    assert facts["host"]["kernel"] is None
    assert facts["host"]["cpu_model"] is not None


def test_without_nvml_or_torch(tmp_path: Path, procfs: Path) -> None:
    snapshot = capture(torch_facts=None, nvml=None, environ={}, procfs=procfs, sysfs=tmp_path)
    assert snapshot.facts["driver"] == {"version": None, "cuda_version": None, "nvml_version": None}
    assert snapshot.facts["gpus"] is None
    assert snapshot.facts["gpu_count"] is None
    assert snapshot.facts["torch"] is None
    assert len(snapshot.id) == 64


def test_driver_version_from_sysfs_without_nvml(tmp_path: Path, procfs: Path) -> None:
    (tmp_path / "module" / "nvidia").mkdir(parents=True)
    (tmp_path / "module" / "nvidia" / "version").write_text("550.54.15\n")
    facts = capture(torch_facts=None, nvml=None, environ={}, procfs=procfs, sysfs=tmp_path).facts
    assert facts["driver"]["version"] == "550.54.15"


def test_id_is_independent_of_dict_order(take: Callable[..., StackSnapshot]) -> None:
    reordered = dict(reversed(list(TORCH.items())))
    environ = {"OMP_NUM_THREADS": "8", "CUDA_VISIBLE_DEVICES": "0"}
    a = take(environ=environ)
    b = take(torch_facts=reordered, environ=dict(reversed(list(environ.items()))))
    assert a.id == b.id
    assert StackSnapshot(dict(reversed(list(a.facts.items())))).id == a.id


def test_changed_torch_version_changes_id_and_diff(take: Callable[..., StackSnapshot]) -> None:
    a = take()
    b = take(torch_facts={**TORCH, "torch": "2.5.0"})
    assert a.id != b.id
    changes = diff(a.facts, b.facts)
    assert changes == [("torch.version", "2.4.1", "2.5.0")]
    assert describe_diff(changes) == "torch.version: 2.4.1 -> 2.5.0"


def test_diff_paths_into_lists_sorted() -> None:
    a = {"gpus": [{"vbios": "96.00.99.00.01"}], "driver": {"version": "550.54"}, "torch": None}
    b = {"gpus": [{"vbios": "96.00.9A.00.01"}], "driver": {"version": "555.42"}, "torch": {"x": 1}}
    changes = diff(a, b)
    assert changes == [
        ("driver.version", "550.54", "555.42"),
        ("gpus.0.vbios", "96.00.99.00.01", "96.00.9A.00.01"),
        ("torch.x", None, 1),
    ]
    assert describe_diff(changes).splitlines()[2] == "torch.x: absent -> 1"


def test_secrets_never_enter(take: Callable[..., StackSnapshot]) -> None:
    environ = {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "NCCL_SOCKET_IFNAME": "eth0",
        "TORCH_HUB_TOKEN": "hf_tok_abc123",
        "NCCL_API_KEY": "nccl-key-xyz",
        "CUDA_SECRET": "s3cr3t-value",
        "TORCH_DB": "postgresql://u:hunter2@db/x",
        "TORCH_PLAIN_DB": "postgresql+psycopg://db.internal/x",
        "SUSTAIN_ARCHIVE__DATABASE_URL": "postgresql://u:pw@db/archive",
        "HOME": "/home/u",
    }
    snapshot = take(environ=environ)
    assert snapshot.facts["environment"] == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "NCCL_SOCKET_IFNAME": "eth0",
    }
    text = snapshot.canonical_json()
    for secret in ("hunter2", "hf_tok_abc123", "nccl-key-xyz", "s3cr3t-value", "postgresql"):
        assert secret not in text


SECRETS = {
    "CUDA_API_TOKEN": "tok-4f1c9e2a77",  # allow-listed prefix, credential-like name
    "NCCL_IB_PASSWORD": "pw-8d0b3c51e6",
    "TORCH_HUB_SECRET_KEY": "sk-93aa71d0c2",
    "CUDA_CACHE_URL": "postgresql://cache:pw-6e2f0b9d14@db.internal/cache",  # a URL with a password
}


@pytest.mark.slow
def test_credentials_never_reach_snapshot_archive_or_metrics(tmp_path: Path) -> None:
    """Acceptance 4: a real agent with credential-like allow-listed variables in its
    environment; none of their values is in /metrics, the archive, the spool or `stack show`."""
    env = {**SECRETS, "CUDA_CACHE_MAXSIZE": "4294967296"}
    running = start_agent(tmp_path, env=env)
    try:
        body = running.wait_for("sustain_stack_info{", timeout=STARTUP_SECONDS)
    finally:
        code, _, err = running.terminate()
    assert code == 0, err
    done = forked_sustain(["stack", "show", "--json"], {**os.environ, **env}, timeout=120)
    assert done.returncode == 0, done.stderr
    shown = done.stdout
    archived = b"".join(path.read_bytes() for path in tmp_path.glob("*.db*"))
    engine = open_engine(f"sqlite:///{tmp_path}/sustain.db")
    try:
        with engine.connect() as connection:
            (facts,) = connection.execute(text("SELECT facts FROM stack_snapshots")).one()
    finally:
        engine.dispose()
    # The allow-list works (a harmless variable is recorded) ...
    assert json.loads(facts)["environment"] == {"CUDA_CACHE_MAXSIZE": "4294967296"}
    assert json.loads(shown)["facts"]["environment"] == {"CUDA_CACHE_MAXSIZE": "4294967296"}
    # ... and no secret is anywhere: not by name, not by value.
    for name, value in SECRETS.items():
        secret = value.split(":pw-")[-1] if "://" in value else value
        for where, haystack in (
            ("/metrics", body),
            ("stack show", shown),
            ("the agent's log", err),
            ("the archive files", archived.decode("latin-1")),
        ):
            assert secret not in haystack, f"{name}'s value in {where}"
            assert name not in haystack, f"{name} in {where}"
