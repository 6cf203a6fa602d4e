"""The HTTP endpoint: /metrics (Prometheus text format), /healthz, and a landing page at /.

A small WSGI application on a threading server from the standard library, so that a slow
scraper never blocks another; prometheus_client renders /metrics (with gzip and OpenMetrics
negotiation). /healthz answers 503 when a sampler loop has stalled, so a liveness probe restarts an
agent whose sampling is stuck even though its HTTP thread still answers.

With ``exporter.web_config_file`` (agent/config/webconfig.py) the same server speaks TLS and asks
for basic auth. The TLS handshake runs in the connection's own thread, not in the accept loop, so a
client that connects and never says hello holds up nobody else. Every path asks for credentials
except /healthz: liveness probes (kubelet, systemd) cannot easily send them, and the path tells
only "ok" or the names of stalled collectors.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import gzip
import hashlib
import hmac
import html
import logging
import secrets
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import bcrypt
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

from agent import __version__
from agent.config import webconfig
from agent.telemetry.sampler import LoopStatus

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]
Environ = dict[str, Any]
Header = tuple[str, str]
CacheKey = tuple[str, bool, tuple[str, ...]]  # content type, gzip, name[] filter


class ListenError(Exception):
    """The exporter could not bind its address."""


HANDSHAKE_TIMEOUT_SECONDS = 10.0
CLOSE_TIMEOUT_SECONDS = 2.0
REALM = "sustain"
BCRYPT_MAX_PASSWORD_BYTES = 72  # bcrypt ignores the rest; the bcrypt package refuses it
REJECTED_CACHE_SIZE = 1024


class ServerTls:
    """The server's SSLContext, rebuilt when its certificate, key or CA file changes.

    Certificates are rotated by replacing the files (cert-manager, certbot); Prometheus' servers
    pick the new ones up on the next connection, and so does this one: a stat of each file per
    connection, a rebuild when one changed. A rebuild that fails (a half-written file) keeps the
    previous context and logs once per change.
    """

    def __init__(self, settings: webconfig.TlsSettings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._stamp = self._files_stamp()
        self._context = webconfig.server_context(settings)
        self._rejected_stamp: tuple[Any, ...] | None = None

    def _files_stamp(self) -> tuple[Any, ...]:
        stamp: list[Any] = []
        for path in self._settings.files:
            try:
                info = path.stat()
            except OSError:
                stamp.append(None)
            else:
                stamp.append((info.st_ino, info.st_size, info.st_mtime_ns))
        return tuple(stamp)

    def context(self) -> ssl.SSLContext:
        stamp = self._files_stamp()
        with self._lock:
            if stamp not in (self._stamp, self._rejected_stamp):
                try:
                    self._context = webconfig.server_context(self._settings)
                except webconfig.WebConfigError as exc:
                    self._rejected_stamp = stamp
                    log.warning("exporter: TLS files changed, keeping the previous ones: %s", exc)
                else:
                    self._stamp = stamp
                    log.info("exporter: TLS certificate reloaded from %s", self._settings.cert_file)
            return self._context


class BasicAuth:
    """Checks ``Authorization: Basic`` credentials against bcrypt hashes, cheaply when repeated.

    bcrypt is slow on purpose (about 0.1-0.2 s at cost 10), and a scraper sends the same
    credentials every time: a check that succeeded is remembered per user as an HMAC-SHA-256 of
    ``user:password`` under a key made at start-up (never the password itself), and compared in
    constant time. Failed checks are remembered too (a bounded set of such digests), so that a
    scraper left with an old password costs one bcrypt, not one per request; this is what
    Prometheus' exporter-toolkit does. An unknown user is checked against a dummy hash of the
    same cost, so that response times do not tell which users exist, and bcrypt runs one check
    at a time, so that a flood of wrong passwords costs at most one core.
    """

    def __init__(self, users: Mapping[str, bytes]) -> None:
        self._users = dict(users)
        self._key = secrets.token_bytes(32)
        cost = max((int(hashed[4:6]) for hashed in self._users.values()), default=10)
        self._dummy_hash = bcrypt.hashpw(secrets.token_hex(16).encode(), bcrypt.gensalt(cost))
        self._dummy_digest = self._digest(b"")
        self._verified: dict[str, bytes] = {}
        self._rejected: dict[bytes, None] = {}  # insertion-ordered: the oldest goes first
        self._lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()

    def _digest(self, credentials: bytes) -> bytes:
        return hmac.new(self._key, credentials, hashlib.sha256).digest()

    def check(self, header: str | None) -> bool:
        """Whether an Authorization header value carries a configured user and its password."""
        credentials = _basic_credentials(header)
        if credentials is None:
            return False
        user_bytes, _, password = credentials.partition(b":")
        try:
            user = user_bytes.decode("utf-8")
        except UnicodeDecodeError:
            user = ""  # no configured user is empty: this is an unknown user
        digest = self._digest(credentials)
        with self._lock:
            remembered = self._verified.get(user, self._dummy_digest)
            rejected = digest in self._rejected
        hashed = self._users.get(user)
        if hmac.compare_digest(remembered, digest) and hashed is not None:
            return True
        if rejected:
            return False
        too_long = len(password) > BCRYPT_MAX_PASSWORD_BYTES
        with self._bcrypt_lock:
            matches = bcrypt.checkpw(
                password[:BCRYPT_MAX_PASSWORD_BYTES],
                self._dummy_hash if hashed is None else hashed,
            )
        accepted = matches and hashed is not None and not too_long
        with self._lock:
            if accepted:
                self._verified[user] = digest
            else:
                self._rejected[digest] = None
                if len(self._rejected) > REJECTED_CACHE_SIZE:
                    del self._rejected[next(iter(self._rejected))]
        return accepted


def _basic_credentials(header: str | None) -> bytes | None:
    """``user:password`` from a Basic Authorization header, or None if it is not one."""
    if not header:
        return None
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        credentials = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    return credentials if b":" in credentials else None


class AuthApp:
    """Asks for basic auth on every path but /healthz, then hands over to the exporter."""

    def __init__(self, app: ExporterApp, auth: BasicAuth) -> None:
        self._app = app
        self._auth = auth

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        # The same test as ExporterApp's routing, so exactly the health path is open.
        if environ.get("PATH_INFO", "/") == "/healthz" or self._auth.check(
            environ.get("HTTP_AUTHORIZATION")
        ):
            return self._app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain"),
                ("WWW-Authenticate", f'Basic realm="{REALM}"'),
            ],
        )
        return [b"unauthorized\n"]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True
    # wsgiref speaks HTTP/1.0: every scrape is a new connection. Python's default backlog of 5
    # drops connection attempts in a burst, which the client retries a second later.
    request_queue_size = 128
    tls: ServerTls | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        """In the connection's thread: the TLS handshake first, when TLS is on."""
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(HANDSHAKE_TIMEOUT_SECONDS)
        # wsgiref writes headers and body in separate TLS records; with Nagle's algorithm the
        # second waits for the client's delayed ACK, 40 ms on Linux, on every request.
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            # The plain socket is detached into the TLS one (closed with it on failure).
            connection = self.tls.context().wrap_socket(request, server_side=True)
        except (OSError, ValueError) as exc:
            # Scanners, plain-HTTP clients, clients without the right certificate: not news.
            log.debug("exporter: TLS handshake with %s failed: %s", client_address[0], exc)
            return
        try:
            connection.settimeout(None)
            super().finish_request(connection, client_address)
        finally:
            connection.settimeout(CLOSE_TIMEOUT_SECONDS)
            with contextlib.suppress(OSError, ValueError):
                connection.unwrap()  # close_notify, so the client sees a clean end
            connection.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that goes away mid-request is not a traceback on standard error."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.debug("exporter: connection from %s ended: %s", client_address[0], error)
        else:
            log.error("exporter: error serving %s", client_address[0], exc_info=True)


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """Access logs would cost a line per scrape; errors still reach the log."""

    def log_message(self, format: str, *args: Any) -> None:
        return


