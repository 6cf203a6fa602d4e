"""Fuzzing the three parsers of outside input: the config loader, the `sustain analyze` series
reader and the probe child's JSON-lines protocol.

Fed anything (truncated lines, huge lines, NaN and infinities, negative durations, wrong types,
binary junk, deep nesting, duplicate keys, other encodings, NUL bytes, empty files), they never
crash and never hang: the loaders raise only their documented errors, each a one-line message
that names the file or key at fault; the protocol parser never raises, counts junk and keeps
only what the protocol allows. Then the same through the real command line and a real child.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import textwrap
import tomllib
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import tomli_w
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from agent.analysis.input import (
    LARGEST_VALUE,
    SMALLEST_VALUE,
    SeriesInputError,
    analyze_file,
    read_series,
)
from agent.config import settings as config
from agent.probes.protocol import MAX_LINE_BYTES, Iteration, LineProtocol, lines_of
from agent.probes.runner import CPU, STDERR_LINES, ProbeRunner, ProbeSpec

# Every example is small and parses in milliseconds: the deadline catches a parser that hangs
# or goes quadratic. max_examples keeps each property well under 20 s on a 2-core CI runner.
FUZZ = settings(
    deadline=timedelta(seconds=3),
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for the examples' files (hypothesis runs many examples per test call)."""
    return tmp_path_factory.mktemp("fuzz")


def assert_one_line(message: str, max_length: int = 2000) -> None:
    """Not empty, one line however a terminal or splitlines() counts lines, of bounded length."""
    assert message.strip(), "empty message"
    assert message.isprintable(), f"unprintable characters in {message!r}"
    assert len(message.splitlines()) == 1, message
    assert len(message) <= max_length, f"{len(message)} characters: {message[:200]}..."


# --- Mutations shared by the three parsers --------------------------------------------------

