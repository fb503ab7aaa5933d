"""The entry point of the client API: `connect(address)` -> Client."""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from typing import Any

from .. import rate_limiters as _rate_limiters
from .. import selectors as _selectors
from ..config import read_token, runtime_config, token_path, ucx_tls
from ..errors import CapacityWarning, ConfigError
from ..protocol import parse_reply
from ..rate_limiters import RateLimiter
from ..selectors import Selector
from ..spec import TableSpec
from ..table_definition import TableDefinition
from ..transport import rpc
from .learner import Learner
from .lifecycle import close_on_exit, ensure_open
from .writer import Writer

log = logging.getLogger(__name__)

def connect(address: str, timeout: float = 30.0, token_file: str | None = None) -> Client:
    """Connect to a control plane.

    Args:
        address: The control plane's "host:port".
        timeout: Seconds a request may take, and how long requests wait for
            a control plane that restarts to come back.
        token_file: The file holding the store's shared secret, when it
            requires one (default: $DISTORE_TOKEN_FILE; neither: no token).

    Returns:
        A `Client`. Close it, or use it as a context manager, which closes
        the writers and learners it made too.

    Raises:
        ConfigError: `address` is not "host:port", or the token file cannot
            be read or holds too short a token.
        ConnectionFailed: Nothing answers at `address`.
        WrongPeer: Something other than a control plane answers there (a
            storage node, an HTTP server such as a /metrics port).
        AuthenticationFailed: The control plane refused the token, or wants one.
        Timeout: The control plane did not greet or answer in time.

    >>> client = ds.connect("127.0.0.1:7700")
    """
    return Client(address, timeout, token_file)


