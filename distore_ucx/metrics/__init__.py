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

The package, one concept a module:

- :mod:`.histogram`: the latency histogram;
- :mod:`.stats`: the counters each role keeps;
- :mod:`.families`: every role's metric families, from snapshots of plain
  numbers, and the catalog of every metric;
- :mod:`.registries`: collectors and registries (a role's own; this
  process's learners and writers);
- :mod:`.exposition`: the /metrics HTTP server and the Pushgateway.

A role's server and registry are closed by the role when it stops
(MetricsServer.close); the learners' and writers' registry holds no thread
or socket, and whoever serves it closes the server it started.
"""

from .exposition import (
    AUTO_PORT,
    LOOPBACK,
    MAX_SCRAPERS,
    SCRAPE_IO_TIMEOUT,
    MetricsServer,
    push,
    serve,
    serve_process,
    start_server,
)
from .families import (
    catalog,
    client_families,
    control_families,
    control_snapshot,
    node_families,
    node_snapshot,
)
from .histogram import LATENCY_BUCKETS, Histogram
from .registries import (
    PROCESS,
    SNAPSHOT_TIMEOUT,
    ClientCollector,
    LoopCollector,
    ProcessRegistry,
    collector,
    new_registry,
    registry,
    track,
)
from .stats import ControlStats, LearnerStats, NodeStats, TableStats, WriterStats

# The first names are what `from distore_ucx.metrics import *` gave before the
# package; the rest were importable by name then too, and still are.
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
    "AUTO_PORT", "LOOPBACK", "MAX_SCRAPERS", "SCRAPE_IO_TIMEOUT", "SNAPSHOT_TIMEOUT",
    "ClientCollector", "LoopCollector", "PROCESS", "ProcessRegistry",
    "client_families", "control_families", "control_snapshot", "new_registry",
    "node_families", "node_snapshot", "serve_process", "start_server",
]
