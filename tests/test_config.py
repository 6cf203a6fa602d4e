"""Configuration: precedence, validation messages, and the `sustain config` commands as a user runs
them (a real subprocess, its output and exit code)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import settings as config

SUSTAIN = [sys.executable, "-m", "agent"]


def sustain(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SUSTAIN_")}
    full_env.update(env or {})
    return subprocess.run(
        [*SUSTAIN, *args], capture_output=True, text=True, timeout=60, env=full_env, check=False
    )


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sustain.toml"
    path.write_text(text)
    return path


VALID = """
[agent]
node = "gpu-node-17"
log_level = "warning"

[exporter]
listen = "127.0.0.1:9500"
window_seconds = 30

[sampler]
interval_seconds = 0.5

[archive]
database_url = "postgresql+psycopg://sustain:hunter2@db.example:5432/fleet"
rollup_seconds = 60
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[sampler]\ninterval_seconds = \n", "TOML syntax error"),
        ("[sampler]\ninterval_second = 1\n", "sampler.interval_second: unknown key"),
        ('[sampler]\ninterval_seconds = "fast"\n', "sampler.interval_seconds: "),
        ("[sampler]\ninterval_seconds = -1\n", "sampler.interval_seconds: "),
        ('[archive]\ndatabase_url = "not a url"\n', "archive.database_url: malformed database URL"),
        (
            '[archive]\ndatabase_url = "nosuchdb://x/y"\n',
            "archive.database_url: unsupported database 'nosuchdb'",
        ),
        ('[exporter]\nlisten = "9477"\n', "exporter.listen: "),
        ("[nosection]\nx = 1\n", "nosection: unknown key"),
    ],
)
def test_config_check_names_the_problem_and_exits_2(
    tmp_path: Path, text: str, expected: str
) -> None:
    result = sustain("config", "check", str(write(tmp_path, text)))
    assert result.returncode == 2, result
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, lines
    assert expected in lines[0]
    assert "Traceback" not in result.stderr


def test_config_check_syntax_error_gives_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[agent]\nnode = "a"\n\n[sampler\ninterval_seconds = 1\n')
    result = sustain("config", "check", str(path))
    assert result.returncode == 2
    assert "line 4" in result.stdout


def test_config_check_reports_every_problem(tmp_path: Path) -> None:
    path = write(tmp_path, "[sampler]\ninterval_seconds = -1\nbogus = 1\n")
    result = sustain("config", "check", str(path))
    assert result.returncode == 2
    assert sorted(result.stdout.splitlines()) == [
        f"{path}: sampler.bogus: unknown key",
        f"{path}: sampler.interval_seconds: Input should be greater than 0 (got -1)",
    ]


def test_config_check_valid_file_prints_ok(tmp_path: Path) -> None:
    result = sustain("config", "check", str(write(tmp_path, VALID)))
    assert (result.returncode, result.stdout) == (0, "ok\n")


def test_config_check_missing_file(tmp_path: Path) -> None:
    result = sustain("config", "check", str(tmp_path / "absent.toml"))
    assert result.returncode == 2
    assert "no such file" in result.stdout


def test_config_show_redacts_the_password(tmp_path: Path) -> None:
    result = sustain("config", "show", "--config", str(write(tmp_path, VALID)))
    assert result.returncode == 0, result.stderr
    assert "hunter2" not in result.stdout
    assert (
        'database_url = "postgresql+psycopg://sustain:***@db.example:5432/fleet"' in result.stdout
    )
    assert 'node = "gpu-node-17"' in result.stdout
    assert "window_seconds = 30.0" in result.stdout


def test_config_show_is_valid_toml_of_the_effective_settings(tmp_path: Path) -> None:
    import tomllib

    result = sustain("config", "show", "--data-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    shown = tomllib.loads(result.stdout)
    assert shown["agent"]["data_dir"] == str(tmp_path)
    assert shown["archive"]["database_url"] == f"sqlite:///{tmp_path}/sustain.db"
    assert shown["sampler"]["interval_seconds"] == 1.0


def test_precedence_flags_over_environment_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    env = {"SUSTAIN_EXPORTER__LISTEN": "127.0.0.1:9600", "SUSTAIN_SAMPLER__INTERVAL_SECONDS": "2"}
    result = sustain("config", "show", "--config", str(path), "--listen", "127.0.0.1:9700", env=env)
    assert result.returncode == 0, result.stderr
    assert 'listen = "127.0.0.1:9700"' in result.stdout  # flag beats environment
    assert "interval_seconds = 2.0" in result.stdout  # environment beats file
    assert "window_seconds = 30.0" in result.stdout  # file beats default


def test_bad_environment_value_is_one_line_exit_2() -> None:
    result = sustain("config", "show", env={"SUSTAIN_SAMPLER__INTERVAL_SECONDS": "-3"})
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "sustain: config: SUSTAIN_SAMPLER__INTERVAL_SECONDS: Input should be greater than 0 "
        "(got '-3')"
    ]


def test_bad_argument_is_one_line_exit_2() -> None:
    result = sustain("run", "--no-such-flag")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "--no-such-flag" in result.stderr


def test_default_database_is_sqlite_under_the_data_dir(tmp_path: Path) -> None:
    settings = config.load(None, {"agent": {"data_dir": tmp_path}}, use_env=False)
    assert settings.database_url == f"sqlite:///{tmp_path}/sustain.db"
    assert settings.listen_address == ("0.0.0.0", config.DEFAULT_PORT)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9477", ("127.0.0.1", 9477)),
        (":9477", ("0.0.0.0", 9477)),
        ("[::1]:9477", ("::1", 9477)),
    ],
)
def test_parse_listen(text: str, expected: tuple[str, int]) -> None:
    assert config.parse_listen(text) == expected


@pytest.mark.parametrize("text", ["9477", "host:", "host:port", "h:70000"])
def test_parse_listen_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"HOST:PORT|outside"):
        config.parse_listen(text)


def test_configuration_reference_documents_every_key() -> None:
    reference = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    sections = {
        name: field.annotation
        for name, field in config.Settings.model_fields.items()
        if isinstance(field.annotation, type)
    }
    missing = [
        f"{section}.{key}"
        for section, model in sections.items()
        for key in getattr(model, "model_fields", {})
        if f"`{section}.{key}`" not in reference
    ]
    assert len(sections) == 11
    missing += [
        f"probing.plan.{key}"
        for key in config.ProbePlanEntry.model_fields
        if f"| `{key}` |" not in reference
    ]
    assert missing == []
