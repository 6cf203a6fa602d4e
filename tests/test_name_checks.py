"""Bad input caught up front: workload, precision and optimization names checked against the
workloads' catalogue by `config check`, `probe` (before any child starts) and `run` (before it
listens); every configuration problem one line that names the file and key, the environment
variable or the flag it came from, says the value once and shows no internal class name."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import get_args

import pytest
from conftest import free_port
from pydantic import BaseModel
from test_config import sustain

from agent.config import settings as config
from workloads import catalog
from workloads import precision as precisions
from workloads.registry import WORKLOADS

KNOWN_WORKLOADS = "known: matmul, membw, h2d, d2h, attention, inference, allreduce"
MATMUL_PRECISIONS = "known: fp32, tf32, bf16, fp16, fp8, int8"
# Every model class of the settings, and the names pydantic and pydantic-settings use for theirs.
INTERNAL_NAMES = [
    *(
        name
        for name, value in vars(config).items()
        if isinstance(value, type) and issubclass(value, BaseModel)
    ),
    "Loaded",
    "EnvSettingsSource",
    "SettingsError",
    "ValidationError",
    "Value error",
    "Traceback",
]


def plan_file(tmp_path: Path, entry: str) -> Path:
    path = tmp_path / "sustain.toml"
    path.write_text(f"[[probing.plan]]\n{entry}\ninterval_seconds = 3600\n")
    return path


def test_the_catalogue_is_what_the_workloads_declare() -> None:
    """The agent checks names against plain data; the torch workloads must say the same."""
    declared = {
        name: catalog.Declared(name, workload.spec.precisions, workload.spec.optimizations)
        for name, workload in WORKLOADS.items()
    }
    assert list(catalog.WORKLOADS) == list(declared)
    assert declared == catalog.WORKLOADS
    assert catalog.PRECISIONS == precisions.PRECISIONS
    used = {level for spec in catalog.WORKLOADS.values() for level in spec.optimizations}
    assert used <= set(catalog.OPTIMIZATIONS)
    level = get_args(config.ProbePlanEntry.model_fields["optimizations"].annotation)[0]
    assert get_args(get_args(level)[0]) == catalog.OPTIMIZATIONS


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        (
            'workload = "matmull"',
            "probing.plan[0].workload: unknown workload 'matmull' "
            f"(did you mean 'matmul'? {KNOWN_WORKLOADS})",
        ),
        (
            'workload = "matmul"\nprecisions = ["fp32", "bf17"]',
            "probing.plan[0].precisions[1]: unknown precision 'bf17' for matmul "
            f"(did you mean 'bf16'? {MATMUL_PRECISIONS})",
        ),
        (
            'workload = "inference"\noptimizations = ["compild"]',
            "probing.plan[0].optimizations[0]: unknown optimization 'compild' for inference "
            "(did you mean 'compiled'? known: eager, compiled)",
        ),
        (
            'workload = "membw"\nprecisions = ["bf16"]',
            "probing.plan[0].precisions[0]: unknown precision 'bf16' for membw (known: fp32)",
        ),
        (
            'workload = "matmul"\noptimizations = ["compiled"]',
            "probing.plan[0].optimizations[0]: unknown optimization 'compiled' for matmul "
            "(known: eager, fast_accum)",
        ),
    ],
)
def test_config_check_names_a_misspelt_name_with_a_suggestion(
    tmp_path: Path, entry: str, expected: str
) -> None:
    path = plan_file(tmp_path, entry)
    result = sustain("config", "check", str(path))
    assert result.returncode == 2, result
    assert result.stdout.splitlines() == [f"{path}: {expected}"]


@pytest.fixture
def child_marker(tmp_path: Path) -> tuple[Path, Path]:
    """A configuration whose probe interpreter leaves a file behind if it is ever started."""
    marker = tmp_path / "child-started"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\ntouch {marker}\nexit 2\n")
    python.chmod(0o755)
    path = tmp_path / "sustain.toml"
    path.write_text(f'[probing]\npython = "{python}"\n')
    return path, marker


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--workload", "nope"], f"--workload: unknown workload 'nope' ({KNOWN_WORKLOADS})"),
        (
            ["--workload", "matmul", "--precision", "bf17"],
            "--precision: unknown precision 'bf17' for matmul "
            f"(did you mean 'bf16'? {MATMUL_PRECISIONS})",
        ),
        (
            ["--workload", "matmul", "--optimization", "compiled"],
            "--optimization: unknown optimization 'compiled' for matmul (known: eager, fast_accum)",
        ),
    ],
)
def test_probe_refuses_an_unknown_name_before_any_child_starts(
    child_marker: tuple[Path, Path], args: list[str], expected: str
) -> None:
    path, marker = child_marker
    result = sustain("probe", "--config", str(path), "--device", "cpu", "--force", *args)
    assert result.returncode == 2, result
    assert result.stderr.splitlines() == [f"sustain: error: {expected}"]
    assert result.stdout == ""
    assert not marker.exists()


def test_probe_leaves_out_what_a_plan_workload_does_not_declare(tmp_path: Path) -> None:
    """`--precision bf16` over the default plan (matmul, membw) starts matmul in bf16 only."""
    calls = tmp_path / "calls"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 2\n')
    python.chmod(0o755)
    path = tmp_path / "sustain.toml"
    path.write_text(f'[probing]\npython = "{python}"\n')
    args = ("--config", str(path), "--device", "cpu", "--force", "--duration", "1")
    sustain("probe", *args, "--precision", "bf16")
    runs = [line for line in calls.read_text().splitlines() if " run " in f" {line} "]
    assert runs
    assert all("--workload matmul" in run and "--precision bf16" in run for run in runs), runs


def test_run_refuses_a_bad_plan_from_the_environment_before_it_listens(tmp_path: Path) -> None:
    port = free_port()
    plan = '[{"workload": "matmull", "interval_seconds": 3600}]'
    data_dir = tmp_path / "data"
    result = sustain(
        "run",
        "--listen",
        f"127.0.0.1:{port}",
        "--data-dir",
        str(data_dir),
        env={"SUSTAIN_PROBING__PLAN": plan},
    )
    assert result.returncode == 2, result
    assert result.stderr.splitlines() == [
        "sustain: config: SUSTAIN_PROBING__PLAN: [0].workload: unknown workload 'matmull' "
        f"(did you mean 'matmul'? {KNOWN_WORKLOADS})"
    ]
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass
    assert not data_dir.exists()  # no archive, no spool


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--config", "{file}"], {}, "{file}: exporter.listen: expected HOST:PORT, got 'nohost'"),
        ([], {"SUSTAIN_EXPORTER__LISTEN": "nohost"}, "SUSTAIN_EXPORTER__LISTEN: expected"),
        (["--listen", "nohost"], {}, "--listen: expected HOST:PORT, got 'nohost'"),
        (
            [],
            {"SUSTAIN_PROBING__PLAN": "matmul"},
            "SUSTAIN_PROBING__PLAN: not valid JSON (a list or table is written as JSON here)",
        ),
        ([], {"SUSTAIN_PROBING": '{"plan": [{"workload": "x"}]}'}, "SUSTAIN_PROBING: plan[0]."),
    ],
)
def test_a_problem_names_the_file_variable_or_flag_it_came_from(
    tmp_path: Path, args: list[str], env: dict[str, str], expected: str
) -> None:
    path = tmp_path / "sustain.toml"
    path.write_text('[exporter]\nlisten = "nohost"\n')
    result = sustain("config", "show", *(arg.format(file=path) for arg in args), env=env)
    assert result.returncode == 2, result
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"sustain: config: {expected.format(file=path)}"), line


def test_the_source_that_wins_is_the_one_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The environment's plan replaces the file's; a variable for another key leaves it alone."""
    path = plan_file(tmp_path, 'workload = "matmull"')
    monkeypatch.setenv("SUSTAIN_PROBING__ENABLED", "true")
    with pytest.raises(config.ConfigError) as from_file:
        config.load(path)
    assert from_file.value.problems[0].startswith(f"{path}: probing.plan[0].workload: ")
    monkeypatch.setenv("SUSTAIN_PROBING__PLAN", '[{"workload": "membww", "cron": "0 * * * *"}]')
    with pytest.raises(config.ConfigError) as from_env:
        config.load(path)
    assert from_env.value.problems == [
        "SUSTAIN_PROBING__PLAN: [0].workload: unknown workload 'membww' "
        f"(did you mean 'membw'? {KNOWN_WORKLOADS})"
    ]


