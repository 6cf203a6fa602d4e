"""The flags of `sustain health`, apart from the command so that building the parser imports
neither SQLAlchemy nor pydantic (every `sustain` command builds the whole parser).

An agent whose web configuration asks for basic auth answers /metrics with 401 to a request
without credentials: ``--user`` names the user, and the password comes from ``--password-file`` or
``$SUSTAIN_HEALTH_PASSWORD``, never from the command line (where ``ps`` shows it to every user).
Each flag has an environment variable too, so that node-problem-detector's and slurmd's
environments can give them to commands they run unchanged (deploy/).
"""

from __future__ import annotations

import argparse
import base64
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ssl

NPD_MESSAGE_LIMIT = 80  # node-problem-detector's default max_output_length
PASSWORD_ENV = "SUSTAIN_HEALTH_PASSWORD"  # noqa: S105 - the name of the variable
USER_ENV = "SUSTAIN_HEALTH_USER"
PASSWORD_FILE_ENV = "SUSTAIN_HEALTH_PASSWORD_FILE"  # noqa: S105 - the name of the variable
CA_FILE_ENV = "SUSTAIN_HEALTH_CA_FILE"


class AccessError(Exception):
    """The credentials or the CA given cannot be used; one line, exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="the verdict as JSON (default: text)")
    parser.add_argument(
        "--summary",
        action="store_true",
        help="only the first line, for node-problem-detector and Slurm (default: the summary, "
        "then one line per device)",
    )
    parser.add_argument(
        "--max-length",
        type=_length,
        default=NPD_MESSAGE_LIMIT,
        metavar="N",
        help=f"longest summary line (default {NPD_MESSAGE_LIMIT}: node-problem-detector's "
        "max_output_length)",
    )
    parser.add_argument(
        "--metrics",
        metavar="URL",
        help="the agent's /metrics (default: the configured exporter.listen address)",
    )
    parser.add_argument(
        "--no-live",
        action="store_true",
        help="do not ask the running agent: the verdict recorded in the archive (default: ask "
        "it, and read the archive where it does not answer)",
    )
    parser.add_argument(
        "--user",
        metavar="NAME",
        default=os.environ.get(USER_ENV) or None,
        help="basic auth user for an agent whose web configuration has basic_auth_users; the "
        f"password from --password-file, else ${PASSWORD_ENV} (default: ${USER_ENV}, else no "
        "credentials)",
    )
    parser.add_argument(
        "--password-file",
        type=Path,
        metavar="PATH",
        default=os.environ.get(PASSWORD_FILE_ENV) or None,
        help=f"file whose first line is the --user's password (default: ${PASSWORD_FILE_ENV}, "
        f"else the password in ${PASSWORD_ENV})",
    )
    parser.add_argument(
        "--ca-file",
        type=Path,
        metavar="PATH",
        default=os.environ.get(CA_FILE_ENV) or None,
        help="CA certificate(s) that signed the agent's TLS certificate, for an https:// "
        f"--metrics URL (default: ${CA_FILE_ENV}, else the system's CAs)",
    )


def _length(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 20 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"{value} is outside 20 to 4096")
    return value


def authorization(args: argparse.Namespace) -> str | None:
    """The Authorization header that ``--user`` asks for; None without ``--user``."""
    if args.user is None:
        if args.password_file is not None:
            raise AccessError("--password-file needs --user")
        return None
    if ":" in args.user or not args.user.isprintable():
        raise AccessError("--user cannot hold a colon or control characters")
    if args.password_file is not None:
        try:
            lines = args.password_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise AccessError(f"cannot read --password-file {args.password_file}: {why}") from None
        password = lines[0] if lines else ""
    else:
        password = os.environ.get(PASSWORD_ENV, "")
    if not password:
        where = f"--password-file {args.password_file}" if args.password_file else PASSWORD_ENV
        raise AccessError(f"--user {args.user} needs a password: {where} is empty or unset")
    token = base64.b64encode(f"{args.user}:{password}".encode()).decode()
    return f"Basic {token}"


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """A context trusting ``--ca-file``; None (the system's CAs) without it."""
    if args.ca_file is None:
        return None
    import ssl  # only for a --ca-file: the parser is built for every command

    try:
        return ssl.create_default_context(cafile=str(args.ca_file))
    except (OSError, ssl.SSLError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise AccessError(f"cannot use --ca-file {args.ca_file}: {why}") from None
