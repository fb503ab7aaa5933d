"""Prometheus metrics of every distore process, read at scrape time.

The control plane and every storage node serve ``/metrics`` on
``--metrics-port`` (docs/operations.md lists every metric). Learners and
writers put their own side in a registry the user serves or pushes::

    import distore_ucx as ds
    server = ds.metrics.serve(9800)          # http://HOST:9800/metrics
    ds.metrics.push("pushgateway:9091", job="learner")   # or push

Nothing here sits on a hot path. Processes keep plain counters they keep
anyway (a table's inserts, a learner's resamples) or count once per batch
(:class:`Histogram` costs one bisect and two additions); the collectors
below read them when Prometheus scrapes. A control plane's or node's state
belongs to its event-loop thread, so the scrape (an HTTP thread of
prometheus_client) asks the loop for a snapshot of plain numbers and builds
the metric families from it off the loop.

prometheus_client is imported only by the functions that need it, so
importing a learner or writer does not pay for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
import weakref
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Seconds; from a fast sample decision (tens of us) to a rate-limited insert.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SNAPSHOT_TIMEOUT = 5.0  # s a scrape waits for a busy event loop
AUTO_PORT = -1  # --metrics-port auto: any free port (reported in the log and ready file)
# What scrapers may cost a process: this many served at once (a thread each),
# each with this long to send its request and read the answer; a scraper
# beyond them is hung up on at once (Prometheus scrapes once per interval).
MAX_SCRAPERS = 8
SCRAPE_IO_TIMEOUT = 5.0
LOOPBACK = "127.0.0.1"  # where /metrics listens unless asked (it names tables and hosts)


class Histogram:
    """A latency histogram counted once per batch, exported at scrape time.

    ``observe`` is one bisect and two additions (no lock: each histogram is
    fed by one thread). Buckets follow Prometheus: ``le`` is inclusive.

    >>> h = Histogram((0.001, 0.01))
    >>> h.observe(0.002); h.observe(0.5)
    >>> h.cumulative()
    [('0.001', 0), ('0.01', 1), ('+Inf', 2)]
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        """Count one observation."""
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        """Observations so far."""
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations <= le) per bucket, +Inf last: Prometheus' form."""
        counts = list(self.counts)  # one consistent copy
        out, total = [], 0
        for bound, c in zip(self.bounds + (float("inf"),), counts):
            total += c
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """(buckets, sum) for a collector, copied now."""
        return self.cumulative(), self.sum


# -- what the processes count ---------------------------------------------------

@dataclass
class TableStats:
    """A table's counters beyond inserts, samples and deletes (control plane)."""

    holds: Counter = field(default_factory=Counter)  # op -> calls a rate limiter held
    timeouts: Counter = field(default_factory=Counter)  # op -> held calls that timed out
    waiting: Counter = field(default_factory=Counter)  # op -> calls held now
    priority_updates: int = 0  # keys whose priority was set
    priority_missing: int = 0  # keys of updates that were no longer in the table
    decision: Histogram = field(default_factory=Histogram)  # sample decision, per request


@dataclass
class ControlStats:
    """The control plane's own counters."""

    membership: Counter = field(default_factory=Counter)  # joined/rejoined/left/dropped
    checkpoints: int = 0
    checkpoint_failures: int = 0


@dataclass
class NodeStats:
    """A storage node's insert counters (one update per acknowledged batch)."""

    batches: int = 0
    items: int = 0
    bytes: int = 0
    failed_batches: int = 0
    latency: Histogram = field(default_factory=Histogram)  # request to acknowledgement

    def inserted(self, items: int, nbytes: int, seconds: float) -> None:
        """Count one acknowledged batch."""
        self.batches += 1
        self.items += items
        self.bytes += nbytes
        self.latency.observe(seconds)


