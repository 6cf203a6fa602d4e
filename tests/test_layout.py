"""The layout's rules, as a newcomer reads them in docs/architecture.md: the contracts declared in
pyproject.toml ([tool.importlinter]) hold, and they do catch a breach; no module or function grows
past the size a reader can hold."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 150
# Generated or third-party data, not code a person edits: the dashboards' JSON is written by
# grafana/build.py from the modules beside it.
NOT_SOURCE = {".json", ".csv", ".svg", ".png", ".lock"}


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", "pyproject.toml"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(root)},
    )


def source_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [
        ROOT / name
        for name in listed
        if not name.startswith("tests/")
        and Path(name).suffix not in NOT_SOURCE
        and (ROOT / name).is_file()
    ]


def test_the_declared_contracts_hold() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_the_contracts_catch_a_breach(tmp_path: Path) -> None:
    """A copy of the tree with numpy in the telemetry store and the probe scheduler importing the
    archive (the upward import the layout removed): both contracts report it."""
    for name in ("agent", "collectors", "workloads"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    store = tmp_path / "agent" / "telemetry" / "store.py"
    store.write_text(store.read_text() + "\nimport numpy\n")
    scheduler = tmp_path / "agent" / "probes" / "scheduler.py"
    scheduler.write_text(scheduler.read_text() + "\nfrom agent.archive import database\n")
    done = lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "daemon-stays-small" in done.stdout or "never import numpy" in done.stdout
    assert "agent.telemetry.store -> numpy" in done.stdout
    assert "agent.probes.scheduler -> agent.archive.database" in done.stdout
    assert "2 broken" in done.stdout


def test_no_file_is_too_long_to_read() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for path in source_files()
        if (lines := len(path.read_bytes().splitlines())) > MAX_FILE_LINES
    }
    assert long == {}


def test_no_function_is_too_long_to_read() -> None:
    long = {}
    for path in source_files():
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    assert long == {}