class Client:
    """A session with one control plane: tables, writers, learners.

    Made by `connect`, which takes the same arguments. Thread safe. Writers
    and learners it makes have their own connections; close the client (or
    use it as a context manager) to close them all. When the control plane
    restarts, requests wait for it (up to `timeout` s) and go on over a new
    connection.

    Every method that asks the control plane may raise `ConnectionFailed`
    (it could not be reached for `timeout` s), `Timeout` (no reply in
    time) and, once the client is closed, `Closed`; the Raises sections
    below name the other errors.

    Attributes:
        address: The control plane's "host:port".
        timeout: Seconds a request may take (and waits for a restart).
        token_file: The token file it read (None: no token), so that other
            processes can connect as it did.
    """

    def __init__(self, address: str, timeout: float = 30.0, token_file: str | None = None):
        self.address = address
        self.timeout = timeout
        self.token_file = token_path(token_file)  # what it read: others can connect as it did
        self.token = read_token(self.token_file)
        # Control-plane connections come back by themselves after a restart.
        self._rpc = rpc.RpcClient(address, timeout, token=self.token, reconnect=timeout,
                                  expect="control plane")
        self._lock = threading.Lock()
        self._runtime = None
        self._children: list[Any] = []  # learners
        # Writers, held weakly: one the caller drops is collected and flushes
        # by itself (Writer.__del__); close() flushes those still here.
        self._writers: weakref.WeakSet[Writer] = weakref.WeakSet()
        self._specs: dict[str, TableSpec] = {}
        self._slice_lens: dict[str, int] = {}  # table -> steps a slice (0: items)
        self._warned: set[str] = set()  # capacity warnings given (table_info, status)
        self._closed = False
        self._connections: weakref.WeakSet[rpc.RpcClient] = weakref.WeakSet()  # see connection()

    # -- tables ----------------------------------------------------------
    def create_table(
        self,
        name: str,
        capacity: int,
        spec: Any,
        sampler: Selector | str | None = None,
        remover: Selector | str | None = None,
        rate_limiter: RateLimiter | None = None,
        max_times_sampled: int = 0,
        slice_len: int = 0,
        slice_period: int = 1,
        slice_pad: str = "none",
    ) -> dict:
        """Create a table; idempotent for identical definitions.

        `slice_len` > 0 makes a table of steps of episodes (`spec` is one
        step's): writers add steps with `Writer.append`, each stored once,
        and a learner samples slices of `slice_len` consecutive steps of one
        episode, starting at any step whose position is a multiple of
        `slice_period`, chosen when sampling (uniformly, or by the start
        step's priority with `Prioritized`). `capacity` then counts steps.

        Args:
            name: The table's name (1-128 printable characters).
            capacity: Items it holds (steps, for a table of slices); at
                capacity an insert first evicts the remover's choice.
            spec: {field: (shape, dtype), ...} or one (shape, dtype): what
                an item holds (see `TableSpec`).
            sampler: What a sample returns: a `Selector` (default
                `Uniform()`) or its name ("uniform", "prioritized", ...).
            remover: What leaves at capacity (default `Fifo()`), as `sampler`.
            rate_limiter: When inserts and samples wait (default `MinSize(1)`).
            max_times_sampled: An item leaves after its k-th sample (0: never).
            slice_len: Steps in a slice (0: a table of items).
            slice_period: Slices start at positions that are multiples of it.
            slice_pad: Also sample short slices, padded to `slice_len` by
                repeating their last step, with a mask (`Batch.mask`):
                "end", a slice may start at any step and is cut by its
                episode's end; "short_episodes", only episodes shorter than
                `slice_len`, each one whole (TorchRL's strict_length=False).
                "none" (default): strict.

        Returns:
            The table's info, as `table_info` returns it.

        Raises:
            ConfigError: The definition is invalid (the message says what to
                change), a sampler, remover or rate limiter was passed
                uncalled (``sampler=ds.Prioritized``), or an item is larger
                than every storage node's arena.
            TableExists: A table of that name exists with another definition;
                the message names the fields that differ.

        Warns:
            CapacityWarning: The capacity does not fit in the live nodes.

        >>> client.create_table("r2d2", capacity=1_000_000, spec=step_spec,
        ...                     sampler=ds.Prioritized(0.9), slice_len=80, slice_period=40)

        >>> client.create_table("replay", capacity=10_000,
        ...                     spec={"obs": ((4, 84, 84), "uint8"), "reward": ((), "float32")},
        ...                     sampler=ds.Prioritized(0.6), remover=ds.Fifo())
        """
        for role, value in (("sampler", sampler), ("remover", remover),
                            ("rate_limiter", rate_limiter)):
            _refuse_uncalled(role, value)
        if rate_limiter is not None and not isinstance(rate_limiter, RateLimiter):
            raise ConfigError("rate_limiter must be ds.MinSize, ds.SampleToInsertRatio or ds.Queue")
        definition = TableDefinition.make(name, capacity, spec, sampler, remover, rate_limiter,
                                          max_times_sampled, slice_len, slice_period,
                                          slice_pad)
        info = self.call("create_table", **definition.to_wire())
        created = parse_reply("create_table", info, self._rpc.name)
        self._specs[name] = definition.spec
        self._slice_lens[name] = definition.slice_len
        for text in created.warnings or ():
            # The control plane logged it too; the caller sees it here (and
            # not again from table_info or status, which carry it too).
            self._warned.add(text)
            warnings.warn(text, CapacityWarning, stacklevel=2)
        return _strip(info)

    def table_info(self, name: str) -> dict:
        """A table's state and definition.

        Args:
            name: The table's name.

        Returns:
            A dict of size, capacity, counts (inserts, samples, deletes),
            leased items, spec, sampler, remover, the rate limiter's state;
            `fits`, how many of its items the live nodes can hold beside the
            other tables' items (a full arena evicts by the table's
            remover); `warnings`, a capacity the live nodes can no longer
            hold (a node was lost), also warned once as `CapacityWarning`.

        Raises:
            TableNotFound: There is no table `name`.
        """
        info = _strip(self._checked("table_info", name=name), keep_warnings=True)
        self._warn_capacity(info.get("warnings"))
        if name not in self._specs:  # spec() and slice_len() need not ask again
            self._remember_layout(name, info)
        return info

    def tables(self) -> list[dict]:
        """Every table's info: a list of dicts, as `table_info` returns."""
        return self._checked("list_tables")["tables"]

    def nodes(self) -> list[dict]:
        """The live storage nodes: a list of dicts, with each one's UCX address
        and remote key."""
        return self._checked("nodes")["nodes"]

    def status(self) -> dict:
        """The store's state, as ``distore status`` shows it.

        Returns:
            A dict of nodes (alive or not, memory used), tables and
            outstanding leases; `warnings`, tables whose capacity the live
            nodes can no longer hold (also warned once, `CapacityWarning`).
        """
        st = _strip(self._checked("status"), keep_warnings=True)
        self._warn_capacity(st.get("warnings"))
        return st

    def _warn_capacity(self, texts) -> None:
        # Once per text and client: a loop polling table_info warns once.
        for text in texts or ():
            if text not in self._warned:
                self._warned.add(text)
                warnings.warn(text, CapacityWarning, stacklevel=3)

    def checkpoint(self) -> dict:
        """Make the control plane write its checkpoint now.

        Returns:
            A dict of the file's path, items, bytes and the seconds it took.

        Raises:
            CheckpointError: The control plane was started without
                ``--checkpoint PATH``, or cannot write the file.
        """
        return _strip(self._checked("checkpoint"))

    def spec(self, table: str) -> TableSpec:
        """The `TableSpec` of the table called `table` (asked once, then
        cached); `TableNotFound` if there is none."""
        if table not in self._specs:
            self.table_info(table)  # remembers it
        return self._specs[table]

    def _remember_layout(self, table: str, info: dict) -> None:
        """Cache the spec and slice length a table_info reply carries."""
        self._specs[table] = TableSpec.from_wire(info["spec"])
        self._slice_lens[table] = info.get("slice_len") or 0

    def slice_len(self, table: str) -> int:
        """The `slice_len` of the table called `table`, 0 for a table of items
        (asked once, then cached); `TableNotFound` if there is none."""
        if table not in self._slice_lens:
            self.spec(table)
        return self._slice_lens[table]

    # -- writers and learners ---------------------------------------------
    def writer(self, **options: Any):
        """A writer, to insert items into any table.

        Args:
            **options: `Writer`'s options (`batch_bytes`, `max_items`,
                `max_in_flight`, `timeout`, `local_map`, `max_delay`).

        Returns:
            A `Writer`; the client closes it (flushing it) when it closes.

        Raises:
            ConfigError: An option is invalid.
        """
        ensure_open(self, "client")
        w = Writer(self, **options)
        self._writers.add(w)
        return w

    def learner(self, table: str, batch_size: int, device: str = "cpu", **options: Any):
        """A learner sampling `batch_size` items of `table` into `device` memory.

        Args:
            table: The table's name.
            batch_size: Items (slices, on a table of slices) a batch: 1 to
                65536, what one sample request carries.
            device: "cpu", "cuda" or "cuda:N".
            **options: `Learner`'s other options (`prefetch`, `beta`,
                `timeout`, ...).

        Returns:
            A `Learner`; the client closes it when it closes.

        Raises:
            ConfigError: An option is invalid, or does not fit the table: a
                batch size out of range, a host ring of `prefetch + 1`
                batches larger than this machine's memory, a batch the
                table's rate limiter could never admit. Refused before
                anything is allocated.
            TableNotFound: There is no table `table`.
        """
        ensure_open(self, "client")
        learner = Learner(self, table, batch_size, device=device, **options)
        self._children.append(learner)
        return learner

    @property
    def runtime(self):
        """This client's UCX runtime, made on first use (learners need it)."""
        with self._lock:
            if self._runtime is None:
                from ..transport import UcxRuntime
                from ..transport.at_exit import close_at_exit

                if not _WITH_RUNTIME:
                    close_at_exit(_close_learners_at_exit)
                _WITH_RUNTIME.add(self)
                self._runtime = UcxRuntime(config=runtime_config(), env_tls=ucx_tls())
            return self._runtime

    def call(self, op: str, **fields: Any) -> dict:
        """One request to the control plane (low level)."""
        ensure_open(self, "client")
        return self._rpc.call(op, **fields)

    def _checked(self, op: str, **fields: Any) -> dict:
        """The reply to one request, checked against its declaration
        (protocol/replies.py) and returned as the map it came as: a
        malformed one raises ProtocolError naming the field."""
        reply = self.call(op, **fields)
        parse_reply(op, reply, self._rpc.name)
        return reply

    def connection(self) -> rpc.RpcClient:
        """A new, separate connection to the control plane (it reconnects by itself)."""
        ensure_open(self, "client")
        conn = rpc.RpcClient(self.address, self.timeout, token=self.token, reconnect=self.timeout,
                             expect="control plane")
        self._connections.add(conn)
        return conn

    def close(self) -> None:
        """Close writers (flushing them), learners, the UCX runtime, the connection.

        Everything is closed even when one part fails; the first failure is
        raised then.

        Raises:
            DistoreError: A writer could not store what it held (as
                `Writer.close`), or another part failed to close.
        """
        children, self._children = self._children, []
        writers = sorted(self._writers, key=lambda w: w.writer_id)
        self._writers = weakref.WeakSet()
        first_error = None
        for child in [*reversed(writers), *reversed(children)]:
            try:
                child.close()
            except Exception as exc:  # close everything, then report
                first_error = first_error or exc
        self._closed = True
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None
        self._rpc.close()
        if first_error is not None:
            raise first_error

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        close_on_exit(self, "client", exc_type)