@dataclass
class LearnerStats:
    """A learner's counters (one update per batch or per gather)."""

    fetched_items: Counter = field(default_factory=Counter)  # path -> items read
    fetched_bytes: Counter = field(default_factory=Counter)  # path -> bytes read
    batches: int = 0
    gather: Histogram = field(default_factory=Histogram)  # one gather (all paths)
    wait_seconds: float = 0.0  # iterating: time the caller waited for a batch
    iter_started: float | None = None  # monotonic time of the first iteration

    def fetched(self, path: str, items: int, nbytes: int) -> None:
        """Count `items` read over `path` ("mapped" or "ucx")."""
        self.fetched_items[path] += items
        self.fetched_bytes[path] += nbytes

    def waited(self, seconds: float) -> None:
        """The caller waited `seconds` for the next prefetched batch."""
        if self.iter_started is None:
            self.iter_started = time.monotonic() - seconds
        self.wait_seconds += seconds

    def wait_ratio(self) -> float:
        """Share of wall time since iterating began spent waiting for data (0..1)."""
        if self.iter_started is None:
            return 0.0
        wall = time.monotonic() - self.iter_started
        return min(1.0, self.wait_seconds / wall) if wall > 0 else 0.0


@dataclass
class WriterStats:
    """A writer's counters (one update per acknowledged batch)."""

    batches: int = 0
    items: int = 0
    bytes: int = 0
    latency: Histogram = field(default_factory=Histogram)  # sent to acknowledged


# -- learners and writers of this process ---------------------------------------

_clients: weakref.WeakValueDictionary[tuple[str, str], Any] = weakref.WeakValueDictionary()
_ids = itertools.count()
_lock = threading.Lock()


def track(kind: str, obj: Any) -> str:
    """Register a learner or writer (held weakly) so that this process's
    registry exports its stats; returns its label value (unique here)."""
    name = str(next(_ids))
    with _lock:
        _clients[(kind, name)] = obj
    return name


def _tracked(kind: str) -> list[tuple[str, Any]]:
    with _lock:
        items = list(_clients.items())
    return [(name, obj) for (k, name), obj in items if k == kind]


# -- metric families ------------------------------------------------------------

def _families():
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    return CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


