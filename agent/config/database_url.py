"""Database URLs: read by their structure, shown with every secret hidden.

A URL carries secrets in two places: the password of its user information
(``postgresql+psycopg://user:PASSWORD@host/db``) and query parameters named like one
(``?password=...``, ``?sslpassword=...``, ``?token=...``). ``redact`` hides both by where they sit
in the parsed URL; ``scrub`` hides their values where a driver's error message repeats them, as
whole tokens only, so that a password "p" never turns ``database "nope"`` into ``no***e``.

An ``@`` left unencoded in the user name or password makes the URL ambiguous (SQLAlchemy ends
the password at the first ``@`` and takes the rest for the host, which would then be shown as is):
such a URL is refused with a hint to write ``%40``, and never echoed.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from difflib import get_close_matches
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

HIDDEN = "***"
# The databases the archive runs on (SQLAlchemy backend names); `config check` refuses the rest.
SUPPORTED_BACKENDS = ("sqlite", "postgresql")
# A query parameter whose name holds one of these (any case) is a secret: password, sslpassword,
# passwd, pwd, client_secret, access_token...
SECRET_PARAMETER_WORDS = ("password", "passwd", "pwd", "secret", "token")

# SQLAlchemy's own split of name://user:password@host:port (sqlalchemy.engine.url._parse_url):
# the password stops at the first "@", so a second "@" lands in the user name, host or port.
_BEFORE_PATH = re.compile(
    r"[\w+]+://(?:(?P<user>[^:/]*)(?::[^@]*)?@)?(?P<host_port>(?:\[[^/?]+\]|[^/:?]+)?(?::[^/?]*)?)"
)


class DatabaseUrlError(ValueError):
    """A database URL that cannot be used. The message is one line and never holds the URL."""


def parse(text: str) -> URL:
    """The URL's parts; DatabaseUrlError for a malformed or ambiguous URL."""
    split = _BEFORE_PATH.match(text)
    if split is not None and "@" in (split["user"] or "") + split["host_port"]:
        raise DatabaseUrlError(
            "ambiguous database URL: more than one '@' before the host; "
            "percent-encode an '@' in the user name or password as %40"
        )
    try:
        return make_url(text)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        raise DatabaseUrlError("malformed database URL (expected dialect[+driver]://...)") from None


def unsupported_backend(url: URL) -> str | None:
    """Why the archive cannot run on ``url``'s database, with the nearest supported name where
    the scheme is a near miss (``postgres://``), or None."""
    backend = url.get_backend_name()
    if backend in SUPPORTED_BACKENDS:
        return None
    near = get_close_matches(backend, SUPPORTED_BACKENDS, n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return f"unsupported database {backend!r}{hint}: the archive runs on sqlite or postgresql"


def _is_secret_parameter(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in SECRET_PARAMETER_WORDS)


def _values(value: str | tuple[str, ...]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else value


def redact(url: URL) -> str:
    """The URL as it may appear in a log line, an error message or `config show`."""
    shown = url.set(query={}).render_as_string(hide_password=True)
    parameters = [
        f"{quote_plus(name)}={HIDDEN if _is_secret_parameter(name) else quote_plus(value)}"
        for name in sorted(url.query)
        for value in _values(url.query[name])
    ]
    return f"{shown}?{'&'.join(parameters)}" if parameters else shown


def redact_text(text: str) -> str | None:
    """``redact`` of a URL not parsed yet; None where it cannot be parsed (nothing safe to show)."""
    try:
        return redact(parse(text))
    except DatabaseUrlError:
        return None


def secrets(url: URL) -> list[str]:
    """The secret values the URL holds: its password and those of password-like parameters."""
    found = [url.password] if url.password else []
    for name, value in url.query.items():
        if _is_secret_parameter(name):
            found.extend(v for v in _values(value) if v)
    return found


def scrub(text: str, url: URL) -> str:
    """``text`` with every secret of ``url`` replaced by ``***`` where it stands as a whole token:
    as given, percent-encoded, or escaped for a libpq connection string."""
    forms = {
        form
        for secret in secrets(url)
        for form in (
            secret,
            quote(secret, safe=""),
            quote_plus(secret),
            secret.replace("\\", "\\\\").replace("'", "\\'"),
        )
    }
    for form in sorted(forms, key=len, reverse=True):
        text = re.sub(rf"(?<!\w){re.escape(form)}(?!\w)", HIDDEN, text)
    return text


def warn_if_exposed(path: Path, file_data: Mapping[str, Any]) -> None:
    """One line on standard error when a file that others may read holds a database password.

    Printed, not logged: the file is read before logging is set up, by every command.
    """
    archive = file_data.get("archive")
    url = archive.get("database_url") if isinstance(archive, dict) else None
    if not isinstance(url, str):
        return
    try:
        found = secrets(parse(url))
    except DatabaseUrlError:
        return  # reported as a problem of its own
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if found and mode & 0o044:
        print(
            f"sustain: warning: config file {path} is readable by others and holds a database "
            "password; chmod 600 it (or set the password in the environment: docs/security.md)",
            file=sys.stderr,
        )