# Clients that made a UCX runtime. At interpreter exit, before the runtimes
# close, their learners are closed (prefetch threads stopped, remote keys and
# rings released), so that nothing reads through a runtime being torn down.
_WITH_RUNTIME: weakref.WeakSet[Client] = weakref.WeakSet()
_EXIT_TIMEOUT = 2.0  # seconds a request may take at interpreter exit


def _close_learners_at_exit() -> None:
    for client in list(_WITH_RUNTIME):
        # Exiting: release leases if the control plane answers at once, but
        # never wait for one that went away (they expire by themselves).
        for conn in [client._rpc, *client._connections]:
            conn.reconnect = 0.0
            conn.timeout = min(conn.timeout, _EXIT_TIMEOUT)
        for child in list(client._children):
            if isinstance(child, Learner):
                try:
                    child.close()
                except Exception as exc:  # exiting anyway; close the others
                    log.debug("at exit: closing a learner of table %r: %s", child.table, exc)


def _strip(reply: dict, keep_warnings: bool = False) -> dict:
    drop = ("id", "ok") if keep_warnings else ("id", "ok", "warnings")
    return {k: v for k, v in reply.items() if k not in drop}


# The factories a user may pass uncalled (sampler=ds.Prioritized).
_FACTORIES = {
    "Uniform": "Uniform()", "Prioritized": "Prioritized(alpha=0.6)", "Fifo": "Fifo()",
    "Lifo": "Lifo()", "MinHeap": "MinHeap()", "MaxHeap": "MaxHeap()",
    "MinSize": "MinSize(1)", "Queue": "Queue(size)",
    "SampleToInsertRatio": "SampleToInsertRatio(samples_per_insert=..., "
                           "min_size_to_sample=..., error_buffer=...)",
}


def _refuse_uncalled(role: str, value: Any) -> None:
    """A factory passed instead of what it makes (sampler=ds.Prioritized): say
    to call it, instead of failing on the function's repr."""
    if value is None or isinstance(value, (Selector, RateLimiter, str, dict)):
        return
    name = getattr(value, "__name__", None)
    if callable(value) and (getattr(_selectors, str(name), None) is value
                            or getattr(_rate_limiters, str(name), None) is value):
        raise ConfigError(f"{role}=ds.{name} is the function, not a {role}: call it, "
                          f"e.g. {role}=ds.{_FACTORIES.get(name, name + '(...)')}")
    raise ConfigError(f"{role} must be made by one of ds.{', ds.'.join(_FACTORIES)} "
                      f"(called), got {value!r}")
