"""Switches read from the environment where they are used.

Measuring and debugging switches (``DISTORE_AM_INSERTS``,
``DISTORE_LOCAL_MAP``, ...: SWITCHES) and the UCX variables the runtime
reports. They are not settings (no flag, no TOML key): they choose how
bytes move, not what a process is, and are turned off to measure or to
rule a path out. Code below the configuration layer calls these functions
and never reads the environment itself (tests/unit/test_layers.py). They
read at each call (not once at import), so that a process or test that
sets a variable late is heard. `distore config show` lists them beside the
settings, and docs/deployment.md in a table of its own (switches_table).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ConfigError
from .values import parse_size, to_bool

# A rendezvous message costs three control messages besides the bytes, a
# get one: below this size per-item overhead wins over the copies saved.
# perf/insert_bandwidth.py measures the crossover (docs/performance.md).
AM_MIN_ITEM_BYTES = 64 << 10
# Milliseconds a node's next items_added waits for more small inserts
# (storage/registrations.py; perf/fanin.py measures it).
REGISTER_DELAY_MS = 10.0


@dataclass(frozen=True)
class Switch:
    """One variable read where it is used: its name, its default as a user
    would write it (None: the process decides) and what it does."""

    variable: str
    default: str | None
    meaning: str


SWITCHES = (
    Switch("DISTORE_AM_INSERTS", "1",
           "writers send items of DISTORE_AM_MIN_ITEM or more to storage nodes as UCX active "
           "messages where UCX emulates RMA (TCP); 0: nodes read writers' staging buffers "
           "with one-sided gets (nodes and writers)"),
    Switch("DISTORE_AM_INSERT_RUNS", "1",
           "items much smaller than a megabyte go to a node several to a message; 0: one "
           "item a message (nodes or writers)"),
    Switch("DISTORE_AM_SAMPLES", "1",
           "where UCX emulates RMA (TCP), nodes send sampled items into learners' buffers "
           "as active messages; 0: learners read them with one-sided gets (nodes or "
           "learners)"),
    Switch("DISTORE_AM_MIN_ITEM", f"{AM_MIN_ITEM_BYTES >> 10}KiB",
           "items smaller than this go by one-sided gets even to nodes that take active "
           "messages (writers; bytes, or e.g. 64KiB)"),
    Switch("DISTORE_LOCAL_MAP", "1",
           "same-host processes share memory: learners read nodes' arenas through a "
           "read-only mapping, nodes map writers' staging buffers; 0: UCX and "
           "process_vm_readv (learners and writers; their local_map= wins)"),
    Switch("DISTORE_DISK_BOUNCE", None,
           "1 or 0: cold reads go (or not) through hugepage buffers, in place of the "
           "node's own choice (nodes with a disk tier)"),
    Switch("DISTORE_SAMPLE_AHEAD", None,
           "batches a learner asks the control plane for in one request when its "
           "sample_ahead= is left out (learners; unset: the learner's default, see "
           "Learner)"),
    Switch("DISTORE_REGISTER_DELAY", f"{REGISTER_DELAY_MS:g}ms",
           "how long a node's next items_added may wait for more small inserts after the "
           "last was sent (a few items each: fan-in); 0: sent as soon as the last is "
           "answered (nodes; milliseconds, e.g. 10 or 10ms)"),
    Switch("DISTORE_UVLOOP", "1",
           "the control plane and storage nodes run their event loop on uvloop (C, libuv) "
           "where it is installed; 0: on asyncio's own loop (servers)"),
)


def switches_shown(environ) -> dict[str, dict]:
    """Each switch's value in `environ` and where it came from ("env" or
    "default"), as `distore config show` prints the settings."""
    shown = {}
    for s in SWITCHES:
        value = environ.get(s.variable, "").strip()
        shown[s.variable] = {"value": value or s.default, "source": "env" if value else "default"}
    return shown


def switches_table() -> str:
    """SWITCHES as the Markdown table of docs/deployment.md (which holds it
    between markers; tests/unit/test_docs.py keeps the two equal)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for s in SWITCHES:
        default = "the process decides" if s.default is None else f"`{s.default}`"
        rows.append(f"| `{s.variable}` | {default} | {s.meaning} |")
    return "\n".join(rows) + "\n"


def switch_from_env(name: str, default: bool = True) -> bool:
    """A measuring or debugging switch read from the environment
    (DISTORE_LOCAL_MAP, DISTORE_AM_INSERTS): "0", "false", "no" or "off"
    turn it off, "1", "true", "yes" or "on" on; unset or empty, `default`.
    Anything else is a ConfigError naming the variable."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return to_bool(value)
    except ValueError:
        raise ConfigError(f"{name} must be 0 or 1 (or false/true, no/yes, off/on), "
                          f"got {value!r}") from None


def size_from_env(name: str, default: int) -> int:
    """A size in bytes read from the environment ("65536", "64KiB");
    unset or empty, `default`. Anything else is a ConfigError naming the
    variable."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return parse_size(value)
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def am_inserts_enabled() -> bool:
    """Whether writers send large items as UCX active messages to nodes
    that take them, where UCX emulates RMA (TCP): on unless
    `DISTORE_AM_INSERTS=0` (nodes and writers; off, nodes read writers'
    staging buffers with one-sided gets).

    Writers connect through the node's insert listener (storage/pulls.py),
    which gives their endpoints peer-failure handling and keeps the
    zero-copy rendezvous: a writer killed mid-batch fails the node's
    receives instead of crashing the node, as endpoints made from a worker
    address without that handling did with UCX 1.21
    (tests/integration/test_am_insert_kills.py)."""
    return switch_from_env("DISTORE_AM_INSERTS", default=True)