BAD_FILES = [
    "probing = 5\n",
    "exporter = []\n",
    "[probing]\nplan = [1]\n",
    "[probing]\nplan = 'matmul'\n",
    '[[probing.plan]]\nworkload = "matmul"\nprecisions = 5\ninterval_seconds = 1\n',
    '[[probing.plan]]\nworkload = "matmul"\n',
    "[sampler]\ninterval_seconds = 'fast'\n",
]
BAD_ENVIRONMENTS = [
    {"SUSTAIN_PROBING": "[]"},
    {"SUSTAIN_PROBING": "x"},
    {"SUSTAIN_PROBING__PLAN": "[1]"},
    {"SUSTAIN_PROBING__PLAN": '{"workload": "matmul"}'},
    {"SUSTAIN_PROBING__PLAN": "[{"},
    {"SUSTAIN_EXPORTER": "{}", "SUSTAIN_AGENT__LOG_LEVEL": "loud"},
]


@pytest.mark.parametrize(
    ("text", "env"),
    [(text, {}) for text in BAD_FILES] + [("", env) for env in BAD_ENVIRONMENTS],
)
def test_problems_never_show_internal_class_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, env: dict[str, str]
) -> None:
    path = tmp_path / "sustain.toml"
    path.write_text(text)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(config.ConfigError) as raised:
        config.load(path)
    assert raised.value.problems
    for problem in raised.value.problems:
        assert "\n" not in problem
        assert [name for name in INTERNAL_NAMES if name in problem] == [], problem


def test_bad_environment_json_is_one_line_not_a_traceback() -> None:
    result = sustain("config", "show", env={"SUSTAIN_PROBING": "x"})
    assert result.returncode == 2, result
    assert result.stderr.splitlines() == [
        "sustain: config: SUSTAIN_PROBING: not valid JSON (a list or table is written as JSON "
        "here): Expecting value at column 1"
    ]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('[exporter]\nlisten = "nohostport"\n', "nohostport"),
        ('[exporter]\nlisten = "host:99999"\n', "99999"),
        ('[exporter]\nweb_config_file = "/no/such/web-config.yml"\n', "/no/such/web-config.yml"),
        ('[[probing.plan]]\nworkload = "matmull"\ninterval_seconds = 1\n', "matmull"),
        (
            '[[probing.plan]]\nworkload = "matmul"\nprecisions = ["bf17"]\ncron = "0 * * * *"\n',
            "bf17",
        ),
        ('[[probing.plan]]\nworkload = "matmul"\ncron = "* * bogus"\n', "* * bogus"),
        ("[sampler]\ninterval_seconds = -17.5\n", "-17.5"),
        ("[agent]\nlog_level = 'loud'\n", "loud"),
    ],
)
def test_a_problem_says_the_value_once(tmp_path: Path, text: str, value: str) -> None:
    path = tmp_path / "sustain.toml"
    path.write_text(text)
    (problem,) = config.check_file(path)
    assert problem.count(value) == 1, problem
