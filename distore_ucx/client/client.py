"""The entry point of the client API: `connect(address)` -> Client."""

from __future__ import annotations

import threading
from typing import Any

from ..control.rate_limiters import RateLimiter
from ..control.selectors import Selector
from ..config import read_token
from ..errors import ConfigError
from ..spec import TableSpec
from ..transport import rpc


def connect(address: str, timeout: float = 30.0, token_file: str | None = None) -> "Client":
    """Connect to a control plane at 'host:port'.

    `token_file` (default: $DISTORE_TOKEN_FILE) holds the store's shared
    secret when it requires one.
    >>> client = ds.connect("127.0.0.1:7700")
    """
    return Client(address, timeout, token_file)


class Client:
    """A session with one control plane: tables, writers, learners.

    Thread safe. Writers and learners it makes have their own connections;
    close the client (or use it as a context manager) to close them all.
    When the control plane restarts, requests wait for it (up to `timeout`
    s) and go on over a new connection.
    """

    def __init__(self, address: str, timeout: float = 30.0, token_file: str | None = None):
        self.address = address
        self.timeout = timeout
        self.token = read_token(token_file)
        # Control-plane connections come back by themselves after a restart.
        self._rpc = rpc.Client(address, timeout, token=self.token, reconnect=timeout)
        self._lock = threading.Lock()
        self._runtime = None
        self._children: list[Any] = []
        self._specs: dict[str, TableSpec] = {}

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
    ) -> dict:
        """Create a table (idempotent for identical definitions); returns its info.

        `spec` is {field: (shape, dtype), ...} or one (shape, dtype).
        `sampler` (default ds.Uniform()) picks what a sample returns,
        `remover` (default ds.Fifo()) what leaves at capacity; `rate_limiter`
        (default ds.MinSize(1)) decides when inserts and samples wait; an item
        leaves after its `max_times_sampled`-th sample (0: never).

        >>> client.create_table("replay", capacity=10_000,
        ...                     spec={"obs": ((4, 84, 84), "uint8"), "reward": ((), "float32")},
        ...                     sampler=ds.Prioritized(0.6), remover=ds.Fifo())
        """
        parsed = TableSpec.parse(spec)
        if not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"capacity must be a positive integer, got {capacity!r}")
        if not isinstance(max_times_sampled, int) or max_times_sampled < 0:
            raise ConfigError(f"max_times_sampled must be an integer >= 0, got {max_times_sampled!r}")
        fields: dict[str, Any] = {"max_times_sampled": max_times_sampled}
        if sampler is not None:
            fields["sampler"] = Selector.from_wire(sampler, "sampler").to_wire()
        if remover is not None:
            fields["remover"] = Selector.from_wire(remover, "remover").to_wire()
        if rate_limiter is not None:
            if not isinstance(rate_limiter, RateLimiter):
                raise ConfigError("rate_limiter must be ds.MinSize, ds.SampleToInsertRatio or ds.Queue")
            fields["rate_limiter"] = rate_limiter.to_wire()
        info = self.call(
            "create_table", name=name, capacity=capacity, spec=parsed.to_wire(), **fields
        )
        self._specs[name] = parsed
        return _strip(info)

    def table_info(self, name: str) -> dict:
        """Size, capacity, counts (inserts, samples, deletes), spec of a table."""
        return _strip(self.call("table_info", name=name))

    def tables(self) -> list[dict]:
        """Info of every table."""
        return self.call("list_tables")["tables"]

    def nodes(self) -> list[dict]:
        """Live storage nodes with their UCX address and remote key."""
        return self.call("nodes")["nodes"]

    def status(self) -> dict:
        """Nodes (alive or not, memory used), tables and outstanding leases."""
        return _strip(self.call("status"))

    def checkpoint(self) -> dict:
        """Make the control plane write its checkpoint now (it must have been
        started with --checkpoint PATH); returns path, items, bytes, seconds.

        Raises CheckpointError when it has no checkpoint file or cannot write it.
        """
        return _strip(self.call("checkpoint"))

    def spec(self, table: str) -> TableSpec:
        """The layout of a table's items (cached)."""
        spec = self._specs.get(table)
        if spec is None:
            spec = TableSpec.from_wire(self.table_info(table)["spec"])
            self._specs[table] = spec
        return spec

    # -- writers and learners ---------------------------------------------
    def writer(self, **options: Any):
        """A Writer for inserting items; see Writer for options."""
        from .writer import Writer

        w = Writer(self, **options)
        self._children.append(w)
        return w

    def learner(self, table: str, batch_size: int, device: str = "cpu", **options: Any):
        """A Learner sampling `batch_size` items of `table` into `device` memory."""
        from .learner import Learner

        learner = Learner(self, table, batch_size, device=device, **options)
        self._children.append(learner)
        return learner

    @property
    def runtime(self):
        """This client's UCX runtime, made on first use (learners need it)."""
        with self._lock:
            if self._runtime is None:
                from ..transport import UcxRuntime

                self._runtime = UcxRuntime()
            return self._runtime

    def call(self, op: str, **fields: Any) -> dict:
        """One request to the control plane (low level)."""
        return self._rpc.call(op, **fields)

    def connection(self) -> rpc.Client:
        """A new, separate connection to the control plane (it reconnects by itself)."""
        return rpc.Client(self.address, self.timeout, token=self.token, reconnect=self.timeout)

    def close(self) -> None:
        """Close writers (flushing them), learners, the UCX runtime, the connection."""
        children, self._children = self._children, []
        first_error = None
        for child in reversed(children):
            try:
                child.close()
            except Exception as exc:  # close everything, then report
                first_error = first_error or exc
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None
        self._rpc.close()
        if first_error is not None:
            raise first_error

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _strip(reply: dict) -> dict:
    return {k: v for k, v in reply.items() if k not in ("id", "ok")}