DEEP = [b"[" * 100_000, b'{"a":' * 50_000, b"[" * 900 + b"]" * 900, b"a = " + b"[" * 10_000]
HUGE = [b"1" * 140_000, b"x" * 1_100_000, b"9" * 5_000, b"9" * 400]
ENCODINGS = ["latin-1", "utf-16", "utf-16-be", "utf-32", "cp1252"]


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with up to three mutations: truncated, other bytes spliced in (NUL, binary, deep
    nesting, a huge run of one byte), re-encoded, given a byte order mark, doubled, or replaced
    by binary junk altogether."""
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(
            st.sampled_from(
                ["truncate", "splice", "nul", "deep", "huge", "encode", "bom", "double", "binary"]
            )
        )
        at = draw(st.integers(0, len(data)))
        if kind == "truncate":
            data = data[:at]
        elif kind == "splice":
            data = data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at:]
        elif kind == "nul":
            data = data[:at] + b"\x00" + data[at + 1 :]
        elif kind == "deep":
            data = data[:at] + draw(st.sampled_from(DEEP)) + data[at:]
        elif kind == "huge":
            data = data[:at] + draw(st.sampled_from(HUGE)) + data[at:]
        elif kind == "encode":
            text = data.decode("utf-8", errors="replace")
            data = text.encode(draw(st.sampled_from(ENCODINGS)), errors="replace")
        elif kind == "bom":
            data = draw(st.sampled_from([b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff"])) + data
        elif kind == "double":
            data = data[:at] + data
        else:
            data = draw(st.binary(max_size=200))
    return data


def maybe_mutated(data: bytes) -> st.SearchStrategy[bytes]:
    """``data`` as it is half of the time, so that well-formed input reaches validation."""
    return st.one_of(st.just(data), mutated(data))


# Numbers as they appear in files: awkward ones first.
odd_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, -1.0, 5e-324, 1e-320, 1e-30, 1e30, 1e308, -1e308, 1e-300]),
)
odd_ints = st.one_of(
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([0, -1, 10**400, -(10**400), 2**1024]),
)
json_scalars = st.one_of(st.none(), st.booleans(), odd_floats, odd_ints, st.text(max_size=20))
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


# What a well-behaved child may write besides the fields the agent reads.
clean_json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.integers(min_value=-(2**63), max_value=2**63),
        st.text(max_size=20),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def dumps(value: Any) -> str:
    """JSON as Python writes it: NaN and Infinity included, big integers in full."""
    return json.dumps(value, allow_nan=True)


# --- The config loader ------------------------------------------------------------------------


def _fields(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


SECTIONS: dict[str, list[str]] = {
    name: _fields(cast(type[BaseModel], field.annotation))
    for name, field in config.Settings.model_fields.items()
}
PLAN_KEYS = _fields(config.ProbePlanEntry)

toml_keys = st.text(max_size=10)
toml_scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.datetimes(),
    st.dates(),
    st.times(),
    st.sampled_from(
        [
            "127.0.0.1:9477",
            "[::1]:99999",
            "0 * * * *",
            "*/0 * * * *",
            "sqlite:////tmp/sustain-fuzz.db",
            "sqlite://",
            "nosuchdialect://x",
            "fp32",
            "eager",
            "small",
            "info",
            "",
            "\x00",
            "a\nb",
            "a" * 300,
            "/no/such/dir/x",
        ]
    ),
)
toml_values = st.recursive(
    toml_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(toml_keys, children, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def config_documents(draw: st.DrawFn) -> dict[str, Any]:
    """Known sections and keys (plan entries included) with values of any type, and unknown
    ones, so that validation is reached as well as parsing."""
    document: dict[str, Any] = {}
    names = draw(st.lists(st.sampled_from(sorted(SECTIONS)) | toml_keys, max_size=4, unique=True))
    for name in names:
        if name not in SECTIONS or draw(st.integers(0, 4)) == 0:
            document[name] = draw(toml_values)
            continue
        keys = draw(st.lists(st.sampled_from(SECTIONS[name]) | toml_keys, max_size=4, unique=True))
        section: dict[str, Any] = {}
        for key in keys:
            if name == "probing" and key == "plan" and draw(st.booleans()):
                entries = st.lists(
                    st.dictionaries(st.sampled_from(PLAN_KEYS) | toml_keys, toml_values),
                    max_size=3,
                )
                section[key] = draw(entries)
            else:
                section[key] = draw(toml_values)
        document[name] = section
    return document


TOML_FRAGMENTS = [
    "[agent]",
    "[agent",
    "[[probing.plan]]",
    "[exporter]\nlisten = ",
    'node = "unterminated',
    '"""',
    "a = 1\na = 2",
    "[agent]\n[agent]",
    "x = [1, 'a']",
    "= = =",
    "key = inf",
    "key = nan",
    "window_seconds = -1e400",
    "buffer_samples = " + "9" * 5000,
    "a." * 2000 + "b = 1",
    "a = {b = {c = {d = 1}}}",
    "\\u0000",
    "k = '\\u0000'",
    'k = "\\u0000"',
]


