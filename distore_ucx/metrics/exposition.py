"""Exposition: serving /metrics over HTTP, and pushing to a Pushgateway.

:func:`serve_process` serves a control plane's or node's registry (closed by
the role when it stops); :func:`serve` and :func:`push` expose this
process's learners and writers. At most MAX_SCRAPERS scrapers are served at
once, each for at most SCRAPE_IO_TIMEOUT seconds of silence.
"""

from __future__ import annotations

import logging
import threading

from .registries import LoopCollector, new_registry, registry

# The package's logger, so that its lines name distore_ucx.metrics as they always have.
log = logging.getLogger(__package__)

AUTO_PORT = -1  # --metrics-port auto: any free port (reported in the log and ready file)
# What scrapers may cost a process: this many served at once (a thread each),
# each with this long to send its request and read the answer; a scraper
# beyond them is hung up on at once (Prometheus scrapes once per interval).
MAX_SCRAPERS = 8
SCRAPE_IO_TIMEOUT = 5.0
LOOPBACK = "127.0.0.1"  # where /metrics listens unless asked (it names tables and hosts)


class MetricsServer:
    """A /metrics HTTP endpoint on its own thread; `close()` stops it.

    A control plane's or storage node's registry lives in its server alone
    (serve_process), so closing the server, which the role does when it
    stops, ends both: neither is left for interpreter exit to tear down."""

    def __init__(self, httpd, thread):
        self._httpd = httpd
        self._thread = thread
        self.host, self.port = httpd.server_address[:2]

    @property
    def url(self) -> str:
        """The address it serves, ``http://host:port/metrics``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(5.0)
            self._httpd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bounded_http_server(host: str, port: int, app):
    """A WSGI server for /metrics that serves at most MAX_SCRAPERS clients
    at once, each for at most SCRAPE_IO_TIMEOUT s of silence (prometheus_client's
    own server takes a thread per connection, so slow clients pile up threads)."""
    import socket
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    class Handler(WSGIRequestHandler):
        timeout = SCRAPE_IO_TIMEOUT  # a socket timeout on every read and write

        def log_message(self, format, *args):  # noqa: A002 - the base class's name
            """Log no request."""

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                            flags=socket.AI_PASSIVE)[0][0]
        slots = threading.BoundedSemaphore(MAX_SCRAPERS)
        refused = 0

        def process_request(self, request, client_address):
            if not self.slots.acquire(blocking=False):
                Server.refused += 1
                if Server.refused == 1 or Server.refused % 1000 == 0:
                    log.warning("metrics: %d scrapers refused so far (at most %d served at "
                                "once); is something polling /metrics in a loop?",
                                Server.refused, MAX_SCRAPERS)
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                self.slots.release()
                raise

        def process_request_thread(self, request, client_address):
            try:
                super().process_request_thread(request, client_address)
            finally:
                self.slots.release()

        def handle_error(self, request, client_address):
            log.debug("metrics: a scrape from %s failed", client_address, exc_info=True)

    return make_server(host, port, app, Server, handler_class=Handler)


def start_server(port: int, host: str = LOOPBACK, registry_=None,
                 role: str = "process") -> MetricsServer:
    """Serve `registry_` on http://host:port/metrics (port AUTO_PORT or 0
    from the library: any free port; host "" means every interface). At most
    MAX_SCRAPERS clients are served at once. Raises ConfigError naming the
    port when it cannot listen."""
    from prometheus_client import make_wsgi_app

    from ..errors import ConfigError

    addr = host or "0.0.0.0"
    try:
        httpd = _bounded_http_server(addr, max(port, 0), make_wsgi_app(
            registry_ if registry_ is not None else registry()))
    except OSError as exc:
        raise ConfigError(
            f"the {role} cannot serve metrics on {addr}:{port}: {exc.strerror}. "
            "Pass another --metrics-port (auto: any free port), or 0 to serve none"
        ) from None
    thread = threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread)


def serve(port: int = 0, host: str = LOOPBACK) -> MetricsServer:
    """Serve this process's learner and writer metrics on http://host:port/metrics.

    Args:
        port: The port; 0: any free one.
        host: The address; loopback unless it says otherwise ("0.0.0.0" or
            "": every interface), since the metrics name tables and hosts.

    Returns:
        The `MetricsServer` (`.port`, `.url`, `.close()`).

    Raises:
        ConfigError: It cannot listen there (the message names the port).

    >>> server = ds.metrics.serve(9800)
    """
    return start_server(port, host, registry(), "learner/writer process")


def push(gateway: str, job: str, grouping_key: dict | None = None) -> None:
    """Push this process's learner and writer metrics to a Prometheus
    Pushgateway (for short jobs that are gone before a scrape).

    Args:
        gateway: The Pushgateway's "host:port" (or URL).
        job: The job label.
        grouping_key: More labels that group the metrics, as prometheus_client takes them.

    Raises:
        OSError: The Pushgateway cannot be reached or refused the metrics
            (prometheus_client's errors).
    """
    from prometheus_client import push_to_gateway

    push_to_gateway(gateway, job=job, registry=registry(), grouping_key=grouping_key)


def serve_process(port: int, host: str, loop, obj, snapshot, families, role: str,
                  optional: bool = False) -> MetricsServer | None:
    """Serve a control plane's or node's metrics (port 0: none), logging where.

    A port that is taken raises ConfigError, unless `optional` (the port is
    the default, nobody's choice): then a warning says so and none is served.
    """
    from ..errors import ConfigError

    if port == 0:
        return None
    registry_ = new_registry(LoopCollector(loop, obj, snapshot, families))
    try:
        server = start_server(port, host, registry_, role)
    except ConfigError:
        if not optional:
            raise
        # Nobody chose this port: most often another process of the store on
        # this host (a second storage node) serves metrics on it already.
        log.warning("the %s serves no metrics: the default metrics port %d on %s is taken "
                    "(another storage node or control plane on this host?); give each process "
                    "of a host its own with --metrics-port N, or --metrics-port auto for any "
                    "free port", role, port, host or "0.0.0.0")
        return None
    log.info("%s serves Prometheus metrics at %s", role, server.url)
    return server
