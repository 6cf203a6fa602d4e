"""matplotlib, loaded when a picture is drawn and never before: the one place that imports it.

The Agg backend draws without a display (a node has none); SVG keeps its text as text
(``svg.fonttype = none``), so a browser, a test and a search find the figures in it, and a fixed
hash salt and no date make the same picture give the same file.
"""

from __future__ import annotations

import io
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

INSTALL = "pip install 'sustain[report]'"
# No date, and no version: the same picture makes the same file whatever matplotlib drew it.
SVG_METADATA = {"Date": None, "Creator": "sustain, with matplotlib"}
FORMATS = (".svg", ".png")
PNG_DPI = 120


class PlotsUnavailable(Exception):
    """matplotlib is not installed; the message says how to install it."""


class PlotError(Exception):
    """A picture that cannot be written (unknown format, a directory that cannot be made)."""


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` with the Agg backend and the house settings."""
    try:
        import matplotlib  # noqa: PLC0415 - loaded when a picture is drawn, never before
    except ImportError:
        raise PlotsUnavailable(f"plots need matplotlib: {INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after the backend is chosen

    matplotlib.rcParams.update(
        {
            "svg.fonttype": "none",
            "svg.hashsalt": "sustain",
            "font.size": 9,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.grid": True,
            "grid.alpha": 0.3,
        }
    )
    return plt


def check_available() -> None:
    """Raise PlotsUnavailable now, before a long run whose plot could not be drawn."""
    pyplot()


def check_path(path: Path) -> None:
    if path.suffix.lower() not in FORMATS:
        raise PlotError(f"{path}: unknown picture format (use {' or '.join(FORMATS)})")


def save(figure: Figure, path: Path) -> None:
    """Write ``figure`` as SVG or PNG, by the extension of ``path``."""
    check_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix.lower() == ".svg":
            figure.savefig(path, format="svg", metadata=SVG_METADATA)
        else:
            figure.savefig(path, format="png", dpi=PNG_DPI, metadata={"Software": None})
    except OSError as exc:
        raise PlotError(f"{path}: cannot write: {exc.strerror or exc}") from None
    finally:
        pyplot().close(figure)


def inline_svg(figure: Figure) -> str:
    """The figure as an ``<svg>`` element for an HTML page: no XML declaration, no doctype."""
    buffer = io.StringIO()
    try:
        figure.savefig(buffer, format="svg", metadata=SVG_METADATA)
    finally:
        pyplot().close(figure)
    text = buffer.getvalue()
    text = text[text.index("<svg") :]
    # The RDF metadata block would read as text on the page ("image/svg+xml").
    start, end = text.find("<metadata>"), text.find("</metadata>")
    if 0 <= start < end:
        text = text[:start] + text[end + len("</metadata>") :]
    return text
