"""The exporter's web configuration file: TLS and basic auth, in the format of Prometheus' own.

Operators who already secure node_exporter or Prometheus with a web configuration file
(https://prometheus.io/docs/prometheus/latest/configuration/https/) can point
``exporter.web_config_file`` at the same kind of file, and the scrape configuration they have
works unchanged. The subset understood here::

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file, as in Prometheus
      key_file: server.key
      min_version: TLS12             # or TLS13; default TLS12
      client_auth_type: RequireAndVerifyClientCert   # or NoClientCert (the default)
      client_ca_file: clients-ca.crt # required with RequireAndVerifyClientCert
    basic_auth_users:
      prometheus: $2y$10$...         # bcrypt hashes only

Anything else is refused with one line naming the key: a setting that is silently ignored is a
hole the operator believes closed. Parsing (``load``) checks structure, values and that the named
files exist; ``server_context`` reads the certificate and key, which only the process that serves
TLS (and ``sustain config check``) needs to do.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn

import yaml

MinVersion = Literal["TLS12", "TLS13"]
ClientAuthType = Literal["NoClientCert", "RequireAndVerifyClientCert"]

MIN_VERSIONS: dict[str, ssl.TLSVersion] = {
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
CLIENT_AUTH_TYPES = ("NoClientCert", "RequireAndVerifyClientCert")
# $2a$, $2b$ (Python's bcrypt) and $2y$ (htpasswd -B), cost, then 22 characters of salt and 31
# of hash in bcrypt's base64 alphabet.
_BCRYPT_HASH = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
BCRYPT_MIN_COST = 4
BCRYPT_MAX_COST = 31

_TLS_KEYS = frozenset(
    {"cert_file", "key_file", "min_version", "client_auth_type", "client_ca_file"}
)
_TOP_KEYS = frozenset({"tls_server_config", "basic_auth_users"})
# Keys Prometheus knows and sustain does not implement: said so, rather than "unknown key".
_UNSUPPORTED_TOP = frozenset({"http_server_config", "rate_limit"})
_UNSUPPORTED_TLS = frozenset(
    {
        "cert",
        "key",
        "client_ca",
        "cipher_suites",
        "curve_preferences",
        "max_version",
        "prefer_server_cipher_suites",
        "client_allowed_sans",
    }
)


class WebConfigError(Exception):
    """The web configuration file is unusable; the message is one line naming the key."""


@dataclass(frozen=True, slots=True)
class TlsSettings:
    cert_file: Path
    key_file: Path
    min_version: MinVersion = "TLS12"
    client_auth_type: ClientAuthType = "NoClientCert"
    client_ca_file: Path | None = None

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file the context is built from (watched for rotation)."""
        extra = () if self.client_ca_file is None else (self.client_ca_file,)
        return (self.cert_file, self.key_file, *extra)


@dataclass(frozen=True, slots=True)
class WebConfig:
    """TLS settings (None: plain HTTP) and basic-auth users (empty: no auth)."""

    path: Path
    tls: TlsSettings | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash


def _fail(message: str) -> NoReturn:
    raise WebConfigError(message)


