"""`sustain analyze` as a user runs it: a real subprocess on files in each accepted format."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REAL = Path(__file__).parent / "data" / "steady-state-real"


def analyze(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", "analyze", *args],
        input=stdin,
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


def analyze_stdin(text: str, *args: str) -> subprocess.CompletedProcess[str]:
    return analyze("-", *args, stdin=text)


def test_dash_reads_standard_input() -> None:
    text = "seconds\n" + "\n".join(map(repr, warmup_series())) + "\n"
    result = analyze_stdin(text, "--json", "--column", "seconds")
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert (output["classification"], output["n"]) == ("warmup", 400)
    bad = analyze_stdin("seconds\n0.1\nabc\n")
    assert bad.returncode == 2
    assert bad.stderr == "sustain: error: stdin: line 3: 'abc' is not a number\n"
    closed = subprocess.run(
        f"exec {shlex.quote(sys.executable)} -m agent analyze - <&-",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (closed.returncode, closed.stderr) == (2, "sustain: error: stdin: closed\n")


def test_a_csv_without_a_header_is_all_data(tmp_path: Path) -> None:
    """The first value is the first iteration, not a column name; with a header, as before."""
    values = warmup_series()
    bare = tmp_path / "bare.csv"
    bare.write_text("\n".join(map(repr, values)) + "\n")
    headed = tmp_path / "headed.csv"
    headed.write_text("step,seconds\n" + "".join(f"{i},{v!r}\n" for i, v in enumerate(values)))
    two = tmp_path / "two.csv"
    two.write_text("".join(f"{i},{v!r}\n" for i, v in enumerate(values)))
    runs = {
        "bare": analyze(str(bare), "--json"),
        "headed": analyze(str(headed), "--json", "--column", "seconds"),
        "numbered": analyze(str(two), "--json", "--column", "2"),
    }
    for name, result in runs.items():
        assert result.returncode == 0, (name, result.stderr)
        output = json.loads(result.stdout)
        assert (output["n"], output["steady_start_index"]) == (400, 100), name
    several = analyze(str(two))
    assert several.returncode == 2
    assert "several columns (1, 2" in several.stderr
    assert "no header" in several.stderr


def test_warmup_is_stated_in_seconds_and_throughput(tmp_path: Path) -> None:
    durations = tmp_path / "durations.csv"
    durations.write_text("seconds\n" + "\n".join(map(repr, warmup_series())) + "\n")
    text = analyze(str(durations))
    assert text.returncode == 0, text.stderr
    assert "warm-up   0.2 s (100 iterations) at 500 iterations/s" in text.stdout.splitlines()
    output = json.loads(analyze(str(durations), "--json").stdout)
    assert output["warmup_seconds"] == pytest.approx(0.2)
    assert output["warmup_throughput"] == pytest.approx(500.0)
    assert output["steady_start_index"] == 100
    # Throughputs carry no times: the warm-up is stated in iterations.
    throughputs = tmp_path / "throughputs.csv"
    throughputs.write_text("".join(f"{1 / v!r}\n" for v in warmup_series()))
    text = analyze(str(throughputs), "--kind", "throughput")
    assert text.returncode == 0, text.stderr
    assert "warm-up   100 iterations at 500 work/s" in text.stdout.splitlines()
    output = json.loads(analyze(str(throughputs), "--kind", "throughput", "--json").stdout)
    assert output["warmup_seconds"] is None
    assert output["warmup_throughput"] == pytest.approx(500.0)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"a":1}', "one JSON object, not a series"),
        ('{\n  "seconds": [0.1, 0.2]\n}\n', "one JSON object, not a series"),
        ("", "empty"),
        ("\n \n", "empty"),
        ("hello world\n", "no values: only a header line ('hello world')"),
        ('"just text"\n', "no values: only a header line ('just text')"),
    ],
)
def test_input_that_is_no_series_is_one_line_exit_2(
    tmp_path: Path, content: str, expected: str
) -> None:
    path = tmp_path / "input"
    path.write_text(content)
    for result, name in ((analyze(str(path)), str(path)), (analyze_stdin(content), "stdin")):
        assert result.returncode == 2, result.stdout
        assert result.stderr.startswith(f"sustain: error: {name}: {expected}"), result.stderr
        assert len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stdout == ""


def test_a_real_but_short_series_is_insufficient(tmp_path: Path) -> None:
    for content in ('[{"a": 1}]', '{"a": 1}\n{"a": 2}\n', "0.1\n0.2\n", "[0.1, 0.2, 0.3]"):
        result = analyze_stdin(content)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("insufficient ("), content
