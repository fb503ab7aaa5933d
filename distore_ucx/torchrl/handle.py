"""A TorchRL buffer outside its process: pickling, sharing and its state.

The items of a DistoreReplayBuffer live in the store, so a buffer travels as
a *handle*: its control-plane address, the token file and timeout its client
was made with, its table, the keyword arguments it was built with, and its
own state (write count, largest priority, beta). Pickling gives that handle
(for `spawn`, `forkserver`, torch.multiprocessing queues, `copy.deepcopy`);
the buffer it becomes connects at its first use, with a client and a writer
of its own, which it closes in `close()`. Writers need no lock between
processes: the store orders their inserts. A process that forks keeps its
buffers usable in the child the same way: there, each open buffer turns
into a handle (the parent's connections, copied by the fork, are never used
nor closed in the child; they stay the parent's).

`shared` / `share()` are what TorchRL's multi-process collectors ask about:
a shared buffer's `write_count` counts the items every process sharing it
inserted (the table's insert counter, from where this buffer's own count
was when it was shared), so a collector's `init_random_frames` ends when
the workers together wrote that many, as with TorchRL's shared buffers.
`rb._storage` answers that the storage is initialized: the table is the
store's, so a collector never writes a fake batch into it nor empties it.

`state_dict()` keeps what the buffer itself holds (the table's name, the
constructor's options, `write_count`, the largest priority, `beta`), never
the items: they are the store's, and checkpointing them is the store's job
(`client.checkpoint()`, `distore control --checkpoint`). `dumps(path)`
writes that state as JSON, `loads(path)` reads it back.

`Sharing` is a part of DistoreReplayBuffer (buffer.py); `records_options`
wraps its constructors, so that the handle carries whatever keyword
arguments they take.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Closed, ConfigError, TableNotFound

log = logging.getLogger(__name__)

STATE_FILE = "distore_buffer.json"  # what dumps(path) writes in the folder `path`
_STATE_KEYS = ("write_count", "max_priority", "beta")  # what load_state_dict restores

# Buffers open in this process; a forked child turns them into handles.
_LIVE: weakref.WeakSet = weakref.WeakSet()
# In a forked child: the parent's clients, writers and learners of those
# buffers, held so that they are never collected here (a writer collected
# would flush over the parent's connection).
_INHERITED: list[dict] = []
_OPEN_LOCK = threading.RLock()  # one buffer opens from its handle at a time


@dataclass(frozen=True)
class BufferHandle:
    """What a pickled DistoreReplayBuffer is: enough to make the same buffer
    in another process. `options` are its constructor's keyword arguments;
    `state` its own counters (see Sharing._own_state)."""

    cls: type
    address: str
    table: str
    token_file: str | None
    timeout: float
    options: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    def connect(self, buffer: Any) -> None:
        """Make `buffer` (an instance of `cls` holding this handle) the buffer
        this handle describes: a client of its own (closed by the buffer),
        the constructor's options, then its state."""
        import distore_ucx as ds

        client = ds.connect(self.address, timeout=self.timeout, token_file=self.token_file)
        try:
            self.cls.__init__(buffer, client, self.table, **self.options)
        except BaseException:
            client.close()
            raise
        buffer._owns_client = True  # it made this client: close() closes it
        for name, value in self.state.items():
            setattr(buffer, name, value)


def records_options(init):
    """Decorator of a buffer's __init__(self, client, table, **options):
    remembers the outermost constructor's keyword arguments (a subclass's,
    e.g. alpha=, not what it hands its base) for the buffer's handle, and
    registers the buffer so that a forked child can reopen it."""

    @functools.wraps(init)
    def wrapper(self, client, table, **options):
        outermost = "_init_options" not in self.__dict__
        if outermost:
            self._init_options = dict(options)
        init(self, client, table, **options)
        if outermost:
            _LIVE.add(self)

    return wrapper


def _open(cls: type, handle: BufferHandle) -> Any:
    """Unpickling: a buffer of `cls` that connects at its first use."""
    buffer = cls.__new__(cls)
    buffer.__dict__.update(_pending_handle=handle, _pending_opener=None)
    return buffer


