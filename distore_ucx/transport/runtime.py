"""One UCX runtime per process: ucxx context and worker, endpoints, regions.

ucxx (the maintained successor of ucx-py) creates the context and a
``UCS_THREAD_MODE_MULTI`` worker with RMA and WAKEUP enabled, and runs the
worker's progress thread in event mode (epoll on the worker's event fd): an
idle process uses no core, and over TCP, where UCX emulates RMA with active
messages, a storage node keeps serving reads. The native gather progresses
the same worker from the caller's thread while it waits.

One-sided reads go through a second worker, the *reader* worker
(`reader_worker`, endpoints with `endpoint(..., reader=True)`), which has no
progress thread: only the threads that read progress it (a storage node's
pull thread, reading writers' staged batches; a learner's gathers from
nodes it does not map). Over TCP, where every get is emulated with
messages, sharing the first worker meant two threads taking its lock and
waking on its sockets for each batch, which cost both CPU per GB and
bandwidth (docs/performance.md has the current figures). `progress_reader()`
handles whatever peers sent while nobody read (a node calls it from its
pull thread between batches).

Endpoints are our own (`_native.Endpoint`, made with UCX's C API on ucxx's
worker), not ucxx's: a read from a hung peer can only be ended by
force-closing its endpoint (UCP_EP_CLOSE_FLAG_FORCE), which the native
gather does, and ucxx would later close such an endpoint a second time.
Endpoints to a storage node's insert listener (`listener_endpoint`) are
made through the listener instead of from a worker address: those keep
zero-copy rendezvous with peer-failure handling over TCP
(native/am_connections.h). Each is authenticated once, when made, with the
node's connection capability (a node descriptor's `am_cap`, from the
control plane): the node serves nothing on a connection until then.

Teardown order is the reverse of creation and is enforced by ownership:
remote keys hold their endpoint, endpoints hold the worker, regions hold
the context and the workers (`region_owner`), endpoints are closed before
the worker's progress thread stops. Regions hold the workers because UCX
finishes a rendezvous send that failed while its peer held the sender's
memory (the peer died, or the endpoint closed under it) only when that
memory is unmapped, on the sending worker: a worker destroyed first meant
a crash or a hang in whatever later freed the region (a staging buffer
kept by an exception's traceback, freed by the garbage collector).
"""

from __future__ import annotations

import atexit
import logging
import secrets
import threading

from .._native_loader import _native
from ..errors import AuthenticationFailed, ConnectionFailed, DistoreError
from ..protocol import AM_INSERT_AUTH_ID, AM_SAMPLE_DATA_ID, AM_SAMPLE_REQUEST_ID
from . import at_exit
from .same_host import host_id
from .ucx_tls import allows_shared_memory, shared_memory_only, without_direct_writes

log = logging.getLogger(__name__)

# Loaded after libucx: ucxx sets UCX_RNDV_THRESH and friends in os.environ
# at import time, so import it once, here, before any context exists.
import ucxx._lib.libucxx as _ucxx  # noqa: E402

# Registered after ucxx's own exit handlers, so it runs before them: what is
# still open is closed while ucxx can still close it (transport/at_exit.py).
atexit.register(at_exit.close_all)


class RegionOwner:
    """What every memory region of a runtime holds on to (the `context`
    argument of `_native.MemoryRegion`): the UCX context, whose `handle` it
    passes on, and every worker made on it, so that no worker is destroyed
    before the last region is unmapped (see the module's docstring).

    Regions are native objects the garbage collector does not track, so what
    they hold is never torn apart in a cycle: a runtime collected with its
    writer still leaves these workers to the regions."""

    __slots__ = ("context", "handle", "workers")

    def __init__(self, context, worker):
        self.context = context
        self.handle = context.handle
        self.workers = [worker]


