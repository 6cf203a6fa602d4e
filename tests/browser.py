"""Headless Chromium (Debian's package; tests/run.sh installs it) as a person's browser: a
screenshot, the DOM after the page has rendered, and the network requests the page made."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from PIL import Image

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TIMEOUT = 60
QUIET = (
    "--headless",
    "--no-sandbox",  # tests run as root in CI containers, where the sandbox cannot start
    "--disable-gpu",
    "--hide-scrollbars",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-sync",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
)


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    done = subprocess.run(
        [CHROMIUM, *QUIET, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def screenshot(page: Path, out: Path, width: int = 1200, height: int = 1600) -> Path:
    chromium(
        out.parent / "profile-shot",
        f"--screenshot={out}",
        f"--window-size={width},{height}",
        page.resolve().as_uri(),
    )
    assert out.is_file()
    return out


def dump_dom(page: Path, net_log: Path | None = None) -> str:
    """The page's DOM as Chromium serialises it after loading; with ``net_log``, Chromium
    writes its NetLog (every request it made, as JSON) there."""
    extra = (
        [] if net_log is None else [f"--log-net-log={net_log}", "--net-log-capture-mode=Default"]
    )
    return chromium(
        page.parent / "profile-dom", *extra, "--dump-dom", page.resolve().as_uri()
    ).stdout


def page_requests(net_log: Path) -> set[str]:
    """The URLs the page asked for, from a NetLog file: the requests with an initiator.

    Chromium's own requests (its clock, updates, spelling dictionaries) have none ("not an
    origin"); a file:// page's are initiated by its opaque origin ("null"), and the file itself
    is read without a network request at all."""
    log = json.loads(net_log.read_text())
    names = {value: name for name, value in log["constants"]["logEventTypes"].items()}
    urls: set[str] = set()
    for event in log.get("events", []):
        params = event.get("params") or {}
        if names.get(event.get("type")) != "URL_REQUEST_START_JOB" or "url" not in params:
            continue
        if params.get("initiator", "not an origin") != "not an origin":
            urls.add(str(params["url"]))
    return urls


def colours(png: Path) -> tuple[int, float]:
    """Distinct colours in the screenshot and the share of pixels unlike the most common one
    (the background): a blank page has one colour and a share of zero."""
    with Image.open(png) as image:
        rgb = image.convert("RGB")
        counts = rgb.getcolors(maxcolors=1 << 24) or []
        total = rgb.width * rgb.height
    background = max(count for count, _ in counts)
    return len(counts), 1.0 - background / total
