"""The health integrations of deploy/ (docs/health.md, "Wiring it up"), run as the cluster's
tools run them.

- node-problem-detector: deploy/node-problem-detector/sustain-health.json against a JSON Schema
  of NPD's custom plugin monitor configuration (tests/data/npd-custom-plugin-monitor.schema.json)
  and the checks of NPD's own Validate (pkg/custompluginmonitor/types/config.go); then the rule's
  command run as pkg/custompluginmonitor/plugin/plugin.go runs it (the shorter of the rule's and
  the global timeout, standard output trimmed and cut to max_output_length, exit 0 OK, 1 NonOK,
  anything else Unknown) against a live agent on the fake NVML driver.
- Slurm: deploy/slurm/sustain-healthcheck.sh and the NHC check deploy/slurm/sustain.nhc as real
  processes, with stand-ins for `scontrol` (not installed here: Slurm itself is not exercised),
  `logger` and, for the decision table, `sustain`; shellcheck on both.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import Running, start_agent
from test_daemon import STARTUP_SECONDS, quick_env

ROOT = Path(__file__).resolve().parents[1]
NPD_CONFIG = ROOT / "deploy" / "node-problem-detector" / "sustain-health.json"
NPD_SCHEMA = ROOT / "tests" / "data" / "npd-custom-plugin-monitor.schema.json"
HEALTHCHECK = ROOT / "deploy" / "slurm" / "sustain-healthcheck.sh"
NHC_CHECK = ROOT / "deploy" / "slurm" / "sustain.nhc"
# Where deploy/container/Dockerfile and deploy/systemd/sustain.service install the command.
INSTALLED_SUSTAIN = "/opt/sustain/.venv/bin/sustain"
SUSTAIN = Path(sys.executable).parent / "sustain"

# NPD's defaults (ApplyConfiguration) and limits (plugin.go).
NPD_DEFAULT_TIMEOUT = 5.0
NPD_DEFAULT_INVOKE_INTERVAL = 30.0
NPD_DEFAULT_MAX_OUTPUT_LENGTH = 80
NPD_OUTPUT_BUFFER_BYTES = 4096
NPD_STATUS = {0: "OK", 1: "NonOK"}

GO_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
GO_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h)")


def go_duration(text: str) -> float:
    """Seconds of a Go time.ParseDuration string (non-negative: what NPD's configs use)."""
    if text == "0":
        return 0.0
    seconds = 0.0
    position = 0
    for match in GO_DURATION_PART.finditer(text):
        if match.start() != position:
            break
        seconds += float(match.group(1)) * GO_DURATION_UNITS[match.group(2)]
        position = match.end()
    if position != len(text) or not text:
        raise ValueError(f"not a Go duration: {text!r}")
    return seconds


def load_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def require_tool(name: str, install: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is needed for this test and was not found: {install}", pytrace=False)
    return found


# --------------------------------------------------------------------------------------------
# node-problem-detector: the configuration
# --------------------------------------------------------------------------------------------


def schema_errors(config: Any) -> list[str]:
    # jsonschema (check-jsonschema's library, in the dev extra) untyped: no stubs installed.
    jsonschema = importlib.import_module("jsonschema")
    validator = jsonschema.Draft202012Validator(load_json(NPD_SCHEMA))
    return sorted(
        f"{'/'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
        for error in validator.iter_errors(config)
    )


def npd_problems(config: Mapping[str, Any]) -> list[str]:
    """What NPD's ApplyConfiguration and Validate refuse (config.go), with its defaults."""
    problems: list[str] = []
    if config.get("plugin") != "custom":
        problems.append(f'plugin {config.get("plugin")!r}: NPD supports only "custom"')
    global_config = config.get("pluginConfig", {})
    try:
        timeout = go_duration(global_config.get("timeout", f"{NPD_DEFAULT_TIMEOUT:g}s"))
        go_duration(global_config.get("invoke_interval", f"{NPD_DEFAULT_INVOKE_INTERVAL:g}s"))
    except ValueError as exc:
        return [*problems, f"pluginConfig: {exc}"]
    defaults = {condition["type"] for condition in config.get("conditions", [])}
    for index, rule in enumerate(config.get("rules", [])):
        if "timeout" in rule:
            try:
                rule_timeout = go_duration(rule["timeout"])
            except ValueError as exc:
                problems.append(f"rules/{index}: {exc}")
                continue
            if rule_timeout > timeout:
                problems.append(f"rules/{index}: timeout is greater than the global timeout")
        if rule.get("type") == "permanent" and rule.get("condition") not in defaults:
            problems.append(f"rules/{index}: permanent problem without a default condition")
    return problems


def test_npd_schema_refuses_what_npd_refuses() -> None:
    """The schema is a test instrument: it must fail broken configurations, not only pass ours."""
    good = load_json(NPD_CONFIG)
    assert schema_errors(good) == []
    broken = [
        {**good, "plugin": "journald"},
        {**good, "pluginConfig": {**good["pluginConfig"], "timeout": "20"}},
        {**good, "pluginConfig": {**good["pluginConfig"], "max_output_lenght": 80}},
        {**good, "pluginConfig": {**good["pluginConfig"], "concurrency": 0}},
        {**good, "rules": [{k: v for k, v in good["rules"][0].items() if k != "condition"}]},
        {**good, "rules": [{**good["rules"][0], "type": "sometimes"}]},
        {**good, "rules": [{**good["rules"][0], "args": "health --summary"}]},
        {k: v for k, v in good.items() if k != "source"},
    ]
    for config in broken:
        assert schema_errors(config), f"the schema accepts {config}"
    assert npd_problems({**good, "rules": [{**good["rules"][0], "timeout": "1m"}]})
    assert npd_problems({**good, "rules": [{**good["rules"][0], "condition": "Other"}]})
    assert go_duration("1m30s") == 90.0
    assert go_duration(".5h") == 1800.0
    with pytest.raises(ValueError, match="not a Go duration"):
        go_duration("30")


def test_npd_config_is_valid() -> None:
    config = load_json(NPD_CONFIG)
    assert schema_errors(config) == []
    assert npd_problems(config) == []


def test_npd_rule_runs_sustain_health_within_the_limits() -> None:
    config = load_json(NPD_CONFIG)
    plugin = config["pluginConfig"]
    (rule,) = config["rules"]
    assert rule["type"] == "permanent"
    assert rule["condition"] == "GPUSustainedHealth"
    assert [condition["type"] for condition in config["conditions"]] == ["GPUSustainedHealth"]
    # NPD refuses to start when the path does not exist: the path the deploy files install.
    assert rule["path"] == INSTALLED_SUSTAIN
    assert "python3.11 -m venv /opt/sustain/.venv" in (
        ROOT / "deploy" / "container" / "Dockerfile"
    ).read_text(encoding="utf-8")
    assert f"ExecStart={INSTALLED_SUSTAIN} run" in (
        ROOT / "deploy" / "systemd" / "sustain.service"
    ).read_text(encoding="utf-8")
    args = rule["args"]
    assert args[:2] == ["health", "--summary"]
    # sustain shortens its summary to --max-length; NPD would cut it mid-word at its limit.
    assert int(args[args.index("--max-length") + 1]) <= plugin["max_output_length"]
    assert plugin["max_output_length"] == NPD_DEFAULT_MAX_OUTPUT_LENGTH
    # One check at a time, finished before the next is due (a batch waits for all its rules).
    assert plugin["concurrency"] == 1
    timeout = min(go_duration(rule["timeout"]), go_duration(plugin["timeout"]))
    assert timeout <= go_duration(plugin["invoke_interval"])
    # The message follows the summary while the condition stays True (GPU 1, then GPU 0 too).
    assert plugin["enable_message_change_based_condition_update"] is True


# --------------------------------------------------------------------------------------------
# node-problem-detector: the rule's command, run as NPD runs it
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PluginResult:
    status: str  # OK, NonOK, Unknown
    message: str
    stdout: str


def run_as_npd(metrics_url: str, env: Mapping[str, str]) -> PluginResult:
    """The shipped rule as plugin.go runs it: the installed path replaced by this checkout's
    sustain, the agent's URL by the test agent's; nothing else changed."""
    config = load_json(NPD_CONFIG)
    plugin = config["pluginConfig"]
    (rule,) = config["rules"]
    args = list(rule["args"])
    args[args.index("--metrics") + 1] = metrics_url
    # NPD gives the command min(rule, plugin timeout) = 15 s, a node's deadline (checked against
    # the invoke interval above); a test machine shared by parallel workers can take longer to
    # start a Python process, so the test waits longer, and answers "Unknown" only past that.
    timeout = max(min(go_duration(rule["timeout"]), go_duration(plugin["timeout"])), 120)
    try:
        done = subprocess.run(
            [str(SUSTAIN), *args],
            capture_output=True,
            timeout=timeout,
            env=dict(env),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return PluginResult("Unknown", f"Timeout when running plugin {rule['path']!r}", "")
    stdout = done.stdout[:NPD_OUTPUT_BUFFER_BYTES].decode(errors="replace")
    message = stdout.strip()
    message = message.encode()[: plugin["max_output_length"]].decode(errors="replace")
    return PluginResult(NPD_STATUS.get(done.returncode, "Unknown"), message, stdout)


HEALTHY_NODE = """\
# Two idle H100s: nothing wrong.
set time_scale 1
device 0 name "NVIDIA H100 80GB HBM3" uuid GPU-5e1f0a2b-0000-4000-8000-00000000a000
device 1 name "NVIDIA H100 80GB HBM3" uuid GPU-5e1f0a2b-0000-4000-8000-00000000a001
"""
# The same node whose GPU 1 falls off the bus two seconds in.
XID_NODE = HEALTHY_NODE + "xid 1 2 79\n"

AGENT_CONFIG = """\
[probing]
enabled = false

[health]
hold_seconds = 1
"""


def plain_env(**extra: str) -> dict[str, str]:
    """This process's environment without SUSTAIN_* and FAKENVML_*: NPD's and slurmd's
    environments know nothing of the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    env.update(extra)
    return env


StartNode = Callable[[str], Running]


@pytest.fixture
def fake_node(fake_nvml: Path, tmp_path: Path) -> Iterator[StartNode]:
    """Start `sustain run` on a scenario; stopped after the test."""
    agents: list[Running] = []

    def start(scenario: str) -> Running:
        directory = tmp_path / f"node{len(agents)}"
        directory.mkdir()
        (directory / "node.scn").write_text(scenario, encoding="utf-8")
        (directory / "sustain.toml").write_text(AGENT_CONFIG, encoding="utf-8")
        agent = start_agent(
            directory,
            "--config",
            str(directory / "sustain.toml"),
            env=quick_env(
                directory,
                LD_LIBRARY_PATH=str(fake_nvml.parent),
                FAKENVML_SCENARIO=str(directory / "node.scn"),
            ),
        )
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        if agent.process.poll() is None:
            agent.terminate()


def test_npd_rule_reports_a_healthy_fake_node_ok(fake_node: StartNode) -> None:
    agent = fake_node(HEALTHY_NODE)
    agent.wait_for('sustain_device_health{device="1",state="healthy"', timeout=STARTUP_SECONDS)
    result = run_as_npd(f"{agent.base}/metrics", plain_env())
    assert result.status == "OK", result
    assert result.message.startswith("healthy:"), result


def test_npd_rule_reports_an_xid_on_a_fake_node_nonok(fake_node: StartNode) -> None:
    agent = fake_node(XID_NODE)
    agent.wait_for('reason="xid_79"', timeout=STARTUP_SECONDS)
    result = run_as_npd(f"{agent.base}/metrics", plain_env())
    assert result.status == "NonOK", result
    # sustain kept within NPD's limit by itself: NPD's cut changed nothing.
    assert result.message == result.stdout.strip(), result
    assert len(result.message) <= NPD_DEFAULT_MAX_OUTPUT_LENGTH
    assert result.message.startswith("unhealthy:"), result
    assert "GPU 1" in result.message, result
    assert "xid_79" in result.message, result
    assert "GPU 0" not in result.message, result


def test_npd_rule_without_an_agent_or_archive_is_unknown(tmp_path: Path) -> None:
    """No verdict: the condition goes Unknown, never False (healthy) or True."""
    result = run_as_npd(
        "http://127.0.0.1:9/metrics", plain_env(SUSTAIN_AGENT__DATA_DIR=str(tmp_path))
    )
    assert result.status == "Unknown", result
    assert len(result.message) <= NPD_DEFAULT_MAX_OUTPUT_LENGTH


# --------------------------------------------------------------------------------------------
# Slurm: HealthCheckProgram
# --------------------------------------------------------------------------------------------

# `scontrol show node` as Slurm 23.11 prints it; State and Reason filled in per test.
SHOW_NODE = """\
NodeName={node} Arch=x86_64 CoresPerSocket=32
   CPUAlloc=0 CPUEfctv=64 CPUTot=64 CPULoad=0.02
   AvailableFeatures=(null)
   ActiveFeatures=(null)
   Gres=gpu:h100:2
   NodeAddr={node} NodeHostName={node} Version=23.11.4
   OS=Linux 6.8.0-45-generic #45-Ubuntu SMP PREEMPT_DYNAMIC
   RealMemory=515000 AllocMem=0 FreeMem=498112 Sockets=2 Boards=1
   State={state} ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=gpu
   BootTime=2026-01-05T08:00:00 SlurmdStartTime=2026-01-05T08:01:12
   LastBusyTime=2026-01-05T09:58:40 ResumeAfterTime=None
   CfgTRES=cpu=64,mem=515000M,billing=64,gres/gpu=2
   AllocTRES=
   CapWatts=n/a
   CurrentWatts=0 AveWatts=0
   ExtSensorsJoules=n/a ExtSensorsWatts=0 ExtSensorsTemp=n/a
{reason}"""

# Stand-ins: each writes its argv as a JSON line to $STANDIN_LOG.
RECORDER = """#!{python}
import json, os, sys
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")
"""
SCONTROL = (
    RECORDER
    + """
if sys.argv[1:3] == ["show", "node"]:
    sys.stdout.write(open(os.environ["STANDIN_SHOW_NODE"]).read())
"""
)
FAKE_SUSTAIN = (
    RECORDER
    + """
print(os.environ["STANDIN_SUMMARY"])
sys.stderr.write(os.environ.get("STANDIN_STDERR", ""))
sys.exit(int(os.environ["STANDIN_STATUS"]))
"""
)


@dataclass
class SlurmNode:
    """A directory of stand-ins on PATH and what they were called with."""

    directory: Path

    @property
    def log(self) -> Path:
        return self.directory / "calls.jsonl"

    def show(self, state: str, reason: str | None, node: str = "gpu-node-1") -> None:
        line = f"   Reason={reason}\n" if reason is not None else ""
        text = SHOW_NODE.format(node=node, state=state, reason=line)
        (self.directory / "show-node.txt").write_text(text, encoding="utf-8")

    def env(self, **extra: str) -> dict[str, str]:
        return plain_env(
            PATH=f"{self.directory / 'bin'}{os.pathsep}{os.environ['PATH']}",
            STANDIN_LOG=str(self.log),
            STANDIN_SHOW_NODE=str(self.directory / "show-node.txt"),
            **extra,
        )

    def calls(self, program: str) -> list[list[str]]:
        lines = self.log.read_text(encoding="utf-8").splitlines() if self.log.exists() else []
        return [call[1:] for call in map(json.loads, lines) if call[0] == program]

    def updates(self) -> list[list[str]]:
        return [call for call in self.calls("scontrol") if call[:1] == ["update"]]

    def syslog(self) -> str:
        return "\n".join(" ".join(call) for call in self.calls("logger"))


@pytest.fixture
def slurm_node(tmp_path: Path) -> SlurmNode:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("logger", RECORDER), ("sustain", FAKE_SUSTAIN)):
        path = bin_dir / name
        path.write_text(text.format(python=sys.executable), encoding="utf-8")
        path.chmod(0o755)
    node = SlurmNode(tmp_path)
    node.show("IDLE", None)
    return node


def healthcheck(node: SlurmNode, status: int, summary: str, **env: str) -> None:
    """Run the HealthCheckProgram as slurmd does (no arguments) with the stand-in sustain."""
    settings = {
        "SUSTAIN": str(node.directory / "bin" / "sustain"),
        "SLURMD_NODENAME": "gpu-node-1",
        "STANDIN_STATUS": str(status),
        "STANDIN_SUMMARY": summary,
        **env,
    }
    done = subprocess.run(
        [str(HEALTHCHECK)],
        env=node.env(**settings),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


UNHEALTHY = "unhealthy: GPU 1 xid_79"
DRAIN = ["update", "NodeName=gpu-node-1", "State=DRAIN", f"Reason=sustain: {UNHEALTHY}"]
RESUME = ["update", "NodeName=gpu-node-1", "State=RESUME"]


def test_healthcheck_drains_a_node_with_a_sick_device(slurm_node: SlurmNode) -> None:
    healthcheck(slurm_node, 1, UNHEALTHY)
    assert slurm_node.calls("sustain") == [["health", "--summary"]]
    assert slurm_node.updates() == [DRAIN]
    assert f"drained gpu-node-1: sustain: {UNHEALTHY}" in slurm_node.syslog()


def test_healthcheck_does_not_repeat_its_own_drain(slurm_node: SlurmNode) -> None:
    slurm_node.show("IDLE+DRAIN", f"sustain: {UNHEALTHY} [root@2026-01-05T10:00:00]")
    healthcheck(slurm_node, 1, UNHEALTHY)
    assert slurm_node.updates() == []


def test_healthcheck_updates_its_own_drain_reason(slurm_node: SlurmNode) -> None:
    slurm_node.show("MIXED+DRAIN", "sustain: degraded: GPU 0 thermal_while_idle [root@2026-01-05]")
    healthcheck(slurm_node, 1, UNHEALTHY)
    assert slurm_node.updates() == [DRAIN]


def test_healthcheck_leaves_another_tools_drain_alone(slurm_node: SlurmNode) -> None:
    slurm_node.show("IDLE+DRAIN", "NHC: check_fs_mount: /scratch not mounted [root@2026-01-05]")
    healthcheck(slurm_node, 1, UNHEALTHY)
    assert slurm_node.updates() == []
    assert "drained by another tool (NHC: check_fs_mount: /scratch not mounted)" in (
        slurm_node.syslog()
    )
    healthcheck(slurm_node, 0, "healthy: GPU 0, GPU 1, CPU")
    assert slurm_node.updates() == []


def test_healthcheck_resumes_only_its_own_drain(slurm_node: SlurmNode) -> None:
    slurm_node.show("IDLE+DRAIN", f"sustain: {UNHEALTHY} [root@2026-01-05T10:00:00]")
    healthcheck(slurm_node, 0, "healthy: GPU 0, GPU 1, CPU")
    assert slurm_node.updates() == [RESUME]
    assert "resumed gpu-node-1" in slurm_node.syslog()


def test_healthcheck_leaves_a_healthy_node_alone(slurm_node: SlurmNode) -> None:
    # A reason that stays after the node was resumed by hand is not a drain.
    slurm_node.show("IDLE", f"sustain: {UNHEALTHY} [root@2026-01-05T10:00:00]")
    healthcheck(slurm_node, 0, "healthy: GPU 0, GPU 1, CPU")
    assert slurm_node.updates() == []
    assert slurm_node.syslog() == ""


@pytest.mark.parametrize("status", [2, 3, 137])
def test_healthcheck_changes_nothing_without_a_verdict(slurm_node: SlurmNode, status: int) -> None:
    slurm_node.show("IDLE+DRAIN", f"sustain: {UNHEALTHY} [root@2026-01-05T10:00:00]")
    healthcheck(
        slurm_node,
        status,
        "unknown: no agent at http://127.0.0.1:9477/metrics",
        STANDIN_STDERR="sustain: the archive cannot be read",
    )
    assert slurm_node.calls("scontrol") == []
    log = slurm_node.syslog()
    assert f"-p daemon.warning -- no verdict for gpu-node-1: {slurm_node.directory}" in log
    assert f"health exited {status}: unknown: no agent" in log
    assert "the archive cannot be read" in log


def test_healthcheck_without_sustain_changes_nothing(slurm_node: SlurmNode) -> None:
    healthcheck(slurm_node, 1, UNHEALTHY, SUSTAIN=str(slurm_node.directory / "missing"))
    assert slurm_node.calls("scontrol") == []
    assert "health exited 127" in slurm_node.syslog()


def test_healthcheck_names_the_node_by_its_short_host_name(slurm_node: SlurmNode) -> None:
    short = subprocess.run(
        ["hostname", "-s"], capture_output=True, text=True, check=True
    ).stdout.strip()
    env = slurm_node.env(
        SUSTAIN=str(slurm_node.directory / "bin" / "sustain"),
        STANDIN_STATUS="1",
        STANDIN_SUMMARY=UNHEALTHY,
    )
    env.pop("SLURMD_NODENAME", None)
    subprocess.run([str(HEALTHCHECK)], env=env, timeout=60, check=True)
    assert slurm_node.calls("scontrol")[0] == ["show", "node", short]
    assert slurm_node.updates()[0][1] == f"NodeName={short}"


def healthcheck_live(node: SlurmNode, agent: Running) -> None:
    """The HealthCheckProgram with this checkout's real sustain, configured (as
    /etc/sustain/sustain.toml would) to ask ``agent`` and read its archive. Its time limit for
    `sustain health` (30 s, slurmd's 60 s halved) is raised: a test machine shared by parallel
    workers may take longer than a node to start a Python process."""
    healthcheck(
        node,
        0,
        "",
        SUSTAIN_HEALTH_TIMEOUT="120",
        SUSTAIN=str(SUSTAIN),
        SUSTAIN_EXPORTER__LISTEN=f"127.0.0.1:{agent.port}",
        SUSTAIN_AGENT__DATA_DIR=str(agent.data_dir),
    )


@pytest.mark.slow
def test_healthcheck_drains_and_resumes_with_a_live_fake_node(
    fake_node: StartNode, slurm_node: SlurmNode
) -> None:
    """The real `sustain health` against agents on the fake driver: the GPU with an XID drains
    the node, the healthy node then resumes it. Only scontrol and logger are stand-ins."""
    sick = fake_node(XID_NODE)
    well = fake_node(HEALTHY_NODE)  # started beside it, so that it is up when its turn comes
    sick.wait_for('reason="xid_79"', timeout=STARTUP_SECONDS)
    healthcheck_live(slurm_node, sick)
    (update,) = slurm_node.updates()
    assert update[:3] == ["update", "NodeName=gpu-node-1", "State=DRAIN"]
    assert update[3].startswith("Reason=sustain: unhealthy: GPU 1 xid_79"), update
    sick.terminate()

    slurm_node.show("IDLE+DRAIN", f"{update[3].removeprefix('Reason=')} [root@2026-01-05]")
    well.wait_for('sustain_device_health{device="1",state="healthy"', timeout=STARTUP_SECONDS)
    healthcheck_live(slurm_node, well)
    assert slurm_node.updates()[1:] == [RESUME]


# --------------------------------------------------------------------------------------------
# Slurm: the NHC check
# --------------------------------------------------------------------------------------------


def nhc_check(slurm_node: SlurmNode, status: int, summary: str) -> tuple[int, str]:
    """check_sustain_health as NHC calls it: the script sourced by bash, with NHC's `die` and
    `log` replaced by functions that print what they were given."""
    script = (
        f"source {NHC_CHECK}\n"
        'die() { echo "die $1 $2"; return "$1"; }\n'
        'log() { echo "log $*"; }\n'
        "check_sustain_health\n"
        'echo "returned $?"\n'
    )
    env = slurm_node.env(
        SUSTAIN=str(slurm_node.directory / "bin" / "sustain"),
        STANDIN_STATUS=str(status),
        STANDIN_SUMMARY=summary,
    )
    done = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert slurm_node.calls("sustain")[-1] == ["health", "--summary"]
    *lines, returned = done.stdout.splitlines()
    return int(returned.removeprefix("returned ")), "\n".join(lines)


def test_nhc_check_fails_for_a_sick_device(slurm_node: SlurmNode) -> None:
    assert nhc_check(slurm_node, 1, UNHEALTHY) == (1, f"die 1 sustain: {UNHEALTHY}")


def test_nhc_check_passes_for_a_healthy_node(slurm_node: SlurmNode) -> None:
    assert nhc_check(slurm_node, 0, "healthy: GPU 0, GPU 1, CPU") == (0, "")


def test_nhc_check_passes_without_a_verdict(slurm_node: SlurmNode) -> None:
    returned, output = nhc_check(slurm_node, 2, "unknown: no verdict")
    assert returned == 0
    assert output.startswith("log check_sustain_health: no verdict (")
    assert "exited 2): unknown: no verdict" in output


@pytest.mark.parametrize(
    ("status", "summary"),
    [
        (2, "unknown: GPU 1 not_sampled"),
        (2, "unknown: GPU 0, GPU 1, CPU (archive, 30 d old)"),
        (0, "healthy: GPU 0, GPU 1, CPU (archive, 2 min old)"),
        (124, ""),
    ],
)
def test_nhc_keeps_a_node_it_drained_for_sustain_without_live_evidence(
    slurm_node: SlurmNode, status: int, summary: str
) -> None:
    # NHC resumes a node it took offline once every check passes: passing on unknown or on an
    # archived verdict would undo sustain's drain for XID 79 while the GPU is still lost.
    slurm_node.show("IDLE+DRAIN", f"NHC: sustain: {UNHEALTHY}")
    returned, output = nhc_check(slurm_node, status, summary)
    assert returned == 1
    assert output.splitlines()[-1] == f"die 1 sustain: {UNHEALTHY}"


def test_nhc_resumes_a_node_it_drained_for_sustain_on_live_healthy_evidence(
    slurm_node: SlurmNode,
) -> None:
    slurm_node.show("IDLE+DRAIN", f"NHC: sustain: {UNHEALTHY}")
    assert nhc_check(slurm_node, 0, "healthy: GPU 0, GPU 1, CPU") == (0, "")


def test_nhc_leaves_another_tools_drain_to_that_tool(slurm_node: SlurmNode) -> None:
    slurm_node.show("IDLE+DRAIN", "NHC: check_fs_mount: /scratch")
    returned, _ = nhc_check(slurm_node, 2, "unknown: GPU 1 not_sampled")
    assert returned == 0


# The HealthCheckProgram is a POSIX sh program slurmd executes; NHC sources its checks in bash.
@pytest.mark.parametrize(("script", "shell"), [(HEALTHCHECK, "sh"), (NHC_CHECK, "bash")])
def test_slurm_files_pass_shellcheck(script: Path, shell: str) -> None:
    tool = require_tool("shellcheck", "apt-get install shellcheck (tests/run.sh does)")
    done = subprocess.run(
        [tool, f"--shell={shell}", "--enable=all", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert HEALTHCHECK.stat().st_mode & 0o111, "chmod +x deploy/slurm/sustain-healthcheck.sh"