class Sharing:
    """Pickling (to a handle), `shared`/`share()`, `_storage`, `state_dict`,
    `load_state_dict`, `dumps` and `loads` of a DistoreReplayBuffer."""

    # -- pickling -----------------------------------------------------------
    def __reduce__(self):
        """Pickle to a handle (see the module docstring), never to the
        connections themselves."""
        return (_open, (type(self), self._handle()))

    def _handle(self) -> BufferHandle:
        """This buffer as a handle; asks nothing of the store (a forked child
        calls it)."""
        pending = self.__dict__.get("_pending_handle")
        if pending is not None:
            return pending
        if self._closed:
            raise Closed(f"this replay buffer of table {self.table!r} is closed: pickle one "
                         "that is open (or make a new one where it is needed)")
        options = dict(self._init_options)
        if self._fields is not None:  # the table exists: the other side opens it
            options.pop("spec", None)
        token_file = getattr(self._client, "token_file", None)
        return BufferHandle(
            cls=type(self), address=self._client.address, table=self.table,
            token_file=os.path.abspath(token_file) if token_file else None,
            timeout=float(getattr(self._client, "timeout", 30.0)),
            options=options, state=self._own_state())

    def _own_state(self) -> dict[str, Any]:
        """The attributes a handle restores (no request to the store)."""
        return {"_write_count": self._write_count, "_write_base": self._write_base,
                "_max_priority": self._max_priority, "_beta": self._beta,
                "_item_batch": self._item_batch}

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the object lacks: a buffer unpickled
        # (or forked) and not used yet has none; connect it now.
        pending = self.__dict__.get("_pending_handle")
        if (pending is None or name.startswith("__")
                or self.__dict__.get("_pending_opener") == threading.get_ident()):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self._connect_pending()
        return getattr(self, name)

    def _connect_pending(self) -> None:
        """Connect a buffer made from a handle (once, whichever thread asks
        first; the others wait for it)."""
        with _OPEN_LOCK:
            handle = self.__dict__.get("_pending_handle")
            if handle is None:
                return  # another thread connected it meanwhile
            self.__dict__["_pending_opener"] = threading.get_ident()
            try:
                handle.connect(self)
            except BaseException:
                log.warning("a replay buffer of table %r could not connect to the control "
                            "plane at %s in process %d; it tries again at its next use",
                            handle.table, handle.address, os.getpid())
                self.__dict__.clear()
                self.__dict__.update(_pending_handle=handle, _pending_opener=None)
                raise
            del self.__dict__["_pending_handle"], self.__dict__["_pending_opener"]

    def _close_pending(self) -> bool:
        """close() of a buffer that never connected: nothing to close; True
        when that was the case."""
        if self.__dict__.pop("_pending_handle", None) is None:
            return False
        self.__dict__.pop("_pending_opener", None)
        self._closed = True
        return True

    # -- what TorchRL's collectors ask --------------------------------------
    @property
    def shared(self) -> bool:
        """Whether `write_count` counts the inserts of every process sharing
        this buffer (after `share()`, and in a buffer unpickled from a shared
        one). Any buffer can be used from many processes: its items are in
        the store."""
        return self._write_base is not None

    def share(self, shared: bool = True) -> Sharing:
        """Count, from now on, every process's inserts into the table in
        `write_count` (TorchRL's multi-process collectors call it; one request
        to the control plane); `share(False)` counts this buffer's own again.

        Args:
            shared: Count every process's inserts (True) or this buffer's.

        Returns:
            The buffer.
        """
        self._ensure_open()
        if shared and self._write_base is None:
            self._write_base = self._table_inserts() - self._write_count
        elif not shared and self._write_base is not None:
            self._write_count = self.write_count
            self._write_base = None
        return self

    def _shared_write_count(self) -> int:
        """write_count of a shared buffer: inserts into the table since it
        was shared, plus this buffer's own before."""
        return self._table_inserts() - self._write_base

    def _table_inserts(self) -> int:
        try:
            return int(self._client.table_info(self.table)["inserts"])
        except TableNotFound:
            return 0

    @property
    def _storage(self) -> StoreStorage:
        """What TorchRL code reads as `rb._storage` (see StoreStorage)."""
        return StoreStorage(self)

    # -- state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What this buffer keeps apart from its items: the table's name, the
        options it was built with, `write_count`, the largest priority so
        far (the default priority of new items) and `beta`. Not the items:
        they are the store's (checkpoint the store to keep them).

        Returns:
            A dict of "table", "options", "write_count", "max_priority", "beta".

        >>> state = rb.state_dict()
        >>> rb2.load_state_dict(state)    # rb2: a buffer of the same table
        """
        self._ensure_open()
        return {"table": self.table, "options": dict(self._init_options),
                "write_count": self.write_count, "max_priority": self._max_priority,
                "beta": self._beta}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `write_count`, the largest priority and `beta` from
        `state_dict()` of a buffer of the same table. The options in it are
        not applied (a buffer's options are its constructor's: build it with
        `**state_dict["options"]`), and the items are the store's.

        Args:
            state_dict: What `state_dict()` returned.

        Raises:
            ConfigError: A key is missing, the state is another table's, or
                its write count is negative.
        """
        self._ensure_open()
        missing = [k for k in ("table", *_STATE_KEYS) if k not in state_dict]
        if missing:
            raise ConfigError(f"load_state_dict: the state has no {missing} (keys: "
                              f"{sorted(state_dict)}): pass what state_dict() returned")
        if state_dict["table"] != self.table:
            raise ConfigError(
                f"load_state_dict: the state is of table {state_dict['table']!r}, this buffer's "
                f"table is {self.table!r}: load it into a buffer of that table")
        count = int(state_dict["write_count"])
        if count < 0:
            raise ConfigError(f"load_state_dict: write_count must be >= 0, got {count}")
        self._write_count = count
        if self._write_base is not None:
            self._write_base = self._table_inserts() - count
        self._max_priority = float(state_dict["max_priority"])
        self.beta = state_dict["beta"]

    def dumps(self, path: str | os.PathLike) -> None:
        """Write `state_dict()` (less the options: they are the code's) as
        JSON into the folder `path` (made if needed), as TorchRL's
        `dumps(path)` writes its buffer's. The items stay in the store: to
        keep them, checkpoint the store (`client.checkpoint()`).

        Args:
            path: The folder; the file in it is ``distore_buffer.json``.
        """
        state = self.state_dict()
        del state["options"]
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / STATE_FILE).write_text(json.dumps({"class": type(self).__name__, **state},
                                                    indent=1) + "\n")

    def loads(self, path: str | os.PathLike) -> None:
        """Read what `dumps(path)` wrote into this buffer (`load_state_dict`).

        Args:
            path: The folder `dumps` wrote.

        Raises:
            ConfigError: The folder holds no state `dumps` wrote, or it
                cannot be read; or as `load_state_dict`.
        """
        file = Path(path) / STATE_FILE
        try:
            state = json.loads(file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"loads: no {STATE_FILE} in {str(path)!r}: pass the folder a "
                              "distore buffer's dumps(path) wrote (a TorchRL buffer's dump "
                              "holds items; load those with extend())") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"loads: cannot read {str(file)!r}: {exc}") from None
        self.load_state_dict(state)


class StoreStorage:
    """What TorchRL code finds as `rb._storage` of a distore buffer: the
    store, always initialized (a multi-process collector then neither writes
    a fake batch into the table nor empties it); `len()` is the table's."""

    initialized = True

    def __init__(self, buffer: Any):
        """The storage of `buffer`."""
        self._buffer = buffer

    def __len__(self) -> int:
        return len(self._buffer)


def _after_fork_in_child() -> None:
    """In a forked child, every open buffer becomes a handle: the connections
    the fork copied are the parent's (using one here would cross its
    messages with the parent's)."""
    global _OPEN_LOCK
    _OPEN_LOCK = threading.RLock()
    for buffer in list(_LIVE):
        state = buffer.__dict__
        if "_pending_handle" in state or state.get("_closed", True):
            continue
        try:
            handle = buffer._handle()
        except Exception as exc:  # noqa: BLE001  a fork must not fail for a buffer
            log.warning("forked child %d: a replay buffer of table %r cannot be used here: "
                        "%s", os.getpid(), state.get("table"), exc)
            continue
        _INHERITED.append(dict(state))
        state.clear()
        state.update(_pending_handle=handle, _pending_opener=None)


os.register_at_fork(after_in_child=_after_fork_in_child)
