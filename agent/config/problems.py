"""Configuration problems as lines: where the value was written, the message, the value once.

Shared by the settings (settings.py) and the exporter's web configuration file (webconfig.py).

pydantic locates a problem in the model (``probing.plan.0.workload``); a user needs the place
they wrote the value: the file and its key (``sustain.toml: probing.plan[0].workload: ...``), the
environment variable (``SUSTAIN_PROBING__PLAN: [0].workload: ...``, the rest of the key inside
its JSON) or the flag (``--listen: ...``). ``Sources`` finds that place; ``problem_line`` writes
the line.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from difflib import get_close_matches
from typing import Any, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import ErrorDetails

MAX_PROBLEM_CHARS = 200  # of a value or message quoted in a problem line
# pydantic's messages for these name the model class ("... or instance of ProbingSection").
_TABLE_TYPES = frozenset({"model_type", "model_attributes_type", "dataclass_type"})
# A key the model does not have (a dataclass says "unexpected keyword argument"), or no string.
UNKNOWN_KEY_TYPES = frozenset({"extra_forbidden", "unexpected_keyword_argument", "invalid_key"})
# Raised by a validator (its message is complete), or nothing to quote.
_COMPLETE_TYPES = frozenset({"value_error", "assertion_error", "missing"})

Loc = Sequence[str | int]


def one_line(text: str, limit: int | None = MAX_PROBLEM_CHARS) -> str:
    """``text`` for a problem line: escaped where unprintable, cut to ``limit`` characters."""
    if not text.isprintable():
        text = repr(text)[1:-1]
    return text if limit is None or len(text) <= limit else text[:limit] + "..."


def quoted(value: Any) -> str:
    """A value as a problem line quotes it: its repr, cut short, on one line."""
    return one_line(repr(value))


def message_naming_a_file(text: str) -> str:
    """A validator's message, cut short; the file it ends by naming, ``(got '...')``, is kept
    (up to a path's length): what a message ends with says where, as for TOML syntax errors."""
    head, got, tail = text.rpartition(" (got ")
    return f"{one_line(head)}{got}{one_line(tail, limit=4096)}" if got else one_line(text)


def key_text(loc: Loc) -> str:
    """``probing.plan[0].workload``: the key as written in TOML, list items by index."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += ("." if text else "") + (one_line(part) or '""')
    return text


@dataclass(frozen=True, slots=True)
class _Given:
    """A value one source gave: ``origin`` names the source, ``named`` is how many parts of the
    key the name already says (``SUSTAIN_PROBING__PLAN`` says ``probing.plan``), and ``table``
    whether the value is a table that the sources below may add keys to."""

    origin: str
    named: int
    table: bool


_MISSING = object()


class Sources:
    """Where each value of one load came from: flags over the environment over the file.

    Looked up along one key at a time, as pydantic-settings merges the sources: tables key by
    key, anything else (a value, a list) from the highest source that gives it.
    """

    def __init__(
        self,
        *,
        file_name: str | None,
        file_data: Mapping[str, Any],
        environ: Mapping[str, str],
        env_prefix: str,
        flags: Mapping[str, Mapping[str, Any]],
        flag_names: Mapping[tuple[str, str], str],
    ) -> None:
        self._file_name = file_name
        self._file_data = file_data
        self._env_prefix = env_prefix
        # pydantic-settings reads the variables' names without regard to case.
        self._environ = {name.lower(): (name, value) for name, value in environ.items()}
        self._flags = flags
        self._flag_names = flag_names

    def where(self, loc: Loc) -> str:
        """``FILE: key``, ``VARIABLE: rest of the key`` or ``--flag``; the bare key when the value
        is a default (or the problem is that a key is missing everywhere)."""
        given: _Given | None = None
        for depth in range(1, len(loc) + 1):
            prefix = loc[:depth]
            found = self._flag(prefix) or self._variable(prefix) or self._file(prefix)
            if found is None:
                break
            given = found
            if not found.table:
                break
        if given is None:
            return key_text(loc) or "(top level)"
        rest = key_text(loc[given.named :])
        return f"{given.origin}: {rest}" if rest else given.origin

    def _flag(self, prefix: Loc) -> _Given | None:
        section = self._flags.get(str(prefix[0]), {})
        if len(prefix) == 1:
            return _Given("command line", 0, table=True) if section else None
        if len(prefix) > 2 or prefix[1] not in section:
            return None
        flag = self._flag_names.get((str(prefix[0]), str(prefix[1])))
        return _Given(flag, 2, table=False) if flag else _Given("command line", 0, table=False)

    def _variable(self, prefix: Loc) -> _Given | None:
        """The most specific variable that gives ``prefix``: named for it, or for a table above
        it whose JSON holds it; else the variables below it make it a table."""
        names: list[str] = []  # a variable names the keys before the first list index
        for part in prefix:
            if not isinstance(part, str):
                break
            names.append(part.lower())
        for named in range(len(names), 0, -1):
            entry = self._environ.get(self._env_prefix.lower() + "__".join(names[:named]))
            if entry is None:
                continue
            name, text = entry
            value = _walk(_json(text), prefix[named:])
            if named == len(prefix) or value is not _MISSING:
                return _Given(name, named, table=isinstance(value, dict))
            return None
        below = self._env_prefix.lower() + "__".join(names) + "__"
        if len(names) == len(prefix) and any(key.startswith(below) for key in self._environ):
            return _Given(self._env_prefix + "__".join(names).upper(), len(prefix), table=True)
        return None

    def _file(self, prefix: Loc) -> _Given | None:
        if self._file_name is None:
            return None
        value = _walk(self._file_data, prefix)
        if value is _MISSING:
            return None
        return _Given(self._file_name, 0, table=isinstance(value, dict))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _MISSING


def _walk(value: Any, loc: Loc) -> Any:
    """The value at ``loc`` inside ``value`` (tables by key, lists by index), or _MISSING."""
    for part in loc:
        if isinstance(value, dict) and isinstance(part, str):
            value = value.get(part, _MISSING)
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        else:
            return _MISSING
    return value


def problem_line(
    item: ErrorDetails,
    where: str,
    shown: Callable[[Any], str | None],
    text: Callable[[str], str] = one_line,
    model: type[BaseModel] | None = None,
) -> str:
    """One problem as ``WHERE: message``, the value quoted by ``shown`` (None: not quoted), the
    message kept to one line by ``text`` (webconfig.py keeps its messages as written: settings.py
    quotes each of its lines whole).

    Unknown keys are said so, with the nearest key ``model`` has there; model class names and
    pydantic's "Value error, " are left out. The value is said once: ``(got ...)`` follows
    pydantic's own messages only, which never quote it; a validator's message is complete as it
    stands, quoting the value itself where that helps and never where it could be a secret (a
    plain-text password put where a hash belongs).
    """
    kind = item["type"]
    if kind in UNKNOWN_KEY_TYPES:
        near = None if model is None else near_key(model, item["loc"])
        return f"{where}: unknown key" + (f" (did you mean {near!r}?)" if near else "")
    if kind in _TABLE_TYPES:
        message = "Input should be a table"
    else:
        message = item["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    message = text(message)
    if kind not in _COMPLETE_TYPES and (value := shown(item["input"])) is not None:
        message += f" (got {value})"
    return f"{where}: {message}"


def near_key(model: type[BaseModel], loc: Sequence[str | int]) -> str | None:
    """The key of ``model`` at ``loc`` (tables by key, lists by index) nearest to the unknown
    last one, or None."""
    annotation: Any = model
    for part in loc[:-1]:
        if isinstance(part, int) and get_origin(annotation) is list:
            annotation = get_args(annotation)[0]
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return None
            annotation = field.annotation
        else:
            return None
    if not (loc and isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return None
    near = get_close_matches(str(loc[-1]), list(annotation.model_fields), n=1, cutoff=0.6)
    return near[0] if near else None


def environment_json_lines(
    environ: Mapping[str, str], model: type[BaseModel], prefix: str
) -> list[str]:
    """The variables that set a table or a list and do not hold JSON (pydantic-settings says only
    which section, in terms of its own classes)."""
    lines = []
    for name, text in sorted(environ.items()):
        if not _takes_json(model, name[len(prefix) :].lower().split("__")):
            continue
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            lines.append(
                f"{name}: not valid JSON (a list or table is written as JSON here): "
                f"{exc.msg} at column {exc.colno}"
            )
        except (ValueError, RecursionError):
            lines.append(f"{name}: not valid JSON (nested too deeply or a number too long)")
    return lines


def _takes_json(model: type[BaseModel], parts: Sequence[str]) -> bool:
    annotation: Any = model
    for part in parts:
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return False
        field = annotation.model_fields.get(part)
        if field is None:
            return False
        annotation = field.annotation
    is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return is_model or get_origin(annotation) in (list, dict)