def control_families(snap: dict) -> list:
    """Metric families from a control plane snapshot (see control_snapshot)."""
    C, G, H = _families()
    t = ["table"]
    size = G("distore_table_size", "Items in the table (sampleable)", labels=t)
    cap = G("distore_table_capacity", "Items the table holds at most", labels=t)
    ins = C("distore_table_inserts", "Items inserted into the table", labels=t)
    smp = C("distore_table_samples", "Items sampled from the table (a batch of n counts n)",
            labels=t)
    ev = C("distore_table_evictions", "Items removed by the remover at capacity or after "
           "max_times_sampled", labels=t)
    leased = G("distore_table_leased_items", "Items under at least one lease (being read)",
               labels=t)
    holds = C("distore_table_rate_limiter_holds", "Calls the rate limiter held (op: insert "
              "batch or sample request)", labels=t + ["op"])
    tmo = C("distore_table_rate_limiter_timeouts", "Held calls that timed out (op: insert "
            "batch or sample request)", labels=t + ["op"])
    waiting = G("distore_table_rate_limiter_waiting", "Calls the rate limiter holds now",
                labels=t + ["op"])
    pu = C("distore_table_priority_updates", "Priorities set by update_priorities", labels=t)
    pm = C("distore_table_priority_updates_missing", "Priority updates for keys no longer in "
           "the table", labels=t)
    dec = H("distore_table_sample_decision_seconds", "Control-plane time to choose, lease and "
            "locate one sample request's items (rate-limiter wait excluded)", labels=t)
    for r in snap["tables"]:
        lv = [r["name"]]
        size.add_metric(lv, r["size"])
        cap.add_metric(lv, r["capacity"])
        ins.add_metric(lv, r["inserts"])
        smp.add_metric(lv, r["samples"])
        ev.add_metric(lv, r["deletes"])
        leased.add_metric(lv, r["leased"])
        st: TableStats = r["stats"]
        for op in ("insert", "sample"):
            holds.add_metric(lv + [op], st["holds"].get(op, 0))
            tmo.add_metric(lv + [op], st["timeouts"].get(op, 0))
            waiting.add_metric(lv + [op], st["waiting"].get(op, 0))
        pu.add_metric(lv, st["priority_updates"])
        pm.add_metric(lv, st["priority_missing"])
        buckets, total = st["decision"]
        dec.add_metric(lv, buckets, total)
    leases = G("distore_leases", "Sample leases outstanding (one per sampled batch not yet "
               "released)")
    leases.add_metric([], snap["leases"])
    nodes = G("distore_nodes", "Storage nodes known to the control plane", labels=["state"])
    nodes.add_metric(["alive"], snap["nodes_alive"])
    nodes.add_metric(["dead"], snap["nodes_dead"])
    # Of the alive: missed heartbeats, routed around, items kept (membership.py).
    nodes.add_metric(["unresponsive"], snap.get("nodes_unresponsive", 0))
    arena = G("distore_nodes_arena_bytes", "Arena bytes of the live storage nodes")
    arena.add_metric([], snap["arena_bytes"])
    used = G("distore_nodes_used_bytes", "Arena bytes in use on the live storage nodes "
             "(as last reported)")
    used.add_metric([], snap["used_bytes"])
    mem = C("distore_membership_changes", "Storage nodes that joined, re-joined, left or were "
            "dropped", labels=["change"])
    for change in ("joined", "rejoined", "left", "dropped"):
        mem.add_metric([change], snap["membership"].get(change, 0))
    ck = C("distore_checkpoints", "Checkpoints written")
    ck.add_metric([], snap["checkpoints"])
    ckf = C("distore_checkpoint_failures", "Checkpoints that failed")
    ckf.add_metric([], snap["checkpoint_failures"])
    out = [size, cap, ins, smp, ev, leased, holds, tmo, waiting, pu, pm, dec, leases, nodes,
           arena, used, mem, ck, ckf]
    last = snap["last_checkpoint"]
    if last is not None:
        for name, doc, key in (
            ("distore_checkpoint_duration_seconds", "Time the last checkpoint took", "seconds"),
            ("distore_checkpoint_size_bytes", "Size of the last checkpoint file", "bytes"),
            ("distore_checkpoint_items", "Items in the last checkpoint", "items"),
            ("distore_checkpoint_timestamp_seconds", "Unix time of the last checkpoint",
             "created"),
        ):
            g = G(name, doc)
            g.add_metric([], last[key])
            out.append(g)
    restoring = G("distore_restoring", "1 while a restore waits for nodes to re-send items")
    restoring.add_metric([], 1 if snap["restoring"] else 0)
    out.append(restoring)
    return out


def control_snapshot(plane) -> dict:
    """Plain numbers of a ControlPlane, taken on its event loop."""
    tables = []
    for t in list(plane.tables.values()):
        st: TableStats = t.stats
        tables.append({
            "name": t.name, "size": t.size, "capacity": t.capacity, "inserts": t.inserts,
            "samples": t.samples, "deletes": t.deletes, "leased": t.leased(),
            "stats": {"holds": dict(st.holds), "timeouts": dict(st.timeouts),
                      "waiting": dict(st.waiting), "priority_updates": st.priority_updates,
                      "priority_missing": st.priority_missing,
                      "decision": st.decision.snapshot()},
        })
    nodes = list(plane.members.nodes.values())
    alive = [n for n in nodes if n.alive]
    stats: ControlStats = plane.stats
    return {
        "tables": tables, "leases": len(plane.leases),
        "nodes_alive": len(alive), "nodes_dead": len(nodes) - len(alive),
        "nodes_unresponsive": sum(not n.live for n in alive),
        "arena_bytes": sum(n.arena_size for n in alive),
        "used_bytes": sum(n.used_bytes for n in alive),
        "membership": dict(stats.membership), "checkpoints": stats.checkpoints,
        "checkpoint_failures": stats.checkpoint_failures,
        "last_checkpoint": plane.last_checkpoint,
        "restoring": plane._restoring is not None,
    }


