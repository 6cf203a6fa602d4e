"""``sustain capacity`` as a user runs it: a real process on a SQLite archive (`python -m agent`,
forked from tests/test_database_urls.py's zygote, which spares each command its imports), its
output piped (no terminal) or at COLUMNS=80, the runs it rests on and those it leaves out, and
what it says when nothing matches."""

from __future__ import annotations

import json
import os
import re
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert
from test_capacity import probe_run
from test_database_urls import forked_sustain

from agent.archive.database import open_engine, upgrade
from agent.archive.models import ProbeRunRecord

ENDED = datetime.now(UTC) - timedelta(days=2)
HEADER = ["MODEL", "SIZE", "SCOPE", "MEDIAN", "P10", "SPEC", "RESULTS", "DEVICES"]


def result(**values: Any) -> dict[str, Any]:
    """An analysed ok run (test_capacity's), ended two days ago."""
    return probe_run(started_at=ENDED - timedelta(seconds=12), **values)


@pytest.fixture
def archive(tmp_path: Path) -> str:
    """The URL of a migrated SQLite archive with no results (tests add theirs)."""
    url = f"sqlite:///{tmp_path / 'archive.db'}"
    engine = open_engine(url)
    upgrade(engine)
    engine.dispose()
    return url


def add(url: str, *rows: dict[str, Any]) -> None:
    engine = open_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(insert(ProbeRunRecord), list(rows))
    finally:
        engine.dispose()


def capacity(url: str, *args: str, columns: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m agent capacity``, stdout and stderr piped: no terminal, as in a script."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    if columns is not None:
        env["COLUMNS"] = columns
    return forked_sustain(["capacity", "--database", url, *args], env)


def fleet() -> list[dict[str, Any]]:
    """Two models, two precisions and a membw probe, default and small sizes, a CPU."""
    rows = []
    for index in range(4):
        rows += [
            result(device=f"GPU-{index}", steady_throughput=7.1e14 + index * 1e12),
            result(device=f"GPU-{index}", precision="fp32", steady_throughput=5.2e13),
            result(
                device=f"GPU-{index}",
                workload="membw",
                precision="fp32",
                unit="B/s",
                steady_throughput=2.9e12,
            ),
            result(
                node="node-b",
                device=f"GPU-{index}",
                device_model="NVIDIA A100-SXM4-80GB",
                steady_throughput=2.4e14,
            ),
        ]
    rows.append(result(device="GPU-0", size="small", steady_throughput=2.1e14))
    rows.append(
        result(
            device="host", device_model="AMD EPYC 7763", precision="fp32", steady_throughput=1e12
        )
    )
    return rows


@pytest.mark.parametrize("columns", [None, "80"], ids=["piped", "COLUMNS=80"])
def test_the_table_fits_80_columns_uncut(archive: str, columns: str | None) -> None:
    add(archive, *fleet())
    done = capacity(archive, columns=columns)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, done.stdout
    assert "…" not in done.stdout
    headers = [line.split() for line in lines if line.startswith("MODEL")]
    assert headers == [HEADER] * 3  # a section each: matmul bf16, matmul fp32, membw fp32
    assert "matmul bf16 eager (FLOP/s)" in lines
    assert "membw fp32 eager (B/s)" in lines
    rows = [line for line in lines if line.startswith(("NVIDIA", "AMD"))]
    assert len(rows) == 6
    # Under the table, what it rests on: every run on a steady basis, none left out.
    assert lines[-3:] == [
        "",
        "runs used: 18 (18 on a steady basis, 0 on a p10 basis)",
        "runs left out: none",
    ]
    # The model names and the figures whole; the small size flagged on its own line.
    assert re.search(
        r"^NVIDIA H100 80GB HBM3 +default +solo +711\.5 T +710\.3 T +71\.9% +4 +4$",
        done.stdout,
        re.M,
    )
    assert re.search(
        r"^NVIDIA H100 80GB HBM3 +small +solo +210\.0 T +210\.0 T +21\.2% +1 +1$",
        done.stdout,
        re.M,
    )
    assert re.search(
        r"^AMD EPYC 7763 +default +solo +1\.000 T +1\.000 T +- +1 +1$", done.stdout, re.M
    )


def test_a_name_too_long_for_its_column_gets_a_line_of_its_own(archive: str) -> None:
    name = "Intel(R) Xeon(R) Platinum 8480+ Sapphire Rapids"
    add(archive, result(device="host", device_model=name, precision="fp32", steady_throughput=2e12))
    done = capacity(archive)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, done.stdout
    assert lines[1].split() == HEADER
    assert lines[2] == name
    assert lines[3].split() == ["default", "solo", "2.000", "T", "2.000", "T", "-", "1", "1"]
    # A terminal wide enough keeps the row on one line.
    wide = capacity(archive, columns="120")
    assert wide.stdout.splitlines()[2].startswith(name + "  default")


def test_node_wide_results_beside_solo_and_alone_with_scope(archive: str) -> None:
    """The planner's question: what each H100 sustains alone and while its node works."""
    node_wide = [
        result(
            device=f"GPU-{index}",
            scope="node",
            group_id="g" * 32,
            steady_throughput=6.0e14 + index * 1e12,
        )
        for index in range(2)
    ]
    total = result(device="node", scope="node_total", group_id="g" * 32, steady_throughput=1.201e15)
    add(archive, *fleet())
    add(archive, *node_wide, total)
    done = capacity(archive, "--precision", "bf16")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, done.stdout
    figures = [line.split() for line in lines if line.startswith(" ")]
    assert [line[:2] for line in figures] == [
        ["default", "solo"],  # the A100s
        ["default", "solo"],
        ["default", "node-wide"],
        ["default", "node-total"],
        ["small", "solo"],
    ]
    assert figures[2][2:] == ["600.5", "T", "600.1", "T", "60.7%", "2", "2"]
    assert figures[3][2:] == ["1.201", "P", "1.201", "P", "-", "1", "1"]
    done = capacity(archive, "--scope", "node", "--json")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)["rows"]
    assert (row["scope"], row["results"], row["median"]) == ("node", 2, 6.005e14)
    done = capacity(archive, "--scope", "node_total", "--precision", "fp32")
    assert done.stdout == "no result matches --precision fp32 --scope node_total together\n"


