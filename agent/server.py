"""The HTTP endpoint: /metrics (Prometheus text format), /healthz, and a landing page at /.

A small WSGI application on a threading server from the standard library, so that a slow
scraper never blocks another; prometheus_client renders /metrics (with gzip and OpenMetrics
negotiation). /healthz answers 503 when a sampler loop has stalled, so a liveness probe restarts an
agent whose sampling is stuck even though its HTTP thread still answers.
"""

from __future__ import annotations

import html
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from agent import __version__
from agent.sampler import LoopStatus

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]
Environ = dict[str, Any]


class ListenError(Exception):
    """The exporter could not bind its address."""


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """Access logs would cost a line per scrape; errors still reach the log."""

    def log_message(self, format: str, *args: Any) -> None:
        return


def _landing_page(statuses: Sequence[LoopStatus]) -> bytes:
    rows = "".join(
        f"<tr><td>{html.escape(status.collector)}</td><td>{status.interval_seconds:g} s</td>"
        f"<td>{'up' if status.up else 'down'}</td>"
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


class ExporterApp:
    """Routes the three paths; anything else is 404."""

    def __init__(
        self, registry: CollectorRegistry, loops: Callable[[], Sequence[LoopStatus]]
    ) -> None:
        self._metrics = make_wsgi_app(registry)
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


class ExporterServer:
    """Binds at construction (so a taken port fails start-up), serves from a thread."""

    def __init__(self, host: str, port: int, app: ExporterApp) -> None:
        try:
            self._server = make_server(
                host,
                port,
                app,
                server_class=_ThreadingServer6 if ":" in host else _ThreadingServer,
                handler_class=_QuietHandler,
            )
        except OSError as exc:
            raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="exporter-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