def node_families(snap: dict) -> list:
    """Metric families from a storage node snapshot (see node_snapshot)."""
    C, G, H = _families()
    n = ["node"]
    lv = [snap["node"]]
    total = G("distore_node_arena_bytes", "Size of the node's arena", labels=n)
    total.add_metric(lv, snap["arena_bytes"])
    used = G("distore_node_arena_used_bytes", "Arena bytes in slots in use", labels=n)
    used.add_metric(lv, snap["used_bytes"])
    carved = G("distore_node_arena_carved_bytes", "Arena bytes below the bump pointer "
               "(carved into slots at some point)", labels=n)
    carved.add_metric(lv, snap["carved_bytes"])
    items = G("distore_node_items", "Slots in use on the node, by table", labels=n + ["table"])
    for table, count in snap["items"].items():
        items.add_metric(lv + [table], count)
    b = C("distore_node_insert_batches", "Insert batches stored and acknowledged", labels=n)
    b.add_metric(lv, snap["batches"])
    i = C("distore_node_insert_items", "Items stored and acknowledged", labels=n)
    i.add_metric(lv, snap["items_inserted"])
    by = C("distore_node_insert_bytes", "Item bytes stored and acknowledged", labels=n)
    by.add_metric(lv, snap["bytes"])
    f = C("distore_node_insert_failures", "Insert batches that failed (slots freed)", labels=n)
    f.add_metric(lv, snap["failed_batches"])
    lat = H("distore_node_insert_seconds", "Time from an insert request to its acknowledgement "
            "(pull, registration and any rate-limiter wait)", labels=n)
    buckets, total_s = snap["latency"]
    lat.add_metric(lv, buckets, total_s)
    joined = G("distore_node_joined", "1 while the node is registered with a control plane",
               labels=n)
    joined.add_metric(lv, 1 if snap["joined"] else 0)
    return [total, used, carved, items, b, i, by, f, lat, joined]


def node_snapshot(node) -> dict:
    """Plain numbers of a StorageNode, taken on its event loop."""
    arena = node.arena
    st: NodeStats = node.stats
    items = {} if arena is None else {
        name: s.n - s.free_slots for name, s in arena.tables().items()}
    return {
        "node": node.name, "arena_bytes": arena.size if arena else 0,
        "used_bytes": arena.used_bytes if arena else 0,
        "carved_bytes": arena.high_water if arena else 0, "items": items,
        "batches": st.batches, "items_inserted": st.items, "bytes": st.bytes,
        "failed_batches": st.failed_batches, "latency": st.latency.snapshot(),
        "joined": node._joined.is_set(),
    }