def test_an_empty_archive_says_so(archive: str) -> None:
    done = capacity(archive)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("the archive has no results yet")
    # A filter on an empty archive: the archive is still what is empty.
    done = capacity(archive, "--precision", "bf17")
    assert done.stdout.startswith("the archive has no results yet")


def test_a_filter_that_matches_nothing_names_the_known_values(archive: str) -> None:
    add(archive, *fleet())
    done = capacity(archive, "--precision", "bf17")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "no result matches --precision bf17 (known: bf16, fp32)\n"
    done = capacity(archive, "--workload", "matmull", "--size", "large")
    assert done.stdout == (
        "no result matches --workload matmull (known: matmul, membw); "
        "--size large (known: default, small)\n"
    )
    # Known values that match nothing together.
    done = capacity(archive, "--workload", "membw", "--precision", "bf16")
    assert done.stdout == "no result matches --precision bf16 --workload membw together\n"
    done = capacity(archive, "--since", "1d")
    assert done.stdout.startswith("no result since ")
    assert "(--since 1d): the newest ended " in done.stdout


def test_help_documents_every_column(archive: str) -> None:
    done = forked_sustain(["capacity", "--help"], os.environ)
    assert done.returncode == 0, done.stderr
    for column in [*HEADER, "NODE", "STACK", "--size"]:
        assert column in done.stdout, column
    assert "10th percentile" in done.stdout
    assert "spec_ratio" in done.stdout


def test_a_run_without_a_steady_state_counts_on_its_p10(archive: str) -> None:
    """Issue 23: the only fp32 matmul result never settled. It is no longer "no result": its
    p10 over one-second windows stands in, in a section marked as such, and the runs left out
    are counted by why."""
    add(
        archive,
        result(
            device="GPU-0",
            precision="fp32",
            steady_throughput=None,
            classification="no_steady_state",
            p10_throughput=4.6e13,
        ),
        result(device="GPU-1", precision="fp32", outcome="timeout", steady_throughput=None),
        result(device="GPU-2", precision="fp32", outcome="preempted", steady_throughput=None),
        result(device="GPU-3", precision="fp32", steady_throughput=None, classification=None),
        result(device="GPU-0", steady_throughput=7.1e14),  # bf16: another probe
    )
    done = capacity(archive, "--workload", "matmul", "--precision", "fp32")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "matmul fp32 eager (FLOP/s), p10 basis (no steady state)",
        "MODEL                  SIZE     SCOPE   MEDIAN      P10   SPEC  RESULTS  DEVICES",
        "NVIDIA H100 80GB HBM3  default  solo   46.00 T  46.00 T  68.7%        1        1",
        "",
        "runs used: 1 (0 on a steady basis, 1 on a p10 basis)",
        "runs left out: 3 (1 timeout, 1 preempted, 1 ok without a figure)",
    ]
    done = capacity(archive, "--workload", "matmul", "--precision", "fp32", "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    (row,) = answer["rows"]
    assert (row["basis"], row["median"], row["p10"], row["results"]) == ("p10", 4.6e13, 4.6e13, 1)
    assert answer["runs"] == {
        "used": {"steady": 0, "p10": 1},
        "left_out": {
            "failed": 0,
            "timeout": 1,
            "preempted": 1,
            "aborted": 0,
            "insufficient": 0,
            "no_figure": 1,
        },
    }
    # Every probe: the steady bf16 row, then the fp32 one on its p10 basis.
    done = capacity(archive)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stdout.splitlines() if line.startswith("matmul")] == [
        "matmul bf16 eager (FLOP/s)",
        "matmul fp32 eager (FLOP/s), p10 basis (no steady state)",
    ]
    assert done.stdout.endswith(
        "runs used: 2 (1 on a steady basis, 1 on a p10 basis)\n"
        "runs left out: 3 (1 timeout, 1 preempted, 1 ok without a figure)\n"
    )


def test_where_every_run_was_left_out_it_says_why(archive: str) -> None:
    add(
        archive,
        result(precision="fp32", steady_throughput=7.1e13),
        result(precision="bf16", outcome="timeout", steady_throughput=None),
        result(precision="bf16", outcome="failed", steady_throughput=None),
        result(precision="bf16", steady_throughput=None, classification="insufficient"),
    )
    done = capacity(archive, "--precision", "bf16")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "no result matches --precision bf16 (known: fp32)",
        "runs used: 0 (0 on a steady basis, 0 on a p10 basis)",
        "runs left out: 3 (1 failed, 1 timeout, 1 insufficient)",
    ]
    done = capacity(archive, "--precision", "bf16", "--json")
    assert json.loads(done.stdout)["rows"] == []
    assert json.loads(done.stdout)["runs"]["left_out"]["insufficient"] == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--since", "yesterday"), "--since 'yesterday'"),
        (("--by", "gpu"), "invalid choice"),
        (("--scope", "solo"), "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(archive: str, args: tuple[str, ...], needle: str) -> None:
    done = capacity(archive, *args)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert needle in line
