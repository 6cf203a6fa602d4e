"""The HTTP endpoint: /metrics (Prometheus text format), /healthz, and a landing page at /.

A small WSGI application on wsgiref's server, with requests on a bounded pool of threads once
their headers are complete (HeaderGate), so that a slow scraper never blocks another and clients
that never finish a request cost no thread (limits: docs/security.md); prometheus_client renders
/metrics (with gzip and OpenMetrics negotiation). /healthz answers 503 when a sampler loop has
stalled or the archive writer's thread has ended (``stalled: archive writer``), so a liveness
probe restarts an agent whose sampling or archiving is stuck even though its HTTP thread still
answers.

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
import logging
import resource
import secrets
import select
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import bcrypt
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

from agent.config import webconfig
from agent.exporter import landing
from agent.exporter.landing import LandingSources
from agent.exporter.text import Encoder
from agent.health.monitor import DeviceHealth
from agent.probes.status import ProbeStatus
from agent.telemetry.sampler import LoopStatus
from collectors.base import Sample

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]
Environ = dict[str, Any]
Header = tuple[str, str]
CacheKey = tuple[str, bool, tuple[str, ...]]  # content type, gzip, name[] filter


class ListenError(Exception):
    """The exporter could not bind its address."""


CLOSE_TIMEOUT_SECONDS = 2.0
REALM = "sustain"
BCRYPT_MAX_PASSWORD_BYTES = 72  # bcrypt ignores the rest; the bcrypt package refuses it
REJECTED_CACHE_SIZE = 1024
DEFAULT_HEADER_TIMEOUT_SECONDS = 10.0
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_AUTH_RATE_PER_SECOND = 1.0
AUTH_BURST = 5  # bcrypt checks an address may make at once before the rate applies
AUTH_CLIENTS_TRACKED = 4096
MAX_PENDING_CONNECTIONS = 8192  # connections still sending their headers, held by one selector
MAX_HEADER_BYTES = 65536
BODY_TIMEOUT_SECONDS = 30.0  # per send, once the request is read: a client that stops reading
Verdict = Literal["ok", "wrong", "limited"]


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


class AddressRateLimit:
    """A token bucket per client address: ``rate`` checks a second, ``burst`` at once.

    The table is bounded (the least recently seen address goes first), so that a spoofing-free
    but wide flood (many addresses) costs memory no more than AUTH_CLIENTS_TRACKED buckets.
    """

    def __init__(self, rate: float, burst: int, size: int = AUTH_CLIENTS_TRACKED) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._size = size
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, address: str) -> bool:
        """Whether ``address`` may have one more check now (and if so, it is counted)."""
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.pop(address, (self._burst, now))
            tokens = min(self._burst, tokens + (now - at) * self._rate)
            allowed = tokens >= 1.0
            self._buckets[address] = (tokens - 1.0 if allowed else tokens, now)
            if len(self._buckets) > self._size:
                del self._buckets[next(iter(self._buckets))]
        return allowed


class BasicAuth:
    """Checks ``Authorization: Basic`` credentials against bcrypt hashes, cheaply when repeated.

    bcrypt is slow on purpose (about 0.1-0.2 s at cost 10), and a scraper sends the same
    credentials every time: a check that succeeded is remembered per user as an HMAC-SHA-256 of
    ``user:password`` under a key made at start-up (never the password itself), and compared in
    constant time. Failed checks are remembered too (a bounded set of such digests), so that a
    scraper left with an old password costs one bcrypt, not one per request; this is what
    Prometheus' exporter-toolkit does. An unknown user is checked against a dummy hash of the
    same cost, so that response times do not tell which users exist, and bcrypt runs one check
    at a time, so that a flood of wrong passwords costs at most one core. With a client address,
    bcrypt checks are rate-limited per address (AddressRateLimit): past the limit the answer is
    "limited" without a check, so that new wrong passwords cost a fraction of a core.
    """

    def __init__(
        self, users: Mapping[str, bytes], rate_per_second: float = DEFAULT_AUTH_RATE_PER_SECOND
    ) -> None:
        self._users = dict(users)
        self._limit = AddressRateLimit(rate_per_second, AUTH_BURST)
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
        return self.verdict(header, None) == "ok"

    def verdict(self, header: str | None, client: str | None) -> Verdict:
        """``check`` for a request from ``client`` (None: not rate-limited)."""
        credentials = _basic_credentials(header)
        if credentials is None:
            return "wrong"
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
            return "ok"
        if rejected:
            return "wrong"
        if client is not None and not self._limit.take(client):
            return "limited"
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
        return "ok" if accepted else "wrong"


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
        if environ.get("PATH_INFO", "/") == "/healthz":
            return self._app(environ, start_response)
        verdict = self._auth.verdict(
            environ.get("HTTP_AUTHORIZATION"), environ.get("REMOTE_ADDR", "")
        )
        if verdict == "ok":
            return self._app(environ, start_response)
        if verdict == "limited":
            start_response(
                "429 Too Many Requests", [("Content-Type", "text/plain"), ("Retry-After", "1")]
            )
            return [b"too many password checks from this address; try again later\n"]
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain"),
                ("WWW-Authenticate", f'Basic realm="{REALM}"'),
            ],
        )
        return [b"unauthorized\n"]


class HeaderGate:
    """Holds new connections in one thread, on epoll, until their request headers have arrived.

    A thread per connection from accept() on lets anyone who opens connections and never finishes
    a request (slow loris) make threads without bound. Here a connection costs a file descriptor
    and an epoll entry until its headers are complete (a blank line in the data the kernel holds,
    looked at with MSG_PEEK so that the handler reads the request as sent), and only then a worker
    thread. A connection whose headers are not complete within ``timeout`` seconds of its accept is
    closed, however slowly it trickles bytes. With TLS the bytes are encrypted: the connection is
    handed over at its first byte, and the worker's handshake and header reads are bounded by the
    same timeout per read.
    """

    def __init__(
        self,
        timeout: float,
        tls: bool,
        hand_over: Callable[[socket.socket, Any], None],
        close: Callable[[socket.socket], None],
    ) -> None:
        self._timeout = timeout
        self._tls = tls
        self._hand_over = hand_over
        self._close = close
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._epoll.register(self._wake_r.fileno(), select.EPOLLIN)
        self._incoming: list[tuple[socket.socket, Any]] = []
        self._incoming_lock = threading.Lock()
        # fd -> (socket, address, deadline), in order of arrival, hence of deadline.
        self._pending: dict[int, tuple[socket.socket, Any, float]] = {}
        self._peek = bytearray(MAX_HEADER_BYTES)
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name="exporter-headers", daemon=True)

    def add(self, connection: socket.socket, address: Any) -> None:
        with self._incoming_lock:
            self._incoming.append((connection, address))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        if self.thread.is_alive():
            self.thread.join()
        for connection, _, _ in self._pending.values():
            connection.close()
        with self._incoming_lock:
            for connection, _ in self._incoming:
                connection.close()
        self._epoll.close()
        self._wake_r.close()
        self._wake_w.close()

    def _run(self) -> None:
        while not self._stopping:
            self._admit()
            wait = 0.5
            if self._pending:
                first = next(iter(self._pending.values()))[2]
                wait = min(wait, max(0.0, first - time.monotonic()))
            for fd, _ in self._epoll.poll(wait):
                if fd == self._wake_r.fileno():
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                else:
                    self._look(fd)
            self._expire()

    def _admit(self) -> None:
        with self._incoming_lock:
            incoming, self._incoming = self._incoming, []
        deadline = time.monotonic() + self._timeout
        for connection, address in incoming:
            try:
                connection.setblocking(False)
                # Edge-triggered: an event per arrival of data, not one per poll while it waits.
                self._epoll.register(connection.fileno(), select.EPOLLIN | select.EPOLLET)
            except OSError:
                self._close(connection)
                continue
            self._pending[connection.fileno()] = (connection, address, deadline)

    def _look(self, fd: int) -> None:
        entry = self._pending.get(fd)
        if entry is None:
            return
        connection = entry[0]
        try:
            size = connection.recv_into(self._peek, MAX_HEADER_BYTES, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            size = 0
        if size == 0:  # closed by the client, or reset
            self._drop(fd)
            return
        data = memoryview(self._peek)[:size]
        complete = (
            self._tls
            or size >= MAX_HEADER_BYTES  # the handler answers 414 or 431
            or bytes(data).find(b"\r\n\r\n") >= 0
            or bytes(data).find(b"\n\n") >= 0
        )
        if complete:
            self._epoll.unregister(fd)
            del self._pending[fd]
            connection.setblocking(True)
            self._hand_over(connection, entry[1])

    def _drop(self, fd: int) -> None:
        connection = self._pending.pop(fd)[0]
        with contextlib.suppress(OSError):
            self._epoll.unregister(fd)
        self._close(connection)

    def _expire(self) -> None:
        now = time.monotonic()
        expired = []
        for fd, (_, _, deadline) in self._pending.items():
            if deadline > now:
                break
            expired.append(fd)
        for fd in expired:
            self._drop(fd)


class _ThreadingServer(WSGIServer):
    """A WSGI server whose requests run on a bounded pool of threads, after HeaderGate.

    ``configure`` sets the limits before serving: at most ``max_connections`` requests are served
    at once (one thread each), the rest wait with their headers complete; connections beyond
    the pending limit (file descriptors) are closed at accept.
    """

    allow_reuse_address = True
    # wsgiref speaks HTTP/1.0: every scrape is a new connection. A burst beyond the listen
    # backlog (Python's default: 5) is not refused: the kernel drops the handshake's last ACK,
    # the client believes it is connected, and the connection reaches accept() only after
    # SYN-ACK retransmits 1, 3, 7 or 15 s later. As Go's servers (node_exporter): the most the
    # kernel allows, which it caps at net.core.somaxconn (4,096 on current kernels).
    request_queue_size = socket.SOMAXCONN
    tls: ServerTls | None = None
    header_timeout = DEFAULT_HEADER_TIMEOUT_SECONDS
    _gate: HeaderGate | None = None
    _pool: ThreadPoolExecutor | None = None

    def configure(self, header_timeout: float, max_connections: int) -> None:
        self.header_timeout = header_timeout
        self._pool = ThreadPoolExecutor(max_connections, thread_name_prefix="exporter-request")
        self._gate = HeaderGate(header_timeout, self.tls is not None, self._submit, self._release)
        self._held = 0
        self._held_lock = threading.Lock()
        # Each held connection is a file descriptor: the soft limit (often 1,024) up to the hard.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = MAX_PENDING_CONNECTIONS + 1024
        if soft != resource.RLIM_INFINITY and soft < wanted:
            raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
                soft = raised
        spare = soft - 128 if soft != resource.RLIM_INFINITY else MAX_PENDING_CONNECTIONS
        self._max_held = max(16, min(MAX_PENDING_CONNECTIONS, spare))
        self._gate.thread.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        """In the accept loop: to the header gate, or closed when too many are held."""
        assert self._gate is not None, "configure() before serving"
        with self._held_lock:
            full = self._held >= self._max_held
            if not full:
                self._held += 1
        if full:
            self.shutdown_request(request)
            return
        self._gate.add(request, client_address)

    def _submit(self, request: socket.socket, client_address: Any) -> None:
        assert self._pool is not None
        try:
            self._pool.submit(self._serve, request, client_address)
        except RuntimeError:  # shutting down
            self._release(request)

    def _serve(self, request: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - as socketserver: logged by handle_error, counted there
            self.handle_error(request, client_address)
        finally:
            self._release(request)

    def _release(self, request: socket.socket) -> None:
        self.shutdown_request(request)
        with self._held_lock:
            self._held -= 1

    def stop_workers(self) -> None:
        if self._gate is not None:
            self._gate.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def finish_request(self, request: Any, client_address: Any) -> None:
        """In the connection's thread: the TLS handshake first, when TLS is on."""
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(self.header_timeout)
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
    """Access logs would cost a line per scrape; errors still reach the log.

    Headers are read with the server's header timeout per read (HeaderGate has already bounded
    the whole of it for plain HTTP); the response is then written with a longer one, so that a
    client that stops reading frees its thread.
    """

    def setup(self) -> None:
        server: Any = self.server
        self.request.settimeout(server.header_timeout)
        super().setup()

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self.connection.settimeout(BODY_TIMEOUT_SECONDS)
        return parsed

    def log_message(self, format: str, *args: Any) -> None:
        return


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
        self._encoder = Encoder()

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
                registry: Any = self._registry
                if key[2]:
                    registry = registry.restricted_registry(list(key[2]))
                body = self._encoder.render(registry, content_type)
                headers = [("Content-Type", content_type)]
                if compressed:
                    body = gzip.compress(body)
                    headers.append(("Content-Encoding", "gzip"))
                cached = (now, headers, body)
                self._cache[key] = cached
        start_response("200 OK", cached[1])
        return [cached[2]]