class UcxRuntime:
    """The process's UCX context and worker, with an event-driven progress thread.

    >>> with UcxRuntime() as rt:
    ...     region = rt.map_region(1 << 20, remote_read=True)
    """

    def __init__(self, progress_thread: bool = True, config: dict[str, str] | None = None,
                 env_tls: str | None = None):
        """`config`: UCX options without the UCX_ prefix (e.g. {"TLS": "tcp"}),
        overriding the environment for this runtime only. `env_tls`: UCX_TLS
        as the environment sets it (config.ucx_tls(); UCX reads it itself),
        which `transports` reports where `config` sets no TLS; None: unset."""
        self._env_tls = "all" if env_tls is None else env_tls
        self._lock = threading.Lock()
        # (reader lane?, worker address) -> endpoint
        self._endpoints: dict[tuple[bool, bytes], object] = {}
        # (host, port) of a UCX listener (a node's insert listener) -> endpoint
        self._listener_endpoints: dict[tuple[str, int], object] = {}
        self._reader = None  # the reader worker, made on first use
        self._am_client = None  # samples by active message on it (am_sample_client)
        # worker -> its _native.AmAuthClient (listener connections' authentication)
        self._auth_clients: dict[int, object] = {}
        self._config = dict(config or {})
        self.context = _ucxx.UCXContext(
            config_dict=self._config,
            feature_flags=(
                _ucxx.Feature.TAG,
                _ucxx.Feature.WAKEUP,
                _ucxx.Feature.AM,
                _ucxx.Feature.RMA,
            )
        )
        self.worker = _ucxx.UCXWorker(self.context)
        # Pass this, not the context, to every MemoryRegion of this runtime.
        self.region_owner = RegionOwner(self.context, self.worker)
        self._progress = progress_thread
        if progress_thread:
            # polling_mode=False: the thread sleeps in epoll until UCX has work.
            self.worker.start_progress_thread(polling_mode=False)
        self._closed = False
        at_exit.track(self)  # closed at interpreter exit if nobody did
        self._error_handling = not shared_memory_only(self.transports)
        log.debug("UCX %s runtime started (tls=%s)", _native.ucx_version(), self.transports)

    @property
    def config(self) -> dict[str, str]:
        """The UCX options this runtime set over the environment (no UCX_ prefix)."""
        return dict(self._config)

    @property
    def transports(self) -> str:
        """The transports UCX was allowed to use (UCX_TLS), 'all' when unset."""
        return self._config.get("TLS") or self._env_tls

    @property
    def shared_memory(self) -> bool:
        """Whether UCX may use shared-memory transports (UCX_TLS allows them)."""
        return allows_shared_memory(self.transports)

    @property
    def peer_failure_detection(self) -> bool:
        """Whether UCX turns a dead peer into an error (False under shared memory
        only, where UCX aborts the process on a read from a dead peer)."""
        return self._error_handling

    @property
    def address(self) -> bytes:
        """This worker's UCX address, which peers use to make endpoints."""
        addr = self.worker.address
        return bytes(addr)

    def map_region(self, size: int, remote_read: bool = False, hugepages: bool = False):
        """Allocate and register `size` bytes (page aligned) with this context."""
        return _native.MemoryRegion(self.region_owner, size, remote_read, hugepages)

    @property
    def reader_worker(self):
        """A second worker on this context with no progress thread, for
        blocking one-sided reads (a storage node's pull thread, learners'
        gathers): only the threads reading progress it, so a read takes no
        lock a progress thread holds and wakes no other thread. It is
        thread safe (UCS_THREAD_MODE_MULTI, as ucxx makes every worker).
        Made on first use."""
        reader = self._reader  # read on every UCX gather: no lock once made
        if reader is not None:
            return reader
        with self._lock:
            if self._closed:
                raise ConnectionFailed("the UCX runtime is closed")
            if self._reader is None:
                self._reader = _ucxx.UCXWorker(self.context)
                self.region_owner.workers.append(self._reader)
            return self._reader

    def am_sample_client(self):
        """This process's `_native.AmSampleClient` on the reader worker, made on
        first use: learners' batches from nodes that serve samples by active
        message (storage/sample_server.py). One per worker, shared by every
        learner of the process: a second would take over the worker's handler
        of the data messages. Closed with the runtime, before its endpoints."""
        client = self._am_client
        if client is not None:
            return client
        worker = self.reader_worker
        with self._lock:
            if self._closed:
                raise ConnectionFailed("the UCX runtime is closed")
            if self._am_client is None:
                self._am_client = _native.AmSampleClient(
                    worker, request_id=AM_SAMPLE_REQUEST_ID, data_id=AM_SAMPLE_DATA_ID,
                    client_id=secrets.randbits(63))
            return self._am_client

    def progress_reader(self) -> None:
        """Progress the reader worker once, if there is one: call it from the
        thread that reads through it, between reads, so that what peers sent
        meanwhile (connection set-up, closes) is handled."""
        reader = self._reader
        if reader is not None and not self._closed:
            reader.progress()

    def endpoint(self, worker_address: bytes, peer: str, detect_failures: bool = True,
                 reader: bool = False):
        """The endpoint to a peer's worker, made once and reused.

        `detect_failures` asks UCX for peer-failure handling, so that reads
        from a dead peer fail instead of hang. UCX then leaves out the
        shared-memory transports, which cannot detect failures: for a peer
        on the same host pass False (and check its process yourself, see
        `same_host.ProcessWatch`) to read through shared memory (CMA).
        `reader`: the endpoint is on `reader_worker`, for reads made by the
        threads that progress it.
        """
        worker = self.reader_worker if reader else self.worker
        with self._lock:
            ep = self._endpoints.get((reader, worker_address))
            if ep is not None and ep.alive:
                return ep
            try:
                ep = self._create_endpoint(worker, worker_address, peer, detect_failures)
            except Exception as exc:  # UcxError, or UCX refusing the address
                raise ConnectionFailed(
                    f"cannot create a UCX endpoint to {peer}: {exc}. Check that the peer "
                    f"is running and that UCX_TLS ({self.transports}) lets both reach each other"
                ) from exc
            self._endpoints[(reader, worker_address)] = ep
            return ep

    def _create_endpoint(self, worker, worker_address: bytes, peer: str, detect_failures: bool):
        # Peer-failure detection (UCP_ERR_HANDLING_MODE_PEER) is not supported
        # by the shared-memory transports: fall back to plain endpoints when
        # they are all UCX has.
        if detect_failures and self._error_handling:
            try:
                return _native.Endpoint(worker, worker_address, True, peer)
            except DistoreError as exc:  # UCX refused (no transport detects failures)
                log.info(
                    "UCX cannot detect peer failures with UCX_TLS=%s (%s); using endpoints "
                    "without error handling",
                    self.transports,
                    exc,
                )
                self._error_handling = False
        return _native.Endpoint(worker, worker_address, False, peer)

    def listener_endpoint(self, host: str, port: int, peer: str, timeout: float = 5.0,
                          reader: bool = False, cap: bytes | None = None,
                          auth_id: int = AM_INSERT_AUTH_ID):
        """The endpoint to the UCX listener at `host`:`port` (a storage node's
        insert listener, `_native.AmInbox.listen`, or its sample listener,
        `_native.AmSampleServer.listen`), made once and reused while it
        lives. It always has peer-failure handling: made through a listener,
        UCX still sends rendezvous messages zero-copy on it over TCP
        (native/am_connections.h). A new one is returned only once its
        connection is made (within `timeout` s; ConnectionFailed if not, e.g.
        a firewall that lets the node's RPC port through but not this one),
        so that a batch is never posted to a listener that cannot be reached.
        `reader`: on `reader_worker` (a learner's sample fetches progress it).
        `cap`: the node's connection capability (its descriptor's `am_cap`),
        proved as message `auth_id` (AM_INSERT_AUTH_ID or AM_SAMPLE_AUTH_ID)
        before the endpoint is returned (AuthenticationFailed if the node
        refuses it); None: the listener asks for none (tests)."""
        with self._lock:
            if self._closed:
                raise ConnectionFailed("the UCX runtime is closed")
            ep = self._listener_endpoints.get((host, port))
            if ep is not None and ep.alive:
                return ep
        try:
            worker = self.reader_worker if reader else self.worker
            ep = _native.Endpoint.to_listener(worker, host, port, peer)
        except DistoreError as exc:
            raise ConnectionFailed(
                f"cannot connect to the UCX listener of {peer} at {host}:{port}: {exc}"
            ) from exc
        status = ep.flush(timeout)
        if status != 0:
            _close_endpoint(ep)
            raise ConnectionFailed(
                f"cannot connect to the UCX listener of {peer} at {host}:{port} "
                f"({_native.status_name(status)} within {timeout:g} s): check that this "
                "port of that host is reachable from here, as its RPC port is")
        if cap is not None:
            self._authenticate(worker, ep, f"{peer} at {host}:{port}", cap, auth_id, timeout)
        with self._lock:
            if self._closed:
                _close_endpoint(ep)
                raise ConnectionFailed("the UCX runtime is closed")
            old = self._listener_endpoints.get((host, port))
            if old is not None and old.alive:  # another thread made one meanwhile
                _close_endpoint(ep)
                return old
            self._listener_endpoints[(host, port)] = ep
            return ep

    def _authenticate(self, worker, ep, where: str, cap: bytes, auth_id: int,
                      timeout: float) -> None:
        """Prove `cap` on a new listener endpoint `ep` (of `worker`); closes
        it and raises if the listener (of `where`) does not accept it."""
        status = self._auth_client(worker).authenticate(ep, auth_id, cap, timeout)
        if status == 0:
            return
        _close_endpoint(ep)
        what = _native.status_name(status)
        if status == _native.STATUS_REJECTED:
            raise AuthenticationFailed(
                f"the UCX listener of {where} refused our connection capability ({what}): "
                "is this client's control plane that node's?")
        raise ConnectionFailed(f"the UCX listener of {where} did not accept our connection "
                               f"({what} within {timeout:g} s)")

    def _auth_client(self, worker):
        """The AmAuthClient of `worker` (one of this runtime's), made on first use."""
        with self._lock:
            if self._closed:
                raise ConnectionFailed("the UCX runtime is closed")
            client = self._auth_clients.get(id(worker))
            if client is None:
                client = self._auth_clients[id(worker)] = _native.AmAuthClient(worker)
            return client

    def drop_listener_endpoint(self, host: str, port: int) -> None:
        """Forget (and close) the endpoint to the listener at `host`:`port`."""
        with self._lock:
            ep = self._listener_endpoints.pop((host, port), None)
        if ep is not None:
            _close_endpoint(ep)

    def drop_endpoint(self, worker_address: bytes) -> None:
        """Forget (and close) the endpoints, on either worker, to a peer that went away."""
        with self._lock:
            eps = [self._endpoints.pop((lane, worker_address), None) for lane in (False, True)]
        for ep in eps:
            if ep is not None:
                _close_endpoint(ep)

    def close(self) -> None:
        """Close endpoints, stop progress; the context goes when unreferenced."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            am_client, self._am_client = self._am_client, None
            auth_clients, self._auth_clients = list(self._auth_clients.values()), {}
            eps = list(self._endpoints.values()) + list(self._listener_endpoints.values())
            self._endpoints.clear()
            self._listener_endpoints.clear()
        if am_client is not None:  # its fetches use the endpoints
            am_client.close()
        for client in auth_clients:
            client.close()
        for ep in eps:
            _close_endpoint(ep)
        self._reader = None  # destroyed once its endpoints (closed above) and regions let it go
        if self._progress:
            self.worker.stop_progress_thread()

    def __enter__(self) -> UcxRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_endpoint(ep) -> None:
    # A live endpoint is closed with a flush, which tells the peer: a forced
    # close leaves the peer's side of the connection broken, and UCX matches
    # a later endpoint between the same two workers to it (its reads then
    # hang). A failed one is forced where UCX allows it (error handling); a
    # closed endpoint ignores a second close.
    try:
        ep.close(force=ep.error_handling and not ep.alive, timeout=1.0)
    except Exception as exc:  # a dead peer's endpoint may refuse a clean close
        log.debug("endpoint close: %s", exc)


# host_id and without_direct_writes live in same_host.py and ucx_tls.py;
# storage/ imports them from here.
__all__ = ["UcxRuntime", "RegionOwner", "host_id", "without_direct_writes"]
