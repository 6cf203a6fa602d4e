"""The test runner itself: what tests/run.sh relies on from pytest-xdist.

The suite shares expensive setup (a Prometheus stack, a seeded fleet archive) among the tests of
an ``xdist_group``, which ``--dist loadgroup`` sends to one worker. pytest 9.2 with pytest-xdist
3.8 stopped honouring the groups without a word (pytest-dev/pytest-xdist#1386): each test of a
group ran on whichever worker was free and built the shared setup again. This test fails when the
installed pair loses the groups again.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

GROUPED = """
import os

import pytest


@pytest.mark.xdist_group("shared")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    with open("workers.txt", "a") as out:
        out.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")


@pytest.mark.parametrize("i", range(6))
def test_free(i):
    pass
"""


def test_loadgroup_sends_a_group_to_one_worker(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "no:cacheprovider"),
            *("-n", "3", "--dist", "loadgroup", "-q", "test_grouped.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    workers = (tmp_path / "workers.txt").read_text().split()
    assert len(workers) == 6
    assert len(set(workers)) == 1, f"one group ran on several workers: {sorted(set(workers))}"