@st.composite
def config_files(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        try:
            text = tomli_w.dumps(draw(config_documents()))
        except (TypeError, ValueError):
            assume(False)
            raise
        return draw(maybe_mutated(text.encode()))
    parts = st.sampled_from(TOML_FRAGMENTS) | st.text(max_size=30)
    return draw(mutated("\n".join(draw(st.lists(parts, max_size=8))).encode()))


def _shown_key(key: str) -> str:
    """A key as problems name it: escaped where unprintable, cut to 200 characters."""
    if not key:
        return '""'
    if not key.isprintable():
        key = repr(key)[1:-1]
    return key if len(key) <= 200 else key[:200] + "..."


def check_config(path: Path, data: bytes) -> None:
    """The property: problems (or none), each one line naming the file or a key of the file."""
    path.write_bytes(data)
    problems = config.check_file(path)
    assert isinstance(problems, list)
    try:
        top = set(tomllib.loads(data.decode()))
    except (ValueError, RecursionError):  # a file-level problem then
        top = set()
    for problem in problems:
        assert_one_line(problem)
        names_the_file = problem.startswith(f"{path}: ")
        names_a_key = any(
            problem.startswith(f"{_shown_key(key)}.") or problem.startswith(f"{_shown_key(key)}: ")
            for key in top
        )
        assert names_the_file or names_a_key, problem
        assert problem.partition(": ")[2].strip(), problem
    if problems:
        with pytest.raises(config.ConfigError) as info:
            config.load(path, use_env=False)
        assert info.value.problems
        return
    settings_ = config.load(path, use_env=False)

    def finite(value: Any) -> None:  # what validation let through is usable
        if isinstance(value, float):
            assert math.isfinite(value)
        elif isinstance(value, str):
            assert "\x00" not in value
        elif isinstance(value, dict):
            for item in value.values():
                finite(item)
        elif isinstance(value, list):
            for item in value:
                finite(item)

    finite(settings_.model_dump(mode="json"))


@pytest.mark.timeout(90)
@settings(FUZZ, max_examples=250)
@given(data=config_files())
@example(data=b"")
@example(data=b"a = {b = 1}\n" + b"a." * 3_000 + b"c = 2\n")  # a TOML error quoting the key
@example(data=b"a = " + b"[" * 100_000)
@example(data=b"a = " + b"{b=" * 5_000 + b"1" + b"}" * 5_000)
@example(data=b"[sampler]\nbuffer_samples = " + b"9" * 5_000)
@example(data='"a\nb" = 1\n[agent]\n"c\u2028d" = 2\n'.encode())
@example(data=b"[sampler]\nstall_seconds = inf\n[archive]\nretention_days = nan\n")
@example(data=b'[agent]\ndata_dir = "\\u0000"\n[exporter]\nlisten = "' + b"x" * 500_000 + b'"\n')
@example(data="[agent]\nnode = 'é'\n".encode("latin-1"))
@example(data="[agent]\nnode = 'x'\n".encode("utf-16"))
@example(data=b"[agent]\nnode = 'x'\x00\n")
@example(data=b"\xef\xbb\xbf[agent]\n")
@example(data=b" " * (2 << 20))
def test_config_loader_never_crashes(workdir: Path, data: bytes) -> None:
    check_config(workdir / "sustain.toml", data)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "name", ["no-such-dir/sustain.toml", "file/sustain.toml", "directory", "x" * 300]
)
def test_config_loader_unreadable_paths(tmp_path: Path, name: str) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "directory").mkdir()
    problems = config.check_file(tmp_path / name)
    assert len(problems) == 1
    assert_one_line(problems[0])
    assert problems[0].startswith(f"{tmp_path / name}: ")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "value", ["/no/such/dir/web.yml", "{file}/web.yml", "{directory}", "{long}", "a\\u0000b"]
)
def test_config_path_values_are_problems_not_crashes(tmp_path: Path, value: str) -> None:
    """Path-valued keys that validation opens (exporter.web_config_file) at odd places."""
    (tmp_path / "file").write_text("")
    (tmp_path / "directory").mkdir()
    value = value.format(file=tmp_path / "file", directory=tmp_path / "directory", long="y" * 300)
    check_config(tmp_path / "sustain.toml", f'[exporter]\nweb_config_file = "{value}"\n'.encode())


# --- The `sustain analyze` series reader --------------------------------------------------------

good_values = st.floats(min_value=1e-4, max_value=1e4)
cells = st.one_of(
    good_values.map(repr),
    good_values.map(repr),
    good_values.map(repr),
    odd_floats.map(repr),
    odd_ints.map(str),
    st.sampled_from(["", " ", "nan", "-inf", "Infinity", "1e400", "1_000", "0x10", "\uff11", "-0"]),
    st.text(max_size=10),
)