def client_families() -> list:
    """Metric families of this process's live learners and writers."""
    C, G, H = _families()
    lt = ["table", "learner"]
    fi = C("distore_learner_fetched_items", "Items read into the learner's ring, by path "
           "(mapped: same-host read-only mapping; ucx: one-sided UCX reads)",
           labels=lt + ["path"])
    fb = C("distore_learner_fetched_bytes", "Bytes read into the learner's ring (slot header "
           "included), by path", labels=lt + ["path"])
    nb = C("distore_learner_batches", "Batches handed out", labels=lt)
    rs = C("distore_learner_resampled_items", "Items dropped (slot reused, node gone) and "
           "sampled again", labels=lt)
    torn = C("distore_learner_torn_items", "Items whose slot was rewritten while copied "
             "(resampled)", labels=lt)
    pm = C("distore_learner_priority_updates_missing", "Priority updates for keys no longer "
           "in the table", labels=lt)
    gl = H("distore_learner_gather_seconds", "Time of one gather: reading a sampled batch's "
           "items from every node into the ring", labels=lt)
    ws = C("distore_learner_data_wait_seconds", "Time the training loop waited for the next "
           "prefetched batch while iterating", labels=lt)
    wr = G("distore_learner_data_wait_ratio", "Share of wall time since iterating began "
           "spent waiting for data (0..1)", labels=lt)
    for name, learner in _tracked("learner"):
        st: LearnerStats = learner.stats
        lv = [learner.table, name]
        for path in ("mapped", "ucx"):
            fi.add_metric(lv + [path], st.fetched_items.get(path, 0))
            fb.add_metric(lv + [path], st.fetched_bytes.get(path, 0))
        nb.add_metric(lv, st.batches)
        rs.add_metric(lv, learner.resampled)
        torn.add_metric(lv, learner.torn)
        pm.add_metric(lv, learner.priority_updates_missing)
        buckets, total = st.gather.snapshot()
        gl.add_metric(lv, buckets, total)
        ws.add_metric(lv, st.wait_seconds)
        wr.add_metric(lv, st.wait_ratio())
    wt = ["writer"]
    wi = C("distore_writer_inserted_items", "Items stored and acknowledged", labels=wt)
    wb = C("distore_writer_inserted_bytes", "Item bytes stored and acknowledged", labels=wt)
    wn = C("distore_writer_batches", "Batches stored and acknowledged", labels=wt)
    wl = H("distore_writer_batch_seconds", "Time from sending a batch to its acknowledgement",
           labels=wt)
    for name, writer in _tracked("writer"):
        st: WriterStats = writer.stats
        wi.add_metric([name], st.items)
        wb.add_metric([name], st.bytes)
        wn.add_metric([name], st.batches)
        buckets, total = st.latency.snapshot()
        wl.add_metric([name], buckets, total)
    return [fi, fb, nb, rs, torn, pm, gl, ws, wr, wi, wb, wn, wl]


# -- collectors and registries ------------------------------------------------------

class LoopCollector:
    """A prometheus_client collector that takes `snapshot(obj)` on `loop`
    (where `obj`'s state lives) and turns it into families off the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, obj: Any,
                 snapshot: Callable[[Any], dict], families: Callable[[dict], list]):
        self._loop = loop
        self._obj = obj
        self._snapshot = snapshot
        self._families = families

    def describe(self) -> list:
        return []  # names vary with tables; never checked for clashes at register time

    def collect(self):
        """Families of a snapshot taken on the event loop (none if it is stuck)."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def take():
            try:
                future.set_result(self._snapshot(self._obj))
            except Exception as exc:  # noqa: BLE001 - reported by the scrape, not lost
                future.set_exception(exc)

        try:
            self._loop.call_soon_threadsafe(take)
            snap = future.result(SNAPSHOT_TIMEOUT)
        except (RuntimeError, concurrent.futures.TimeoutError) as exc:
            log.warning("metrics scrape: no snapshot from the event loop (%s)",
                        exc or f"busy for more than {SNAPSHOT_TIMEOUT:g} s")
            return
        yield from self._families(snap)


class ClientCollector:
    """The learners and writers of this process (see track)."""

    def describe(self) -> list:
        return []

    def collect(self):
        """Families of every live learner and writer."""
        yield from client_families()


