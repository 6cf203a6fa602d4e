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
files exist, with pydantic as settings.py does, and reports the first problem in the same form
(problems.py); ``server_context`` reads the certificate and key, which only the process that serves
TLS (and ``sustain config check``) needs to do.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, NoReturn, cast, get_args

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticUseDefault

from agent.config.problems import UNKNOWN_KEY_TYPES, problem_line

MinVersion = Literal["TLS12", "TLS13"]
ClientAuthType = Literal["NoClientCert", "RequireAndVerifyClientCert"]

MIN_VERSIONS: dict[str, ssl.TLSVersion] = {
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# $2a$, $2b$ (Python's bcrypt) and $2y$ (htpasswd -B), cost, then 22 characters of salt and 31
# of hash in bcrypt's base64 alphabet.
_BCRYPT_HASH = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
BCRYPT_MIN_COST = 4
BCRYPT_MAX_COST = 31

# Keys Prometheus knows and sustain does not implement, by the section they belong to: said so,
# rather than "unknown key".
_UNSUPPORTED: dict[tuple[int | str, ...], frozenset[str]] = {
    (): frozenset({"http_server_config", "rate_limit"}),
    ("tls_server_config",): frozenset(
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
    ),
}


class WebConfigError(Exception):
    """The web configuration file is unusable; the message is one line naming the key."""


def _mapping(value: Any) -> dict[Any, Any]:
    """A section as YAML gives it; null (``tls_server_config:`` with nothing under it) is empty."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping, got {type(value).__name__}")
    return value


def _existing_file(value: Any, info: ValidationInfo) -> Path:
    """A file named relative to the web configuration file (``info.context``), as in Prometheus."""
    if not isinstance(value, str) or not value:
        raise ValueError("expected a file path")
    base = cast(Path, info.context)  # the web configuration file's directory, from load()
    path = base / value  # an absolute value replaces base
    try:
        found = path.is_file()
    except OSError as exc:  # a name too long, a loop of links: no file the agent can open
        raise ValueError(f"cannot use the path: {exc.strerror or exc}") from None
    if not found:
        raise ValueError(f"no such file: {path}")
    return path


def _one_of(choices: Any) -> BeforeValidator:
    """The values of the Literal ``choices``, each problem naming them all; null is the default."""
    allowed: tuple[str, ...] = get_args(choices)

    def check(value: Any) -> Any:
        if value is None:
            raise PydanticUseDefault
        if value not in allowed:
            raise ValueError(f"{value!r} is not supported (use {' or '.join(allowed)})")
        return value

    return BeforeValidator(check)


def _client_ca_file(value: Any, info: ValidationInfo) -> Path | None:
    """Required by RequireAndVerifyClientCert and refused without it, before it is looked for: a
    CA file that would not be used is a sign that client certificates are believed checked."""
    client_auth = info.data.get("client_auth_type")  # absent: refused already
    if client_auth == "RequireAndVerifyClientCert" and value is None:
        raise ValueError("missing (RequireAndVerifyClientCert needs it)")
    if client_auth == "NoClientCert" and value is not None:
        raise ValueError("set without client_auth_type: RequireAndVerifyClientCert")
    return None if value is None else _existing_file(value, info)


_File = Annotated[Path, Strict(), BeforeValidator(_existing_file)]


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """``tls_server_config``, validated by pydantic from the file as the annotations say (made
    directly, as in tests, it checks nothing)."""

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

    cert_file: _File
    key_file: _File
    min_version: Annotated[MinVersion, _one_of(MinVersion)] = "TLS12"
    client_auth_type: Annotated[ClientAuthType, _one_of(ClientAuthType)] = "NoClientCert"
    client_ca_file: Annotated[
        Path | None, Strict(), BeforeValidator(_client_ca_file), Field(validate_default=True)
    ] = None

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


def _tls_section(value: Any) -> dict[Any, Any] | None:
    return _mapping(value) or None  # an empty section is plain HTTP, as in Prometheus


def _check_user(user: str, hashed: Any) -> None:
    if ":" in user:
        raise ValueError("a user name cannot contain ':' (RFC 7617)")
    match = _BCRYPT_HASH.fullmatch(hashed) if isinstance(hashed, str) else None
    # The value is not echoed: it may be a plain-text password put there by mistake.
    if match is None:
        raise ValueError(f"not a bcrypt hash (make one with: htpasswd -nBC 10 {user})")
    if not BCRYPT_MIN_COST <= int(match.group(1)) <= BCRYPT_MAX_COST:
        raise ValueError(f"bcrypt cost {int(match.group(1))} is outside 4-31")


def _users(value: Any) -> dict[Any, Any]:
    """``basic_auth_users``, checked as a whole rather than key and value apart: a problem of the
    hash names its user twice (where, and in the htpasswd command that makes a new hash)."""
    users = _mapping(value)
    for user, hashed in users.items():
        if not isinstance(user, str) or not user:
            raise ValueError(f"user name {user!r} is not a non-empty string")
        try:
            _check_user(user, hashed)
        except ValueError as exc:  # reported at the user's key, as pydantic would a value's
            raise ValidationError.from_exception_data(
                "basic_auth_users",
                [{"type": "value_error", "loc": (user,), "input": hashed, "ctx": {"error": exc}}],
            ) from None
    return users


class _WebConfigFile(BaseModel):
    """The file as written; ``load`` makes a WebConfig of it."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    tls_server_config: Annotated[TlsSettings | None, BeforeValidator(_tls_section)] = None
    basic_auth_users: Annotated[dict[str, str], BeforeValidator(_users)] = Field(
        default_factory=dict
    )

    @model_validator(mode="before")
    @classmethod
    def _is_mapping(cls, data: Any) -> dict[Any, Any]:
        return _mapping(data)


def _reading_order(item: ErrorDetails) -> tuple[int, ...]:
    """pydantic reports a section's stray keys after its values; the file is read, and its first
    problem reported, in this order: the file's stray keys, then section by section its stray
    keys, the keys it lacks, its values."""
    if item["type"] in UNKNOWN_KEY_TYPES:
        return (0,) if len(item["loc"]) == 1 else (1, 0)
    return (1, 1) if item["type"] == "missing" else (1, 2)


def _where(item: ErrorDetails) -> str:
    """The key as the file writes it; pydantic gives a key that is no string (``1:``, ``null:``)
    by its repr."""
    loc = item["loc"]
    if item["type"] == "invalid_key":
        loc = (*loc[:-1], str(item["input"]))
    return ".".join(str(part) for part in loc) if loc else "(top level)"


def _first_problem(error: ValidationError) -> str:
    """The first problem as one line, its text as written (settings.py, which quotes the line,
    cuts it short and escapes what is unprintable)."""
    item = min(error.errors(), key=_reading_order)
    where, loc = _where(item), item["loc"]
    if item["type"] in UNKNOWN_KEY_TYPES and loc[-1] in _UNSUPPORTED.get(loc[:-1], ()):
        return f"{where}: not supported by sustain (see docs/security.md)"
    if item["type"] == "missing":
        return f"{where}: missing (TLS needs cert_file and key_file)"
    return problem_line(item, where, shown=lambda _: None, text=str)


MAX_BYTES = 1 << 20


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int) -> None:
        super().__init__(key, line)
        self.key = key
        self.line = line


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in a mapping: YAML would keep the last one
    silently, and a second ``basic_auth_users`` entry for a user replaces the first's hash."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                repeated = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the constructor below says so
                continue
            if repeated:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
        return super().construct_mapping(node, deep=deep)


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
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except _DuplicateKey as exc:
        _fail(f"{path}, line {exc.line}: {exc.key!r} is given twice (a duplicate user or key)")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = "" if mark is None else f" at line {mark.line + 1}"
        problem = getattr(exc, "problem", None) or type(exc).__name__
        _fail(f"YAML syntax error{where}: {problem}")
    except RecursionError:
        _fail("YAML nested too deeply")
    try:
        parsed = _WebConfigFile.model_validate(data, context=path.absolute().parent)
    except ValidationError as exc:
        _fail(_first_problem(exc))
    users = {user: hashed.encode("ascii") for user, hashed in parsed.basic_auth_users.items()}
    return WebConfig(path=path, tls=parsed.tls_server_config, users=users)


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