@st.composite
def series_texts(draw: st.DrawFn) -> str:
    """CSV with a header, a JSON array, or JSON lines, of values good and bad."""
    form = draw(st.sampled_from(["csv", "json", "jsonl"]))
    clean = draw(st.booleans())  # only good numbers: the analysis is reached
    if form == "csv":
        width = draw(st.sampled_from([1, 1, 2, 3]))
        names = st.sampled_from(["s", "a", "seconds"]) | st.text(max_size=6)
        header = draw(st.lists(names, min_size=width, max_size=width))
        row = st.lists(good_values.map(repr) if clean else cells, min_size=0, max_size=width + 1)
        rows = draw(st.lists(row, max_size=30))
        lines = [",".join(header)] + [",".join(row) for row in rows]
        return "\n".join(lines) + draw(st.sampled_from(["", "\n", "\r\n"]))
    items = st.one_of(
        good_values,
        good_values,
        good_values,
        json_values,
        st.dictionaries(st.sampled_from(["s", "a"]) | st.text(max_size=4), json_values),
    )
    values = draw(st.lists(good_values if clean else items, max_size=40))
    if form == "json":
        return dumps(values)
    return "\n".join(dumps(v if isinstance(v, dict) else {"s": v}) for v in values)


def check_series(path: Path, data: bytes, column: str | None) -> None:
    """The property: finite positive values in range that the analysis takes without a
    warning, or one SeriesInputError naming the file."""
    path.write_bytes(data)
    for kind in ("duration", "throughput"):
        try:
            values = read_series(path, column, kind)
        except SeriesInputError as e:
            message = str(e)
            assert_one_line(message, max_length=len(str(path)) + 500)
            assert message.startswith(f"{path}: "), message
            assert message.removeprefix(f"{path}: ").strip(), message
            continue
        assert values.ndim == 1
        assert values.size > 0
        assert all(SMALLEST_VALUE <= v <= LARGEST_VALUE for v in values)
        if values.size > 200:
            continue  # the analysis of long series is tested elsewhere; this is about parsing
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an overflow would be a second line on stderr
            analyze_file(path, column, kind)


@pytest.mark.timeout(90)
@settings(FUZZ, max_examples=250)
@given(
    data=series_texts().flatmap(lambda text: maybe_mutated(text.encode())),
    column=st.one_of(st.none(), st.sampled_from(["s", "a", ""]), st.text(max_size=4)),
)
@example(data=b"", column=None)
@example(data=b"\n \n\t\n", column=None)
@example(data=b"[" * 100_000, column=None)
@example(data=b'[{"a":' * 50_000, column=None)
@example(data=b"[" + b"9" * 400 + b"]", column=None)
@example(data=b"[" + b"9" * 5_000 + b"]", column=None)
@example(data=b'{"s": ' + b"9" * 400 + b"}\n", column="s")
@example(data=b"seconds\n" + b"1" * 200_000 + b"\n", column=None)
@example(data=b'[{"a\\nb": 1, "c\\u2028d": 2}]', column=None)
@example(data=b'{"s": "x\xe2\x80\xa8y"}\n', column="s")
@example(data=b"[{}]", column=None)
@example(data=b"[" + b",".join([b"1e-320"] * 30) + b"]", column=None)
@example(data=b"[" + b",".join([b"1e300", b"1e-300"] * 30) + b"]", column=None)
@example(data=b"\xef\xbb\xbfseconds\n0.1\n0.2\n", column="seconds")
@example(data="seconds\n0.1\n".encode("utf-16"), column=None)
@example(data="s\xe9conds\n0.1\n".encode("latin-1"), column=None)
@example(data=b"seconds\n0.1\x00\n0.2\n", column=None)
@example(data=b'{"s": 1, "s": -2}\n', column="s")
@example(data=b"[0.1, 0.2, 0.", column=None)
@example(data=(",".join(f"c{i}" for i in range(10_000)) + "\n").encode(), column=None)
def test_series_reader_never_crashes(workdir: Path, data: bytes, column: str | None) -> None:
    check_series(workdir / "series.txt", data, column)