def new_registry(collector=None):
    """A CollectorRegistry with process CPU/memory metrics and `collector`."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    if collector is not None:
        registry.register(collector)
    return registry


_registry = None


def registry():
    """This process's registry of learner and writer metrics (with process CPU
    and memory): serve it, push it, or read it with generate_latest.

    >>> from prometheus_client import generate_latest
    >>> text = generate_latest(ds.metrics.registry())
    """
    global _registry
    with _lock:
        if _registry is None:
            _registry = new_registry(ClientCollector())
        return _registry


def collector() -> ClientCollector:
    """A collector of this process's learners and writers, to register in a
    registry of your own (e.g. prometheus_client.REGISTRY.register(...))."""
    return ClientCollector()


class MetricsServer:
    """A /metrics HTTP endpoint on its own thread; `close()` stops it."""

    def __init__(self, httpd, thread):
        self._httpd = httpd
        self._thread = thread
        self.host, self.port = httpd.server_address[:2]

    @property
    def url(self) -> str:
        """http://host:port/metrics"""
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

    from .errors import ConfigError

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
    """Serve this process's learner and writer metrics on http://host:port/metrics
    (port 0: any free one). Served on loopback unless `host` says otherwise
    ("0.0.0.0" or "": every interface), since the metrics name tables and
    hosts. Returns the server (`.port`, `.url`, `.close()`).

    >>> server = ds.metrics.serve(9800)
    """
    return start_server(port, host, registry(), "learner/writer process")


def push(gateway: str, job: str, grouping_key: dict | None = None) -> None:
    """Push this process's learner and writer metrics to a Prometheus
    Pushgateway (for short jobs that are gone before a scrape)."""
    from prometheus_client import push_to_gateway

    push_to_gateway(gateway, job=job, registry=registry(), grouping_key=grouping_key)


def serve_process(port: int, host: str, loop, obj, snapshot, families, role: str,
                  optional: bool = False) -> MetricsServer | None:
    """Serve a control plane's or node's metrics (port 0: none), logging where.

    A port that is taken raises ConfigError, unless `optional` (the port is
    the default, nobody's choice): then a warning says so and none is served.
    """
    from .errors import ConfigError

    if port == 0:
        return None
    registry_ = new_registry(LoopCollector(loop, obj, snapshot, families))
    try:
        server = start_server(port, host, registry_, role)
    except ConfigError as exc:
        if not optional:
            raise
        log.warning("%s (the default metrics port; set --metrics-port to choose one)", exc)
        return None
    log.info("%s serves Prometheus metrics at %s", role, server.url)
    return server


def catalog() -> dict[str, tuple[str, str]]:
    """Every metric distore exports: {name as scraped: (type, help)}.

    Counters are listed with their ``_total`` suffix, histograms by their
    base name (scraped as ``_bucket``, ``_sum`` and ``_count``); the process
    metrics (``process_*``) come from prometheus_client's ProcessCollector.
    """
    hist = TableStats().decision.snapshot()
    table = {"name": "t", "size": 0, "capacity": 1, "inserts": 0, "samples": 0, "deletes": 0,
             "leased": 0, "stats": {"holds": {}, "timeouts": {}, "waiting": {},
                                    "priority_updates": 0, "priority_missing": 0,
                                    "decision": hist}}
    control = {"tables": [table], "leases": 0, "nodes_alive": 0, "nodes_dead": 0,
               "arena_bytes": 0, "used_bytes": 0, "membership": {}, "checkpoints": 0,
               "checkpoint_failures": 0, "restoring": False,
               "last_checkpoint": {"seconds": 0.0, "bytes": 0, "items": 0, "created": 0.0}}
    node = {"node": "n", "arena_bytes": 0, "used_bytes": 0, "carved_bytes": 0,
            "items": {"t": 0}, "batches": 0, "items_inserted": 0, "bytes": 0,
            "failed_batches": 0, "latency": hist, "joined": True}
    out = {}
    for fam in control_families(control) + node_families(node) + client_families():
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out[name] = (fam.type, fam.documentation)
    from prometheus_client import ProcessCollector

    for fam in ProcessCollector(registry=None).collect():
        name = fam.name + ("_total" if fam.type == "counter" else "")
        out[name] = (fam.type, fam.documentation)
    return out


__all__ = [
    "LATENCY_BUCKETS",
    "ControlStats",
    "Histogram",
    "LearnerStats",
    "MetricsServer",
    "NodeStats",
    "TableStats",
    "WriterStats",
    "catalog",
    "collector",
    "push",
    "registry",
    "serve",
    "track",
]