def am_insert_runs_enabled() -> bool:
    """Whether items much smaller than a megabyte go to a node's insert
    listener several to a message (runs, native/am_insert.h): on unless
    `DISTORE_AM_INSERT_RUNS=0` (on nodes, which then take one item a
    message, or writers, which then send so). A run saves three of the
    four messages each item's rendezvous costs over TCP; the node copies
    the run's items from a bounce chunk into their slots."""
    return switch_from_env("DISTORE_AM_INSERT_RUNS", default=True)


def am_samples_enabled() -> bool:
    """Whether samples travel as UCX active messages where UCX emulates RMA
    (storage nodes serve them, learners ask for them; native/am_sample.h):
    on unless `DISTORE_AM_SAMPLES=0` (on nodes or learners). Learners reach
    a node's sample listener (storage/sample_server.py), over endpoints with
    peer-failure handling: a stopped node is given up after the gather's
    stall, as with one-sided gets, and a killed learner fails the node's
    sends."""
    return switch_from_env("DISTORE_AM_SAMPLES", default=True)


def am_min_item_bytes() -> int:
    """Items smaller than this go by one-sided gets even to nodes that take
    active messages (`DISTORE_AM_MIN_ITEM`, bytes or e.g. "64KiB"; default
    AM_MIN_ITEM_BYTES)."""
    return size_from_env("DISTORE_AM_MIN_ITEM", AM_MIN_ITEM_BYTES)


def local_map_default() -> bool:
    """Whether learners map same-host arenas unless told otherwise
    (`DISTORE_LOCAL_MAP=0` turns it off, for measuring and debugging)."""
    return switch_from_env("DISTORE_LOCAL_MAP")


def disk_bounce(default: bool) -> bool:
    """Whether cold reads go through hugepage buffers (storage/tier.py
    `bounce_reads`): `DISTORE_DISK_BOUNCE=0/1` overrides the node's choice,
    `default`."""
    return switch_from_env("DISTORE_DISK_BOUNCE", default)


def sample_ahead_from_env() -> int | None:
    """Batches per control-plane request that `DISTORE_SAMPLE_AHEAD` asks
    for (a learner's `sample_ahead` left out); None when unset or empty."""
    env = os.environ.get("DISTORE_SAMPLE_AHEAD", "").strip()
    if not env:
        return None
    try:
        return int(env)
    except ValueError:
        raise ConfigError(f"DISTORE_SAMPLE_AHEAD={env!r} is not a whole number of "
                          "batches; set it to 1 (no sampling ahead) or more") from None


def uvloop_enabled() -> bool:
    """Whether the servers (control plane, storage nodes) run their event
    loop on uvloop where it is installed: on unless `DISTORE_UVLOOP=0`
    (transport/event_loop.py; then asyncio's own loop)."""
    return switch_from_env("DISTORE_UVLOOP", default=True)


def register_delay() -> float:
    """Seconds a storage node's next items_added may wait for more small
    inserts (storage/registrations.py): `DISTORE_REGISTER_DELAY` in
    milliseconds ("10", "10ms"; 0: no wait), REGISTER_DELAY_MS unset."""
    value = os.environ.get("DISTORE_REGISTER_DELAY", "").strip()
    if not value:
        return REGISTER_DELAY_MS / 1e3
    text = value[:-2].strip() if value.lower().endswith("ms") else value
    try:
        ms = float(text)
    except ValueError:
        ms = -1.0
    if not 0.0 <= ms <= 1000.0:
        raise ConfigError(f"DISTORE_REGISTER_DELAY={value!r}: give milliseconds from 0 to "
                          "1000 (e.g. 10, or 0 to send each request as soon as the last is "
                          "answered)")
    return ms / 1e3


def ucx_tls() -> str | None:
    """UCX_TLS as the environment sets it (None when unset), which UCX reads
    too: the transport layer reports and narrows it (transport/runtime.py)."""
    return os.environ.get("UCX_TLS")


def rendezvous_config() -> dict[str, str]:
    """UCX options of clients' and storage nodes' runtimes: the `put_zcopy`
    rendezvous scheme, unless UCX_RNDV_SCHEME is set. Writers send their
    items to nodes as rendezvous messages (storage/pulls.py); with this
    scheme (the sender's choice) each goes from the staging buffer into its
    slot with no bounce copy on a software transport (TCP). It concerns
    rendezvous only: one-sided gets are unchanged."""
    if os.environ.get("UCX_RNDV_SCHEME"):
        return {}
    return {"RNDV_SCHEME": "put_zcopy"}


def runtime_config() -> dict[str, str]:
    """UCX options of clients' and storage nodes' runtimes: the rendezvous
    scheme (rendezvous_config) and a mutex, not a spinlock, as each worker's
    lock (`USE_MT_MUTEX`), unless UCX_USE_MT_MUTEX is set. A worker is
    shared by its progress thread and the threads that post to it (a
    writer's inserting thread); over TCP the progress thread holds the lock
    through each send system call of a rendezvous, and a spinning poster
    burned 8-10% of a writer's CPU waiting for it (docs/performance.md)."""
    lock = {} if os.environ.get("UCX_USE_MT_MUTEX") else {"USE_MT_MUTEX": "y"}
    return {**rendezvous_config(), **lock}