# --- The probe protocol -------------------------------------------------------------------------

good_times = st.floats(min_value=0, max_value=4e9)
good_work = st.one_of(st.floats(min_value=0, max_value=1e300), st.integers(0, 10**300))


@st.composite
def good_iterations(draw: st.DrawFn) -> dict[str, Any]:
    start, end = sorted(draw(st.lists(good_times, min_size=2, max_size=2)))
    message: dict[str, Any] = {
        "event": "iteration",
        "index": draw(st.integers(0, 2**63)),
        "start": start,
        "end": end,
        "work": draw(good_work),
    }
    if draw(st.booleans()):
        message["phase"] = draw(st.text(max_size=8))
    extra = draw(st.dictionaries(st.text(max_size=6), clean_json_values, max_size=2))
    return extra | message


# What makes an iteration junk: one of these, and the rest good.
bad_numbers: st.SearchStrategy[Any] = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.sampled_from([10**400, -(10**400), 2**1024]),
    st.sampled_from(["1.0", "NaN", None, True, False, [], {}]),
)


@st.composite
def bad_iterations(draw: st.DrawFn) -> dict[str, Any]:
    message = draw(good_iterations())
    flaw = draw(
        st.sampled_from(["number", "negative duration", "negative work", "index", "missing"])
    )
    if flaw == "number":
        message[draw(st.sampled_from(["start", "end", "work"]))] = draw(bad_numbers)
    elif flaw == "negative duration":
        message["start"], message["end"] = 2.0, draw(st.floats(max_value=1.9, allow_nan=False))
    elif flaw == "negative work":
        message["work"] = draw(st.floats(max_value=-1e-300, allow_nan=False))
    elif flaw == "index":
        message["index"] = draw(
            st.one_of(
                st.integers(max_value=-1),
                st.floats(allow_nan=True),
                bad_numbers,
                st.text(max_size=3),
            )
        )
    else:
        del message[draw(st.sampled_from(["index", "start", "end", "work"]))]
    return message


def protocol_messages() -> st.SearchStrategy[dict[str, Any]]:
    other = st.fixed_dictionaries(
        {"event": st.sampled_from(["manifest", "result", "unsupported", "bogus", ""])},
        optional={
            "unit": st.text(max_size=6) | json_values,
            "throughput": st.floats(0, 1e15) | json_values,
            "latency_seconds": st.dictionaries(st.sampled_from(["p50", "p99"]), json_values)
            | json_values,
            "backends": st.dictionaries(st.text(max_size=6), clean_json_values) | json_values,
            "reason": st.text(max_size=30) | json_values,
            "torch": st.text(max_size=6) | json_values,
        },
    )
    return st.one_of(good_iterations(), bad_iterations(), other)


protocol_lines = st.one_of(
    protocol_messages().map(lambda m: (dumps(m) + "\n").encode()).flatmap(maybe_mutated),
    json_values.map(lambda v: (dumps(v) + "\n").encode()),
    st.binary(max_size=100),
    st.sampled_from(DEEP + HUGE + [b"\n", b"", b"\x00\n", b"{}\n", b'{"event": NaN}\n']),
)


def all_finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) <= sys.float_info.max
    if isinstance(value, dict):
        return all(all_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(all_finite(v) for v in value)
    return True


def trusted(iteration: Iteration) -> bool:
    return (
        type(iteration.index) is int
        and iteration.index >= 0
        and all(math.isfinite(v) for v in (iteration.start, iteration.end, iteration.work))
        and iteration.start <= iteration.end
        and iteration.work >= 0
        and (iteration.phase is None or isinstance(iteration.phase, str))
    )


@pytest.mark.timeout(90)
@settings(FUZZ, max_examples=300)
@given(lines=st.lists(protocol_lines, max_size=12))
@example(  # duplicate keys: the last one counts, as for json.loads everywhere
    lines=[
        b'{"event": "iteration", "index": 0, "start": 1, "end": 2, "work": 1, "end": 0}\n',
        b'{"event": "result", "event": "manifest", "unit": "B/s", "unit": 5}\n',
        b'{"event": "unsupported", "reason": "x", "reason": "a\\nb\\u2028c\\u001b[2J"}\n',
    ]
)
def test_protocol_never_raises_and_counts_junk(lines: list[bytes]) -> None:
    seen: list[Iteration] = []
    protocol = LineProtocol(seen.append)
    for raw in lines:
        errors, iterations = protocol.errors, len(protocol.iterations)
        protocol.feed(raw)
        junk, kept = protocol.errors - errors, len(protocol.iterations) - iterations
        assert (junk, kept) in ((1, 0), (0, 1), (0, 0))
        if (junk, kept) == (0, 0):  # a manifest, result or unsupported line: an object
            message = json.loads(raw)
            assert message["event"] in ("manifest", "result", "unsupported")
            assert all_finite(message)
    assert seen == protocol.iterations
    assert all(trusted(i) for i in protocol.iterations)
    for record in (protocol.manifest, protocol.result):
        assert record is None or all_finite(record)
    if protocol.result is not None:
        throughput = protocol.result.get("throughput")
        assert throughput is None or (type(throughput) in (int, float) and throughput >= 0)
        assert isinstance(protocol.result.get("latency_seconds") or {}, dict)
    if protocol.manifest is not None:
        assert isinstance(protocol.manifest.get("backends") or {}, dict)
        assert isinstance(protocol.manifest.get("unit") or "", str)
    if protocol.unsupported is not None:
        assert_one_line(protocol.unsupported, max_length=500)


@pytest.mark.timeout(60)
@settings(FUZZ, max_examples=300)
@given(message=bad_iterations())
@example(message={"event": "iteration", "index": 0, "start": 2.0, "end": 1.0, "work": 1})
@example(message={"event": "iteration", "index": 0, "start": math.nan, "end": 1.0, "work": 1})
@example(message={"event": "iteration", "index": 10**400, "start": 0, "end": 1.0, "work": 1})
@example(message={"event": "iteration", "index": 0, "start": 0, "end": 1.0, "work": 10**400})
@example(message={"event": "iteration", "index": True, "start": 0, "end": 1, "work": 1})
@example(message={"event": "iteration", "index": 0, "start": "0", "end": 1, "work": 1})
def test_iteration_lines_with_bad_numbers_are_junk(message: dict[str, Any]) -> None:
    seen: list[Iteration] = []
    protocol = LineProtocol(seen.append)
    protocol.feed((dumps(message) + "\n").encode())
    assert (protocol.errors, protocol.iterations, seen) == (1, [], [])


@pytest.mark.timeout(60)
@settings(FUZZ, max_examples=200)
@given(message=good_iterations())
def test_valid_iteration_lines_are_kept(message: dict[str, Any]) -> None:
    protocol = LineProtocol(None)
    protocol.feed((dumps(message) + "\n").encode())
    assert protocol.errors == 0
    assert protocol.iterations == [
        Iteration(
            message["index"],
            float(message["start"]),
            float(message["end"]),
            float(message["work"]),
            message.get("phase"),
        )
    ]


@pytest.mark.timeout(60)
@settings(FUZZ, max_examples=200)
@given(
    pieces=st.lists(
        st.one_of(
            st.binary(max_size=40), st.integers(0, 100).map(lambda n: b"y" * n), st.just(b"\n")
        ),
        max_size=20,
    ),
    limit=st.integers(1, 32),
)
def test_line_reading_is_bounded(pieces: list[bytes], limit: int) -> None:
    """Short lines come whole; of a long one, only a first piece of limit + 1 bytes."""
    data = b"".join(pieces)
    got = list(lines_of(io.BytesIO(data), limit))
    assert all(0 < len(raw) <= limit + 1 for raw in got)
    *complete, last = data.split(b"\n")
    expected = [line + b"\n" for line in complete] + ([last] if last else [])
    assert len(got) == len(expected)
    for raw, line in zip(got, expected, strict=True):
        assert raw == (line if len(line) <= limit + 1 else line[: limit + 1])


# --- A real child that writes junk ---------------------------------------------------------------

SPEC = ProbeSpec("matmul", "fp32", "eager", 0.5, CPU)
PRELUDE = """
import json, sys, time
out = sys.stdout.buffer
def line(message):
    out.write(json.dumps(message).encode() + b"\\n")
    out.flush()
line({"event": "manifest", "workload": "matmul", "unit": "FLOP/s"})
now = time.time()
"""
RESULT = 'line({"event": "result", "iterations": 2, "throughput": 2e9})\n'


def run_child(body: str) -> Any:
    runner = ProbeRunner(startup_timeout_seconds=30)
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    return runner.run(SPEC, command=[sys.executable, "-c", code])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("body", "outcome", "junk", "kept"),
    [
        pytest.param(
            'out.write(b"x" * 10_000_000); out.flush()\n',
            "failed",
            1,
            0,
            id="10-MB-line-without-newline-then-exit",
        ),
        pytest.param(
            'out.write(b"x" * 10_000_000 + b"\\n")\n'
            'line({"event": "iteration", "index": 0, "start": now, "end": now + 1, "work": 1})\n'
            + RESULT,
            "ok",
            1,
            1,
            id="10-MB-line-then-a-run",
        ),
        pytest.param(
            'out.write(bytes(range(256)) * 1000 + b"\\n\\x00\\xff\\n")\n'
            'out.write("{\\"event\\": \\"manifest\\"}\\n".encode("utf-16") + b"\\n")\n' + RESULT,
            "ok",
            None,
            0,
            id="binary-and-utf-16",
        ),
        pytest.param(
            'out.write(b\'{"event": "iteration", "index": 0, "start": NaN, '
            '"end": 1, "work": 1}\\n\')\n'
            'line({"event": "iteration", "index": 1, "start": now, "end": now - 1, "work": 1})\n'
            'line({"event": "iteration", "index": 2, "start": now, "end": now, "work": -1})\n'
            'line({"event": "iteration", "index": 3, "start": now, "end": 1e400, "work": 1})\n'
            'line({"event": "result", "iterations": 1, "throughput": float("inf")})\n'
            'line({"event": "iteration", "index": 4, "start": now, "end": now + 1, "work": 1})\n'
            + RESULT,
            "ok",
            5,
            1,
            id="nan-inf-and-negative-durations",
        ),
        pytest.param(
            # Deep nesting used to kill the reader thread; then the pipe filled up and the child
            # blocked until the timeout. 3000 lines after it make sure the reader goes on.
            'out.write(b"[" * 500_000 + b"\\n")\n'
            "for i in range(3000):\n"
            '    line({"event": "iteration", "index": i, "start": now, "end": now, "work": 1})\n'
            + RESULT,
            "ok",
            1,
            3000,
            id="deep-nesting-then-3000-lines",
        ),
        pytest.param(
            'sys.stderr.buffer.write(b"e" * 5_000_000); sys.stderr.flush(); sys.exit(3)\n',
            "failed",
            0,
            0,
            id="5-MB-stderr-line-and-exit-3",
        ),
    ],
)
def test_a_child_writing_junk_ends_with_an_outcome(
    body: str, outcome: str, junk: int | None, kept: int
) -> None:
    run = run_child(body)
    assert run.outcome == outcome, run.reason
    if outcome != "ok":
        assert run.reason
    if junk is not None:
        assert run.protocol_errors == junk
    else:
        assert run.protocol_errors > 0
    assert len(run.iterations) == kept
    assert all(trusted(i) for i in run.iterations)
    assert run.result is None or all_finite(run.result)
    assert len(run.stderr_tail.splitlines()) <= STDERR_LINES
    assert all(len(line) <= 500 for line in run.stderr_tail.splitlines())
    assert MAX_LINE_BYTES < 10_000_000  # the 10 MB lines above are over the limit


# --- Through the real command line ----------------------------------------------------------------


def sustain(*commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """`python -m agent ARGS` for each list of arguments, side by side (each start-up costs a
    second or two of imports)."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "agent", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        for args in commands
    ]
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=120)
        results.append(
            subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        )
    return results


def _file(data: bytes) -> Callable[[Path], Path]:
    def make(directory: Path) -> Path:
        path = directory / "junk"
        path.write_bytes(data)
        return path

    return make


ANALYZE_JUNK: dict[str, Callable[[Path], Path]] = {
    "binary": _file(bytes(range(256)) * 4),
    "utf-16": _file("seconds\n0.1\n0.2\n".encode("utf-16")),
    "nul": _file(b"seconds\n0.1\x00\n0.2\n"),
    "deep-json": _file(b"[" * 100_000),
    "big-integer": _file(b"[" + b"9" * 5_000 + b"]"),
    "10-MB-line": _file(b"seconds\n" + b"1" * 10_000_000),
    "key-with-newline": _file(b'[{"a\\nb": 1, "c": 2}]'),
    "tiny-durations": _file(b"[" + b",".join([b"1e-320"] * 40) + b"]"),
    "directory": lambda directory: directory,
    "dev-zero": lambda directory: Path("/dev/zero"),
}

CONFIG_JUNK: dict[str, Callable[[Path], Path]] = {
    "utf-16": _file("[agent]\nnode = 'x'\n".encode("utf-16")),
    "nul": _file(b"[agent]\nnode = 'x'\x00\n"),
    "deep-nesting": _file(b"a = " + b"[" * 100_000),
    "big-integer": _file(b"[sampler]\nbuffer_samples = " + b"9" * 5_000 + b"\n"),
    "key-with-newline": _file(b'[agent]\n"a\\nb" = 1\n'),
    "infinity": _file(b"[sampler]\nstall_seconds = inf\n"),
    "nul-in-a-path": _file(b'[agent]\ndata_dir = "/tmp/a\\u0000b"\n'),
    "not-a-directory": lambda directory: _file(b"")(directory) / "sustain.toml",
    "dev-zero": lambda directory: Path("/dev/zero"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(ANALYZE_JUNK))
def test_analyze_junk_file_is_one_line_exit_2(tmp_path: Path, name: str) -> None:
    path = ANALYZE_JUNK[name](tmp_path)
    (result,) = sustain(["analyze", str(path)])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"sustain: error: {path}: "), lines[0]
    assert_one_line(lines[0])
    assert result.stdout == ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(CONFIG_JUNK))
def test_config_junk_file_is_one_line_exit_2(tmp_path: Path, name: str) -> None:
    """`config check` prints its problems on stdout (documented: one line per problem); every
    other command that loads the file prints them on stderr as `sustain: config: ...`."""
    path = CONFIG_JUNK[name](tmp_path)
    check, show = sustain(["config", "check", str(path)], ["config", "show", "--config", str(path)])
    assert check.returncode == 2, check.stdout + check.stderr
    assert "Traceback" not in check.stderr
    assert check.stderr == ""
    problems = check.stdout.splitlines()
    assert len(problems) == 1, check.stdout
    assert_one_line(problems[0])
    assert show.returncode == 2, show.stdout + show.stderr
    assert "Traceback" not in show.stderr
    assert show.stderr.splitlines() == [f"sustain: config: {problems[0]}"]
    assert show.stdout == ""
