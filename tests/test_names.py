"""The names a user meets do not move when the code does: `sustain --help`, every configuration
key (type and default), every archive table and column, and (in tests/test_exposition.py) every
/metrics family with its type and labels are compared with golden files. A deliberate change
regenerates them with SUSTAIN_UPDATE_GOLDEN=1 and shows up in review as a diff of those files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import inspect

from agent.archive.database import open_engine, upgrade
from agent.config.settings import Settings

GOLDEN = Path(__file__).parent / "golden"


def same_as_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("SUSTAIN_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed: a user-facing name moved"


def test_top_level_help_is_unchanged() -> None:
    env = {**os.environ, "COLUMNS": "100"}
    done = subprocess.run(
        [sys.executable, "-m", "agent", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )
    same_as_golden("sustain-help.txt", done.stdout)


def test_configuration_keys_are_unchanged() -> None:
    schema = Settings.model_json_schema()
    same_as_golden("config-schema.json", json.dumps(schema, indent=1, sort_keys=True) + "\n")


def test_archive_tables_are_unchanged(tmp_path: Path) -> None:
    engine = open_engine(f"sqlite:///{tmp_path}/archive.db")
    upgrade(engine)
    inspector = inspect(engine)
    lines = [
        f"{table}: {', '.join(column['name'] for column in inspector.get_columns(table))}"
        for table in sorted(inspector.get_table_names())
    ]
    lines += [
        f"view {view}: {', '.join(column['name'] for column in inspector.get_columns(view))}"
        for view in sorted(inspector.get_view_names())
    ]
    engine.dispose()
    same_as_golden("archive-tables.txt", "\n".join(lines) + "\n")