class ExporterApp:
    """Routes the three paths (the page at /: agent/exporter/landing.py); anything else is 404."""

    def __init__(
        self,
        registry: CollectorRegistry,
        loops: Callable[[], Sequence[LoopStatus]],
        *,
        node: str = "",
        health: Callable[[], Sequence[DeviceHealth]] | None = None,
        probes: Callable[[], ProbeStatus] | None = None,
        docs_url: str = "",
        telemetry: Callable[[], Sequence[Sample]] | None = None,
        archive_writer: Callable[[], bool] | None = None,
    ) -> None:
        self._metrics = CachedMetrics(registry)
        self._loops = loops
        self._archive_writer = archive_writer
        self._landing = LandingSources(node, loops, health, probes, docs_url, telemetry)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            result: Iterable[bytes] = self._metrics(environ, start_response)
            return result
        if path == "/healthz":
            stalled = [status.collector for status in self._loops() if status.stalled]
            if self._archive_writer is not None and not self._archive_writer():
                stalled.append("archive writer")  # its thread ended: a restart brings it back
            if stalled:
                body = ("stalled: " + ", ".join(stalled) + "\n").encode()
                start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
                return [body]
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        if path == "/":
            start_response(
                "200 OK",
                [
                    ("Content-Type", "text/html; charset=utf-8"),
                    ("Content-Security-Policy", landing.CONTENT_SECURITY_POLICY),
                ],
            )
            return [landing.render(self._landing)]
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
        self,
        host: str,
        port: int,
        app: ExporterApp,
        web_config_file: Path | None = None,
        *,
        header_timeout_seconds: float = DEFAULT_HEADER_TIMEOUT_SECONDS,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        auth_rate_per_second: float = DEFAULT_AUTH_RATE_PER_SECOND,
    ) -> None:
        self._header_timeout = header_timeout_seconds
        self._max_connections = max_connections
        served: ExporterApp | AuthApp = app
        tls: ServerTls | None = None
        if web_config_file is not None:
            try:
                web = webconfig.load(web_config_file)
                tls = None if web.tls is None else ServerTls(web.tls)
            except webconfig.WebConfigError as exc:
                raise ListenError(f"exporter.web_config_file: {exc}") from None
            if web.users:
                served = AuthApp(app, BasicAuth(web.users, auth_rate_per_second))
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
        self._server.configure(self._header_timeout, self._max_connections)
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() would wait for a serve_forever that never ran
            self._server.shutdown()
        self._server.stop_workers()
        self._server.server_close()