def _landing_page(statuses: Sequence[LoopStatus]) -> bytes:
    rows = "".join(
        f"<tr><td>{html.escape(status.collector)}</td><td>{status.interval_seconds:g} s</td>"
        f"<td>{'absent' if status.absent else 'up' if status.up else 'down'}</td>"
        f"<td>{'stalled' if status.stalled else 'ok'}</td></tr>"
        for status in statuses
    )
    page = (
        "<!doctype html><html><head><title>sustain</title></head><body>"
        f"<h1>sustain {html.escape(__version__)}</h1>"
        "<p>Sustained-throughput agent. "
        '<a href="/metrics">/metrics</a> &middot; <a href="/healthz">/healthz</a></p>'
        "<table><tr><th>collector</th><th>interval</th><th>state</th><th>loop</th></tr>"
        f"{rows}</table></body></html>"
    )
    return page.encode()


RENDER_MAX_AGE_SECONDS = 0.5


class CachedMetrics:
    """/metrics rendered at most every RENDER_MAX_AGE_SECONDS per output format.

    Rendering the whole exposition costs milliseconds of CPU (fresh families, window statistics
    over the ring buffers); several scrapers, or a burst of them, within half a second get the
    same bytes instead of each paying for a render. The data changes once per sampler poll
    (1 s by default), so a scraper sees nothing older than it could anyway, give or take half a
    second. Concurrent misses render once (one lock per format).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self._locks: dict[CacheKey, threading.Lock] = {}
        self._cache: dict[CacheKey, tuple[float, list[Header], bytes]] = {}

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        params = parse_qs(environ.get("QUERY_STRING", ""))
        accept = environ.get("HTTP_ACCEPT", "")
        _, content_type = choose_encoder(accept)
        compressed = gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", ""))
        key = (content_type, compressed, tuple(sorted(params.get("name[]", []))))
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            now = time.monotonic()
            cached = self._cache.get(key)
            if cached is None or now - cached[0] > RENDER_MAX_AGE_SECONDS:
                encoder, _ = choose_encoder(accept)
                registry: Any = self._registry
                if key[2]:
                    registry = registry.restricted_registry(list(key[2]))
                body = encoder(registry)
                headers = [("Content-Type", content_type)]
                if compressed:
                    body = gzip.compress(body)
                    headers.append(("Content-Encoding", "gzip"))
                cached = (now, headers, body)
                self._cache[key] = cached
        start_response("200 OK", cached[1])
        return [cached[2]]


class ExporterApp:
    """Routes the three paths; anything else is 404."""

    def __init__(
        self, registry: CollectorRegistry, loops: Callable[[], Sequence[LoopStatus]]
    ) -> None:
        self._metrics = CachedMetrics(registry)
        self._loops = loops

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            result: Iterable[bytes] = self._metrics(environ, start_response)
            return result
        if path == "/healthz":
            stalled = [status.collector for status in self._loops() if status.stalled]
            if stalled:
                body = ("stalled: " + ", ".join(stalled) + "\n").encode()
                start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
                return [body]
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])
            return [_landing_page(self._loops())]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found; try /metrics\n"]


def _describe_tls(tls: webconfig.TlsSettings | None) -> str:
    if tls is None:
        return "plain HTTP"
    clients = (
        ", client certificates required"
        if tls.client_auth_type == "RequireAndVerifyClientCert"
        else ""
    )
    return f"TLS ({tls.min_version} or newer{clients})"


def _describe_auth(users: Mapping[str, bytes]) -> str:
    return f"basic auth for {len(users)} user(s)" if users else "no basic auth"


class ExporterServer:
    """Binds at construction (so a taken port fails start-up), serves from a thread.

    ``web_config_file`` (``exporter.web_config_file``) turns on TLS and basic auth; a file that
    cannot be used is a ListenError with one line, like a port that cannot be bound.
    """

    def __init__(
        self, host: str, port: int, app: ExporterApp, web_config_file: Path | None = None
    ) -> None:
        served: ExporterApp | AuthApp = app
        tls: ServerTls | None = None
        if web_config_file is not None:
            try:
                web = webconfig.load(web_config_file)
                tls = None if web.tls is None else ServerTls(web.tls)
            except webconfig.WebConfigError as exc:
                raise ListenError(f"exporter.web_config_file: {exc}") from None
            if web.users:
                served = AuthApp(app, BasicAuth(web.users))
            if web.users and tls is None:
                log.warning(
                    "exporter: basic auth without TLS: passwords cross the network in clear text"
                )
            log.info("exporter: %s, %s", _describe_tls(web.tls), _describe_auth(web.users))
        try:
            self._server = make_server(
                host,
                port,
                served,
                server_class=_ThreadingServer6 if ":" in host else _ThreadingServer,
                handler_class=_QuietHandler,
            )
        except OSError as exc:
            raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        if tls is not None:
            self._server.tls = tls
            self._server.base_environ["HTTPS"] = "on"  # wsgi.url_scheme is then https
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="exporter-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() would wait for a serve_forever that never ran
            self._server.shutdown()
        self._server.server_close()
