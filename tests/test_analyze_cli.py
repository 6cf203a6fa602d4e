"""`sustain analyze` as a user runs it: a real subprocess on files in each accepted format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REAL = Path(__file__).parent / "data" / "steady-state-real"


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", "analyze", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def warmup_series(n: int = 400) -> list[float]:
    """Durations: 2x slower for the first 100 iterations, then steady at 1 ms."""
    return [0.002 if i < 100 else 0.001 * (1 + 0.002 * ((i * 7919) % 11 - 5)) for i in range(n)]


@pytest.mark.parametrize("form", ["csv", "json", "jsonl"])
def test_json_output_in_every_input_format(tmp_path: Path, form: str) -> None:
    values = warmup_series()
    path = tmp_path / f"series.{form}"
    if form == "csv":
        path.write_text("seconds\n" + "\n".join(map(repr, values)) + "\n")
    elif form == "json":
        path.write_text(json.dumps(values))
    else:
        path.write_text("\n".join(json.dumps({"seconds": v}) for v in values) + "\n")
    result = analyze(str(path), "--json")
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    for key in (
        "classification",
        "n",
        "steady_start_index",
        "steady_throughput",
        "steady_ci",
        "peak_throughput",
        "sustained_ratio",
        "changepoints",
        "warmup_seconds",
    ):
        assert key in output
    assert output["classification"] == "warmup"
    assert output["n"] == 400
    assert abs(output["steady_start_index"] - 100) <= 5
    assert output["steady_throughput"] == pytest.approx(1000, rel=0.01)
    low, high = output["steady_ci"]
    assert low <= output["steady_throughput"] <= high
    assert output["warmup_seconds"] == pytest.approx(0.2, rel=0.05)


def test_readable_summary_and_tolerance_on_real_data() -> None:
    path = sorted(REAL.glob("*.csv"))[0]
    summary = analyze(str(path))
    assert summary.returncode == 0, summary.stderr
    assert "3000 iterations" in summary.stdout
    strict = json.loads(analyze(str(path), "--json", "--tolerance", "0.01").stdout)
    loose = json.loads(analyze(str(path), "--json", "--tolerance", "0.05").stdout)
    assert (strict["tolerance"], loose["tolerance"]) == (0.01, 0.05)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no such file"),
        ("seconds\n", "no values"),
        ("seconds\n0.1\nabc\n", "line 3: 'abc' is not a number"),
        ("seconds\n0.1\nnan\n", "line 3"),
        ("seconds\n0.1\ninf\n", "line 3"),
        ("seconds\n0.1\n-0.5\n", "line 3"),
        ('[0.1, "x"]', "'x'"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path: Path, content: str | None, expected: str) -> None:
    path = tmp_path / ("series.json" if content and content.startswith("[") else "series.csv")
    if content is not None:
        path.write_text(content)
    result = analyze(str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr
