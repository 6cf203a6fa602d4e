"""A new user's first hour, round 2 (issue 27): what a first try on a CPU-only node ran into.

Each test here failed on the main branch before the change it covers: a closed pipe ended in a
traceback, a workload the CPU cannot run started a child (or was skipped as busy) before saying
so, `config check` passed what the agent or `db upgrade` refused later, and a misspelt key or
section got no suggestion.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cpu_wrapper, wrapped_runs
from test_bounded_runs import iteration_capped_python

from agent.config import settings as config
from workloads.progress import AFTER_SECONDS

ROOT = Path(__file__).resolve().parent.parent
HEADING_END = ("OUTCOME", "FIGURE", "OR", "WHY")  # of `sustain runs`


def _env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SUSTAIN_", "FAKENVML_"))}
    return base | extra


def _sustain(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        capture_output=True,
        text=True,
        env=env or _env(),
        timeout=120,
        check=False,
    )


def _into_closed_pipe(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, module: str = "agent"
) -> subprocess.CompletedProcess[str]:
    """`sustain ARGS` with standard output a pipe whose reader has gone (`... | head` once head
    has exited): its first write fails with EPIPE, whenever it comes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=env or _env(),
            timeout=300,
            check=False,
        )
    finally:
        os.close(write_end)


def test_help_into_a_closed_pipe_is_no_traceback(tmp_path: Path) -> None:
    """argparse itself drops what it cannot write of a help text (it ignores OSError there), so
    `sustain --help | head -1` ends 0, without a traceback."""
    done = _into_closed_pipe(["--help"], tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["analyze", "SERIES", "--json"],
        ["analyze", "SERIES"],
        ["config", "show"],
        ["capacity", "--database", "DATABASE"],
        ["stack", "show", "--database", "DATABASE"],
    ],
    ids=["analyze-json", "analyze", "config-show", "capacity", "stack-show"],
)
def test_a_closed_pipe_ends_quietly_with_the_status_of_sigpipe(
    tmp_path: Path, args: list[str]
) -> None:
    series = tmp_path / "series.csv"
    series.write_text("".join(f"{1.0 + (i % 7) * 0.001}\n" for i in range(400)))
    database = f"sqlite:///{tmp_path / 'sustain.db'}"
    argv = [{"SERIES": str(series), "DATABASE": database}.get(arg, arg) for arg in args]
    if "DATABASE" in args:  # an archive with its tables and no results
        done = _sustain("db", "upgrade", "--database", database)
        assert done.returncode == 0, done.stderr
    done = _into_closed_pipe(argv, tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    assert "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 141, (done.returncode, done.stderr)


@pytest.mark.slow  # probe or torch children end to end (left out of the quick tier)
def test_a_probe_into_a_closed_pipe_is_archived_still(tmp_path: Path) -> None:
    """`sustain probe --record | head`: the output is lost with the reader, never the run."""
    database = tmp_path / "sustain.db"
    # Capped by iterations, not time: a loaded machine makes the run longer, never short of the
    # analysis minimum (tests/test_bounded_runs.py, iteration_capped_python).
    capped = iteration_capped_python(tmp_path, 80)  # membw: 40 of each of its two phases
    (tmp_path / "sustain.toml").write_text(f'[probing]\npython = "{capped}"\n')
    args = ["probe", "--config", str(tmp_path / "sustain.toml"), "--workload", "membw"]
    args += ["--size", "small", "--duration", "60", "--device", "cpu", "--force", "--record"]
    args += ["--json", "--database", f"sqlite:///{database}"]
    done = _into_closed_pipe(args, tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 141, (done.returncode, done.stderr)
    with sqlite3.connect(database) as connection:
        rows = connection.execute("SELECT workload, outcome FROM probe_runs").fetchall()
    assert rows == [("membw", "ok")], rows


@pytest.mark.parametrize(
    ("workload", "precision", "reason"),
    [
        ("h2d", "fp32", "h2d needs a CUDA device"),
        ("d2h", "fp32", "d2h needs a CUDA device"),
        ("matmul", "tf32", "tf32 is a CUDA tensor-core mode"),
        ("matmul", "fp8", "needs a CUDA device with compute capability >= 8.9"),
    ],
)
def test_what_the_cpu_cannot_run_is_unsupported_before_any_child(
    tmp_path: Path, workload: str, precision: str, reason: str
) -> None:
    """Without --force (busy or not: no load makes it runnable) and no child started."""
    wrapper, log = cpu_wrapper(tmp_path)
    (tmp_path / "sustain.toml").write_text(f'[probing]\npython = "{wrapper}"\n')
    done = _sustain(
        *("probe", "--config", str(tmp_path / "sustain.toml"), "--data-dir", str(tmp_path)),
        *("--workload", workload, "--precision", precision, "--device", "cpu", "--json"),
    )
    assert done.returncode == 0, done.stderr
    (run,) = json.loads(done.stdout)["runs"]
    assert (run["outcome"], run["workload"], run["precision"]) == (
        "unsupported",
        workload,
        precision,
    )
    assert reason in run["reason"]
    assert wrapped_runs(log) == [], "a child was started for it"


def test_the_catalogue_says_what_the_child_says() -> None:
    """The up-front reasons are the workloads' own, word for word, on this CPU."""
    from workloads import device
    from workloads.catalog import WORKLOADS, unsupported_up_front
    from workloads.registry import WORKLOADS as CLASSES

    cpu = device.probe("cpu")
    for name, declared in WORKLOADS.items():
        for precision in declared.precisions:
            up_front = unsupported_up_front(name, precision, "cpu", None)
            if up_front is not None:
                child = CLASSES[name].unsupported_reason(cpu, precision, "eager")
                assert child == up_front, (name, precision)


def test_config_check_refuses_a_database_the_archive_cannot_use(tmp_path: Path) -> None:
    for url, line in [
        (
            "mysql://u@db/x",
            "unsupported database 'mysql': the archive runs on sqlite or postgresql",
        ),
        ("postgres://u@db/x", "unsupported database 'postgres' (did you mean 'postgresql'?)"),
        ("postgresql+nosuchdriver://u@db/x", "unknown database driver 'postgresql+nosuchdriver'"),
    ]:
        path = tmp_path / "sustain.toml"
        path.write_text(f'[archive]\ndatabase_url = "{url}"\n')
        problems = config.check_file(path)
        assert len(problems) == 1, problems
        assert line in problems[0], problems


def test_a_switch_is_true_or_false_in_a_file_and_the_environment_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "sustain.toml"
    for value in ('"yes"', "1", '"on"'):
        path.write_text(f"[probing]\nenabled = {value}\n")
        (problem,) = config.check_file(path)
        assert problem.startswith(f"{path}: probing.enabled: expected true or false"), problem
    path.write_text("[probing]\nenabled = false\n")
    assert config.check_file(path) == []
    monkeypatch.setenv("SUSTAIN_PROBING__ENABLED", "yes")
    (problem,) = config.check_environment()
    assert problem.startswith("SUSTAIN_PROBING__ENABLED: expected true or false"), problem
    monkeypatch.setenv("SUSTAIN_PROBING__ENABLED", "False")
    assert config.check_environment() == []
    assert config.load(None).probing.enabled is False


def test_an_unknown_section_is_refused_from_any_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "sustain.toml"
    path.write_text("[probng]\nenabled = true\n[probing]\nenabld = true\n")
    assert sorted(config.check_file(path)) == [
        f"{path}: probing.enabld: unknown key (did you mean 'enabled'?)",
        f"{path}: probng: unknown key (did you mean 'probing'?)",
    ]
    monkeypatch.setenv("SUSTAIN_PROBNG__ENABLED", "true")
    monkeypatch.setenv("SUSTAIN_BOGUS__X", "1")
    assert config.check_environment() == [
        "SUSTAIN_BOGUS__X: unknown section 'bogus'",
        "SUSTAIN_PROBNG__ENABLED: unknown section 'probng' (did you mean SUSTAIN_PROBING__...?)",
    ]
    # `config check FILE` says them too (a good file, a bad environment: exit 2), and so does
    # every command that loads the configuration.
    path.write_text("[probing]\nenabled = true\n")
    for args in (["config", "check", str(path)], ["config", "show"]):
        done = _sustain(*args, env=_env(SUSTAIN_BOGUS__X="1"))
        assert done.returncode == 2, done
        assert "SUSTAIN_BOGUS__X: unknown section 'bogus'" in done.stdout + done.stderr
        assert "Traceback" not in done.stderr


def test_sustain_runs_lists_the_latest_runs_with_the_ids_report_run_takes(tmp_path: Path) -> None:
    from datetime import UTC, datetime, timedelta

    from test_capacity import probe_run
    from test_capacity_cli import add
    from test_database_urls import forked_sustain

    url = f"sqlite:///{tmp_path / 'archive.db'}"
    assert _sustain("db", "upgrade", "--database", url).returncode == 0
    now = datetime.now(UTC).replace(microsecond=0)
    steady = probe_run(started_at=now - timedelta(minutes=30), steady_throughput=7.123e14)
    unsettled = probe_run(
        started_at=now - timedelta(minutes=20),
        device="GPU-1",
        device_label="1",
        classification="no_steady_state",
        steady_throughput=None,
        p10_throughput=6.5e14,
    )
    skipped = probe_run(
        started_at=now - timedelta(minutes=10),
        outcome="skipped",
        reason="1 foreign compute process(es) on GPU gpu0",
        steady_throughput=None,
        classification=None,
    )
    old = probe_run(started_at=now - timedelta(days=3), steady_throughput=1e14)
    add(url, steady, unsettled, skipped, old)
    env = _env(COLUMNS="120")

    done = forked_sustain(["runs", "--database", url], env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("RUN ")
    assert lines[0].split()[1:] == [*("STARTED", "(UTC)", "NODE", "DEVICE", "PROBE"), *HEADING_END]
    rows = lines[1:5]
    assert [row.split()[0] for row in rows] == [
        run["run_id"][:12] for run in (skipped, unsettled, steady, old)
    ]  # newest first, each id as `sustain report run` takes it (a prefix of 4 or more)
    assert rows[0].endswith("skipped  1 foreign compute process(es) on GPU gpu0")
    assert rows[1].endswith("ok       p10 650.0 TFLOP/s (no steady state)")
    assert rows[2].endswith("ok       712.3 TFLOP/s")
    assert "sustain report run" in lines[-1]

    done = forked_sustain(["runs", "--database", url, "--since", "1d", "--outcome", "ok"], env)
    assert [row.split()[0] for row in done.stdout.splitlines()[1:3]] == [
        unsettled["run_id"][:12],
        steady["run_id"][:12],
    ]
    assert len(done.stdout.splitlines()) == 4  # header, two runs, the hint
    done = forked_sustain(["runs", "--database", url, "--device", "1", "--json"], env)
    (only,) = json.loads(done.stdout)
    assert only["run_id"] == unsettled["run_id"]
    assert (only["device"], only["uuid"], only["p10_throughput"]) == ("1", "GPU-1", 6.5e14)
    done = forked_sustain(["runs", "--database", url, "--workload", "membw"], env)
    assert done.stdout.strip() == "no probe runs in the archive match"
    done = forked_sustain(["runs", "--database", url, "--limit", "0"], env)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr


@pytest.mark.slow  # probe or torch children end to end (left out of the quick tier)
def test_workloads_list_is_a_table_for_a_person_and_json_for_the_agent(tmp_path: Path) -> None:
    from workloads.catalog import WORKLOADS

    def workloads(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "workloads", "list", "--device", "cpu", *args],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=300,
            check=False,
        )

    table, terminal, seconds = _on_a_terminal(
        [sys.executable, "-m", "workloads", "list", "--device", "cpu"]
    )
    # Standard error on a terminal: a spinner once a second has gone by (torch's import and
    # the device's checks take seconds here); a table any quicker gets none.
    if seconds > 2 * AFTER_SECONDS:
        assert "describing the workloads on this device ..." in terminal, terminal
    elif seconds < AFTER_SECONDS:
        assert terminal == "", terminal
    assert table.returncode == 0, table.stderr
    assert "\x1b" not in table.stdout  # the table itself is plain text
    lines = table.stdout.splitlines()
    assert lines[0] == "device cpu"
    assert lines[1].split() == ["WORKLOAD", "UNIT", "PRECISIONS", "OPTIMIZATIONS"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2 : 2 + len(WORKLOADS)]}
    assert set(rows) == set(WORKLOADS)
    assert rows["membw"] == ["B/s", "fp32", "eager"]
    assert rows["h2d"] == ["B/s", "-", "-"]
    assert "  h2d: h2d needs a CUDA device" in lines
    assert "  matmul tf32: tf32 is a CUDA tensor-core mode" in lines
    assert max(len(line) for line in lines[: 2 + len(WORKLOADS)]) <= 80
    listing = json.loads(workloads("--json").stdout)
    assert set(listing["workloads"]) == set(WORKLOADS)
    done = _into_closed_pipe(["list", "--device", "cpu"], tmp_path, module="workloads")
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 141


def _on_a_terminal(command: list[str]) -> tuple[subprocess.CompletedProcess[str], str, float]:
    """``command`` with standard output into a pipe and standard error on a pseudo-terminal:
    (the finished process, what the terminal got, the seconds it took)."""
    import pty
    import threading
    import time

    master, slave = pty.openpty()
    got: list[bytes] = []

    def read() -> None:  # all along: a full terminal buffer would stop the child
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's last writer has gone
                return
            if not chunk:
                return
            got.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    began = time.monotonic()
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=slave, text=True, env=_env()
    ) as child:
        os.close(slave)
        stdout, _ = child.communicate(timeout=300)
    seconds = time.monotonic() - began
    reader.join(timeout=10)
    os.close(master)
    done = subprocess.CompletedProcess(command, child.returncode, stdout, "")
    return done, b"".join(got).decode(errors="replace"), seconds


def test_analyze_words_its_figures_as_probe_does_and_says_each_thing_once(tmp_path: Path) -> None:
    """A slowdown at iteration 300 of 600: four significant digits, "99% interval", the
    sustained ratio as probe states it, and "steady from iteration 300" once (it was twice)."""
    import random

    rng = random.Random(2)
    series = tmp_path / "slowdown.csv"
    series.write_text(
        "".join(
            f"{(0.010 if i < 300 else 0.0125) * (1 + rng.gauss(0, 0.005))}\n" for i in range(600)
        )
    )
    done = _sustain("analyze", str(series))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert text.startswith("slowdown (600 iterations)\n"), text
    assert "99% interval" in text
    assert "CI" not in text
    assert re.search(r"^sustained 0\.\d{3} of peak \(steady / peak\)$", text, re.M), text
    assert text.count("steady from iteration 300") == 1, text
    for number in re.findall(r"\d+\.\d+", text.split("\n", 1)[1]):
        assert len(number.replace(".", "").lstrip("0")) <= 4, (number, text)


def test_the_fleet_report_counts_in_words_that_agree_with_the_number() -> None:
    """ "1 analysed results from 1 devices" was the report's line for a one-run archive."""
    from agent.plots import fleet_page

    assert fleet_page._counted(1, "analysed result") == "1 analysed result"
    assert fleet_page._counted(0, "device") == "0 devices"
    assert fleet_page._counted(2, "node") == "2 nodes"


def test_a_restart_that_finds_the_verdict_it_recorded_records_no_change() -> None:
    """Every agent restart added "CPU: unknown -> healthy" to the report's timeline. Where the
    archive's last verdict for a device is the one the restarted agent reaches, nothing is
    recorded; a different one is recorded, from what it was."""
    from test_health_failsafe import Clock, _host, _monitor

    clock = Clock()
    monitor, events = _monitor(clock, recorded=lambda: {"host": ("healthy", ())})
    monitor.restore([], {})
    monitor.record(_host(clock()))
    assert [event.message for event in events] == []
    assert [v.state for v in monitor.verdicts() if v.name == "CPU"] == ["healthy"]

    monitor, events = _monitor(clock, recorded=lambda: {"host": ("degraded", ("x",))})
    monitor.restore([], {})
    monitor.record(_host(clock()))
    assert [event.message for event in events] == ["CPU: degraded -> healthy"]

    monitor, events = _monitor(clock)  # no archive read: the first verdict is news
    monitor.record(_host(clock()))
    assert [event.message for event in events] == ["CPU: unknown -> healthy"]


def test_a_probe_queued_when_the_agent_stops_is_not_recorded_as_aborted(tmp_path: Path) -> None:
    """SIGTERM while a probe waited for its device (another run held it): it never started, so
    it was no aborted run; nothing is recorded and no child is started."""
    import threading

    from test_probes import OK, SPEC, archived, child, make_scheduler

    from agent.archive.database import open_engine, upgrade

    engine = open_engine(f"sqlite:///{tmp_path / 'archive.db'}")
    upgrade(engine)
    scheduler = make_scheduler(engine, duty_cycle=1.0, busy_cpu_utilization=1.0)
    lock = scheduler._device_lock(SPEC.device.gpu)
    lock.acquire()  # another run holds the CPU
    outcome: list[str] = []
    queued = threading.Thread(
        target=lambda: outcome.append(scheduler.run_one(SPEC, command=child(OK)).outcome)
    )
    queued.start()
    scheduler.stop()  # the agent is told to stop while the probe waits
    lock.release()
    queued.join(30)
    assert outcome == ["skipped"]
    assert archived(engine) == []
    engine.dispose()


def test_a_run_plot_without_a_steady_state_draws_its_p10_and_p50_and_the_note_clears_the_axis(
    tmp_path: Path,
) -> None:
    """A run that never settled had no line on its plot for what it delivered; the telemetry
    note at the foot of a PNG overlapped the x-axis label."""
    from agent.plots import canvas
    from agent.plots.run_figure import draw
    from agent.plots.run_series import RunPlot

    times = tuple(0.1 * i for i in range(1, 101))
    plot = RunPlot(
        title="matmul fp32 eager on node-a cpu",
        unit="FLOP/s",
        times=times,
        throughput=tuple(1e11 * (1 + 0.003 * i) for i in range(100)),
        outliers=(),
        window_times=tuple(0.5 + i for i in range(10)),
        window_throughput=tuple(1e11 * (1 + 0.03 * i) for i in range(10)),
        changepoints=(),
        steady_start=None,
        peak=1.3e11,
        steady=None,
        steady_ci=None,
        classification="no_steady_state",
        reason="a steady drift",
        note="telemetry: the CPU's frequency from /sys, package power from RAPL",
        p10=1.02e11,
        p50=1.14e11,
    )
    figure = draw(plot)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    axis_label = figure.axes[-1].xaxis.label.get_window_extent(renderer)
    supxlabel = getattr(figure, "_supxlabel", None)  # matplotlib keeps it there
    note = next(t for t in [*figure.texts, supxlabel] if t and t.get_text() == plot.note)
    assert not note.get_window_extent(renderer).overlaps(axis_label)
    svg = canvas.inline_svg(figure)
    assert 'id="p10"' in svg
    assert 'id="p50"' in svg
    assert "p10 of 1 s windows" in svg


def test_a_command_that_takes_over_a_second_shows_it_is_working_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading the archive or this machine's stack, drawing a report: on a terminal a spinner
    says what is being done once a second has gone by; a quicker answer, or one into a pipe
    (a script), gets nothing added."""
    import io
    import time

    from workloads.progress import working

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with working("reading the archive", after_seconds=0.2):
        time.sleep(1.0)
    assert "reading the archive ..." in terminal.getvalue()
    quick = Terminal()
    monkeypatch.setattr(sys, "stderr", quick)
    with working("reading the archive", after_seconds=5.0):
        pass
    assert quick.getvalue() == ""
    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    with working("reading the archive", after_seconds=0.0):
        time.sleep(0.3)
    assert piped.getvalue() == ""
    monkeypatch.undo()
    done = _sustain("stack", "show")  # seconds (a torch child), into a pipe: no spinner
    assert done.returncode == 0, done.stderr
    assert "reading" not in done.stderr