def _mapping(value: Any, key: str) -> dict[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        _fail(f"{key}: expected a mapping, got {type(value).__name__}")
    return value


def _check_keys(
    data: Mapping[Any, Any], known: frozenset[str], unsupported: frozenset[str], prefix: str
) -> None:
    for key in data:
        dotted = f"{prefix}{key}"
        if key in unsupported:
            _fail(f"{dotted}: not supported by sustain (see docs/security.md)")
        if key not in known:
            _fail(f"{dotted}: unknown key")


def _existing_file(value: Any, key: str, base: Path) -> Path:
    if not isinstance(value, str) or not value:
        _fail(f"{key}: expected a file path")
    path = base / value  # an absolute value replaces base
    if not path.is_file():
        _fail(f"{key}: no such file: {path}")
    return path


def _choice(value: Any, key: str, choices: tuple[str, ...] | list[str], default: str) -> str:
    if value is None:
        return default
    if value not in choices:
        _fail(f"{key}: {value!r} is not supported (use {' or '.join(choices)})")
    return str(value)


def _tls(data: dict[Any, Any], base: Path) -> TlsSettings | None:
    _check_keys(data, _TLS_KEYS, _UNSUPPORTED_TLS, "tls_server_config.")
    if not data:
        return None  # an empty section is plain HTTP, as in Prometheus
    for key in ("cert_file", "key_file"):
        if key not in data:
            _fail(f"tls_server_config.{key}: missing (TLS needs cert_file and key_file)")
    cert_file = _existing_file(data["cert_file"], "tls_server_config.cert_file", base)
    key_file = _existing_file(data["key_file"], "tls_server_config.key_file", base)
    min_version = _choice(
        data.get("min_version"), "tls_server_config.min_version", list(MIN_VERSIONS), "TLS12"
    )
    client_auth = _choice(
        data.get("client_auth_type"),
        "tls_server_config.client_auth_type",
        CLIENT_AUTH_TYPES,
        "NoClientCert",
    )
    client_ca = data.get("client_ca_file")
    if client_auth == "RequireAndVerifyClientCert" and client_ca is None:
        _fail("tls_server_config.client_ca_file: missing (RequireAndVerifyClientCert needs it)")
    if client_auth == "NoClientCert" and client_ca is not None:
        _fail(
            "tls_server_config.client_ca_file: set without "
            "client_auth_type: RequireAndVerifyClientCert"
        )
    ca_file = (
        None
        if client_ca is None
        else _existing_file(client_ca, "tls_server_config.client_ca_file", base)
    )
    return TlsSettings(
        cert_file=cert_file,
        key_file=key_file,
        min_version="TLS13" if min_version == "TLS13" else "TLS12",
        client_auth_type=(
            "RequireAndVerifyClientCert"
            if client_auth == "RequireAndVerifyClientCert"
            else "NoClientCert"
        ),
        client_ca_file=ca_file,
    )


def _users(data: dict[Any, Any]) -> dict[str, bytes]:
    users: dict[str, bytes] = {}
    for user, hashed in data.items():
        key = f"basic_auth_users.{user}"
        if not isinstance(user, str) or not user:
            _fail(f"basic_auth_users: user name {user!r} is not a non-empty string")
        if ":" in user:
            _fail(f"{key}: a user name cannot contain ':' (RFC 7617)")
        match = _BCRYPT_HASH.fullmatch(hashed) if isinstance(hashed, str) else None
        # The value is not echoed: it may be a plain-text password put there by mistake.
        if match is None:
            _fail(f"{key}: not a bcrypt hash (make one with: htpasswd -nBC 10 {user})")
        if not BCRYPT_MIN_COST <= int(match.group(1)) <= BCRYPT_MAX_COST:
            _fail(f"{key}: bcrypt cost {int(match.group(1))} is outside 4-31")
        users[user] = hashed.encode("ascii")
    return users


MAX_BYTES = 1 << 20


def load(path: Path) -> WebConfig:
    """Parse and validate the file at ``path``; WebConfigError (one line) if it is unusable."""
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_BYTES + 1)  # /dev/zero must not be read forever
        if len(raw) > MAX_BYTES:
            _fail(f"{path} is larger than {MAX_BYTES // 1024} KiB")
        text = raw.decode("utf-8")
    except FileNotFoundError:
        _fail(f"no such file: {path}")
    except IsADirectoryError:
        _fail(f"{path} is a directory")
    except PermissionError as exc:
        _fail(f"cannot read {path}: {exc.strerror}")
    except UnicodeDecodeError:
        _fail(f"{path} is not UTF-8 text")
    except OSError as exc:  # a path through a file, a name too long, ...
        _fail(f"cannot read {path}: {exc.strerror or exc}")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = "" if mark is None else f" at line {mark.line + 1}"
        problem = getattr(exc, "problem", None) or type(exc).__name__
        _fail(f"YAML syntax error{where}: {problem}")
    top = _mapping(data, "(top level)")
    _check_keys(top, _TOP_KEYS, _UNSUPPORTED_TOP, "")
    base = path.absolute().parent
    return WebConfig(
        path=path,
        tls=_tls(_mapping(top.get("tls_server_config"), "tls_server_config"), base),
        users=_users(_mapping(top.get("basic_auth_users"), "basic_auth_users")),
    )


def _encrypted_key() -> bytes:
    # Without a callback OpenSSL would prompt for the passphrase on the terminal, and wait.
    raise WebConfigError(
        "tls_server_config.key_file: the key is encrypted; sustain needs an unencrypted key "
        "(readable by the agent's user only)"
    )


def _pem(path: Path, key: str, marker: str, what: str) -> None:
    """Name the file at fault, which OpenSSL's "PEM lib" does not."""
    try:
        text = path.read_bytes()
    except OSError as exc:
        _fail(f"{key}: cannot read {path}: {exc.strerror or exc}")
    if marker.encode() not in text:
        _fail(f"{key}: no PEM {what} in {path}")


def server_context(tls: TlsSettings) -> ssl.SSLContext:
    """An SSLContext for the server side, built from the files ``tls`` names."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MIN_VERSIONS[tls.min_version]
    _pem(tls.cert_file, "tls_server_config.cert_file", "-----BEGIN CERTIFICATE-----", "certificate")
    _pem(tls.key_file, "tls_server_config.key_file", "PRIVATE KEY-----", "private key")
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file, password=_encrypted_key)
    except OSError as exc:
        reason = exc.reason if isinstance(exc, ssl.SSLError) else exc.strerror
        if reason == "KEY_VALUES_MISMATCH":
            _fail(f"tls_server_config.key_file: {tls.key_file} is not the key of {tls.cert_file}")
        _fail(
            f"tls_server_config: cannot load cert_file {tls.cert_file} with key_file "
            f"{tls.key_file}: {reason or exc}"
        )
    if tls.client_auth_type == "RequireAndVerifyClientCert" and tls.client_ca_file is not None:
        _pem(
            tls.client_ca_file,
            "tls_server_config.client_ca_file",
            "-----BEGIN CERTIFICATE-----",
            "certificate",
        )
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_verify_locations(cafile=tls.client_ca_file)
        except OSError as exc:
            reason = exc.reason if isinstance(exc, ssl.SSLError) else exc.strerror
            _fail(
                f"tls_server_config.client_ca_file: cannot load {tls.client_ca_file}: "
                f"{reason or exc}"
            )
    return context
