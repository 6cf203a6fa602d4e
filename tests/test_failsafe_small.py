"""Fail safe, the smaller items (issue 26, items 7 and 8), with real components.

- `sustain health` against an agent behind TLS and basic auth: credentials from the environment
  or a file, never the command line (a real `sustain run` on the fake driver, real certificates).
- A GPU time-sliced among 5,000 containers (a real gRPC kubelet): a bounded exposition, names cut.
- A second agent on one data directory: refused in one line, exit 2; a killed agent's lock does
  not hold the next one up.
- Control characters in an NVML string (the fake driver's device name) are escaped in the log.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import test_occupancy
import test_security
from conftest import Running, free_port, start_agent
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_daemon import quick_env, ready, run_to_exit
from test_health_integrations import AGENT_CONFIG, HEALTHY_NODE, SUSTAIN, plain_env
from test_occupancy import GPU1, Kubelet, Pod, _Status, gpu_sample
from test_security import (
    PASSWORD,
    PASSWORD_HASH,
    USER,
    Pki,
    basic,
    client_context,
    wait_https,
    write_web_config,
)

from agent.config.archive_section import OccupancySection
from agent.occupancy.tracker import Occupancy

# Fixtures of other modules, found by these names.
agents = test_security.agents
pki = test_security.pki
socket_dir = test_occupancy.socket_dir

# The documented limits (docs/health.md, "Who was running").
MAX_LABEL_CHARS = 128
MAX_PODS_PER_DEVICE = 100


def fake_gpu_env(directory: Path, fake_nvml: Path, scenario: str) -> dict[str, str]:
    (directory / "node.scn").write_text(scenario, encoding="utf-8")
    return quick_env(
        directory,
        LD_LIBRARY_PATH=str(fake_nvml.parent),
        FAKENVML_SCENARIO=str(directory / "node.scn"),
    )


# 7. `sustain health` with credentials


def health(*args: str, **env: str) -> tuple[int, dict[str, Any], str]:
    done = subprocess.run(
        [str(SUSTAIN), "health", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=plain_env(**env),
        check=False,
    )
    found = json.loads(done.stdout) if done.stdout.startswith("{") else {}
    return done.returncode, found, done.stderr


@pytest.mark.slow
def test_health_asks_an_agent_behind_tls_and_basic_auth(
    pki: Pki, fake_nvml: Path, tmp_path: Path, agents: list[Running]
) -> None:
    web = write_web_config(
        tmp_path,
        f"tls_server_config:\n  cert_file: {pki.server_crt}\n  key_file: {pki.server_key}\n"
        f"basic_auth_users:\n  {USER}: {PASSWORD_HASH}\n",
    )
    config = tmp_path / "sustain.toml"
    config.write_text(f'[exporter]\nweb_config_file = "{web}"\n\n{AGENT_CONFIG}')
    config.chmod(0o600)
    running = start_agent(
        tmp_path, "--config", str(config), env=fake_gpu_env(tmp_path, fake_nvml, HEALTHY_NODE)
    )
    agents.append(running)
    wait_https(running, client_context(pki), basic(USER, PASSWORD))
    common = (
        "--config",
        str(config),
        "--data-dir",
        str(tmp_path),
        "--metrics",
        f"https://127.0.0.1:{running.port}/metrics",
        "--ca-file",
        str(pki.ca_crt),
    )

    code, found, err = health(*common)
    assert found["source"] == "archive", (found, err)
    assert "HTTP 401" in found["note"], found
    assert "--user" in found["note"], found

    for _ in range(30):  # the health series follow the first evaluation after start-up
        code, found, err = health(*common, "--user", USER, SUSTAIN_HEALTH_PASSWORD=PASSWORD)
        if found.get("source") == "live":
            break
    assert (code, found["source"], found["state"]) == (0, "live", "healthy"), (found, err)
    assert [d["device"] for d in found["devices"]] == ["0", "1", "cpu"], found

    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    code, found, err = health(*common, "--user", USER, "--password-file", str(password_file))
    assert (code, found["source"]) == (0, "live"), (found, err)

    password_file.write_text("wrong\n")
    code, found, err = health(*common, "--user", USER, "--password-file", str(password_file))
    assert found["source"] == "archive", (found, err)
    assert "HTTP 401" in found["note"], found
    assert "refused" in found["note"], found

    code, found, err = health(*common, "--user", USER)  # no password anywhere
    assert (code, found) == (2, {}), err
    assert err.splitlines() == [
        f"sustain: error: --user {USER} needs a password: SUSTAIN_HEALTH_PASSWORD is empty or unset"
    ]
    code, _, err = running.terminate()
    assert code == 0, err
    assert PASSWORD not in err


# 8. Smaller: 5,000 containers on one GPU


def test_five_thousand_containers_on_one_gpu_make_a_bounded_exposition(
    socket_dir: Path, tmp_path: Path
) -> None:
    """Time-slicing hands out replicas ("GPU-...::N"), two per container here: every container
    counted once, at most MAX_PODS_PER_DEVICE of them named, no label longer than the cap."""
    long = "p" * 300
    pods: list[Pod] = [
        ("ml", f"{long if n < 3 else 'train'}-{n:04d}", "main", "nvidia.com/gpu", [f"{GPU1}::{n}"])
        for n in range(5000)
    ]
    pods += [
        (ns, pod, ctr, res, [f"{GPU1}::{5000 + n}"])
        for n, (ns, pod, ctr, res, _) in enumerate(pods)
    ]
    kubelet = Kubelet(socket_dir / "kubelet.sock", pods)
    occupancy = Occupancy(OccupancySection(pod_resources_socket=kubelet.socket), tmp_path)
    try:
        occupancy.record(gpu_sample(1, GPU1))
        occupancy.watch.poll_once()
    finally:
        kubelet.stop()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Status(occupancy))
    families = {
        f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())
    }
    info = families["sustain_device_pod_info"].samples
    assert len(info) == MAX_PODS_PER_DEVICE
    (count,) = families["sustain_podresources_device_containers"].samples
    assert (count.labels, count.value) == ({"device": "1", "uuid": GPU1}, 5000.0)
    longest = max(len(value) for sample in info for value in sample.labels.values())
    assert longest == MAX_LABEL_CHARS
    cut = [s.labels["pod"] for s in info if "..." in s.labels["pod"]]
    assert cut == ["p" * 62 + "..." + "p" * 58 + f"-{n:04d}" for n in range(3)]
    # The events' attributes name every container once, with the same cut names.
    occupants = occupancy.occupants(GPU1)
    assert len(occupants) == 5000
    assert max(len(o.pod) for o in occupants) == MAX_LABEL_CHARS


# 8. Smaller: one agent per data directory


@pytest.mark.slow
def test_a_second_agent_on_the_same_data_directory_is_refused(
    tmp_path: Path, agents: list[Running]
) -> None:
    first = start_agent(tmp_path, env=quick_env(tmp_path))
    agents.append(first)
    ready(first)
    second = run_to_exit("--listen", f"127.0.0.1:{free_port()}", "--data-dir", str(tmp_path))
    assert second.returncode == 2, second.stderr
    # Refused before anything else: no log line, the archive and spool untouched.
    assert second.stderr.splitlines() == [
        f"sustain: error: another sustain agent (pid {first.process.pid}) runs on the data "
        f"directory {tmp_path} (it holds {tmp_path / 'sustain.lock'}); give this one its own "
        "agent.data_dir"
    ]
    # A killed agent leaves its lock file, not its lock: the next one starts.
    first.process.kill()
    first.process.communicate()
    after = start_agent(tmp_path, env=quick_env(tmp_path))
    agents.append(after)
    ready(after)
    code, _, err = after.terminate()
    assert code == 0, err
    assert (tmp_path / "sustain.lock").read_text() == f"{after.process.pid}\n"


# 8. Smaller: control characters in the log


@pytest.mark.slow
def test_control_characters_from_nvml_are_escaped_in_the_log(
    fake_nvml: Path, tmp_path: Path, agents: list[Running]
) -> None:
    hostile = HEALTHY_NODE.replace('"NVIDIA H100 80GB HBM3"', '"NVIDIA\x1b[2J H100\rforged\x07"', 1)
    running = start_agent(tmp_path, env=fake_gpu_env(tmp_path, fake_nvml, hostile))
    agents.append(running)
    ready(running)
    code, _, err = running.terminate()
    assert code == 0, err
    assert "NVIDIA\\x1b[2J H100\\x0dforged\\x07, NVIDIA H100 80GB HBM3" in err, err
    raw = [c for c in err if c < " " and c not in "\t\n"]
    assert raw == [], raw
