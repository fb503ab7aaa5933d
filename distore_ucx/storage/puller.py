"""The storage node's pull thread: how writers' batches are read into slots.

One thread reads insert batches into their slots, one after another, off
the event loop (a small batch from a mapped staging buffer is copied on the
loop instead), and between pulls progresses the reader worker, which only
that thread touches. Beside it: the helper threads for large same-host
copies, the writers' staging buffers (storage/pulls.py `Sources`) and,
where writers send inserts as UCX active messages, the inbox that receives
them and its listener, which writers connect to. The helpers and the
sources are made on first use, the thread too unless the inbox starts it:
then the event loop watches the reader worker's event fd and has the pull
thread progress the worker whenever it has events (a writer connecting
between pulls), so that nothing polls while the node is idle. While pulls
that progress the worker themselves are under way or queued, its events
need no tick of their own: the fd is watched again once they are done
(a tick per few batches cost the loop and the pull thread a hand-off
each). `close`
ends the inbox and then the thread, before the node's UCX runtime closes.
Thread safety: used from the node's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .._native_loader import _native
from ..config import am_insert_runs_enabled
from ..errors import ConnectionFailed, DistoreError, from_native
from ..protocol import AM_INSERT_ID
from ..transport.capabilities import query
from .pulls import Sources, am_inserts

log = logging.getLogger(__name__)

PULL_TIMEOUT = 30.0  # s for reading one insert batch from a writer
# Insert messages no descriptor claimed within this long are released.
AM_MESSAGE_TTL = 2 * PULL_TIMEOUT
# Threads besides the copying one for same-host batch copies, on hosts with
# at least HELPER_MIN_CORES cores for this process (copy_helpers()).
COPY_HELPERS = 1
HELPER_MIN_CORES = 4
# Same-host batches up to this size are copied on the event loop (a few ms
# at most); larger ones on the pull thread, so that the loop is never held long.
INLINE_COPY_BYTES = 16 << 20
# Progress calls per tick before the reader worker is watched again even if
# it could not be armed (more work came), after a pause so that a worker
# that never arms cannot keep a core busy.
MAX_PROGRESS_PER_TICK = 64
UNARMED_PAUSE = 0.005  # s


class Puller:
    """Reads writers' insert batches into a node's slots (see the module).

    >>> puller = Puller(runtime, "node a")
    >>> puller.start_am_inbox("10.0.0.5", key)  # from the event loop
    >>> if not puller.pulled_here(arena, source, offsets, keys, gens, src_offsets, lengths):
    ...     await puller.pull(arena, source, offsets, keys, gens, src_offsets, lengths)
    >>> await puller.close()
    """

    def __init__(self, runtime, name: str):
        self.runtime = runtime
        self.name = name
        self.am_inbox = None  # writers' inserts by UCX active message (storage/pulls.py)
        self.insert_port = 0  # the inbox's listener's port (0: none)
        # The largest run of items one insert message may carry (0: one item
        # a message; native/am_insert.h).
        self.insert_run_bytes = 0
        self._loop = None  # the event loop watching the reader worker's event fd
        self._reader_fd = -1
        self._thread: ThreadPoolExecutor | None = None  # the pull thread
        self._helpers = copy_helpers()  # threads the same-host copy pool gets (0: no pool)
        self._copy_helpers = None  # _native.CopyPool for large same-host copies
        self._sources: Sources | None = None
        self._tick: Future | None = None  # the reader worker's progress between pulls
        # Pulls handed to the pull thread that progress the reader worker
        # (by message or by gets), and whether its event fd fired meanwhile
        # (then unwatched until they are done).
        self._progressing = 0
        self._unwatched = False
        self._closed = False

    def start_am_inbox(self, host: str, key: bytes) -> None:
        """Take writers' inserts as UCX active messages on the reader worker,
        where UCX emulates RMA in software (storage/pulls.py says why): the
        inbox listens on `host` (the address the node's RPC server binds and
        advertises), on any free port, `insert_port` once listening. Call it
        from the node's event loop, which from then on has the pull thread
        progress the reader worker whenever it has events. Where it cannot
        listen, writers' batches are read with one-sided gets (logged).
        `key` (the node's, 16 bytes): only connections that prove the
        capability the control plane derives from it may send (native/am_insert.h)."""
        why_not = am_inserts(query(self.runtime.context).rdma)
        if not why_not and not self.runtime.peer_failure_detection:
            why_not = (f"UCX_TLS={self.runtime.transports} has no transport with "
                       "peer-failure handling, which writers' connections need")
        if why_not:
            log.info("node %s: writers' batches are read with one-sided gets (%s)", self.name,
                     why_not)
            return
        worker = self.runtime.reader_worker
        inbox = _native.AmInbox(worker, AM_INSERT_ID)
        try:
            port = inbox.listen(host, 0, key=key)
        except DistoreError as exc:
            inbox.close()
            log.warning("node %s: cannot listen for writers' insert messages on %s (%s); "
                        "writers' batches are read with one-sided gets", self.name,
                        host or "every address", exc)
            return
        self.am_inbox, self.insert_port = inbox, port
        self.insert_run_bytes = _native.AmInbox.run_bytes if am_insert_runs_enabled() else 0
        # Connection set-ups are handled only while the worker is progressed:
        # wake on its event fd (armed after each tick) rather than poll it.
        worker.init_blocking_progress_mode()
        self._reader_fd = worker.epoll_file_descriptor
        self._loop = asyncio.get_running_loop()
        self._pull_thread()
        self._loop.add_reader(self._reader_fd, self._on_reader_event)
        log.info("node %s: writers' batches come as UCX active messages (rendezvous "
                 "scheme %s) over connections to %s:%d, received straight into slots",
                 self.name, self.runtime.config.get("RNDV_SCHEME") or "UCX's default",
                 host or "*", port)

    def sources(self) -> Sources:
        """Writers' staging buffers this node reads (storage/pulls.py), made on
        first use."""
        if self._sources is None:
            self._sources = Sources(self.runtime, self.name)
        return self._sources

    async def pull(self, arena, source, offsets, keys, gens, src_offsets, lengths,
                   token: int | None = None) -> None:
        """Read a batch that `pulled_here` did not take into its slots of
        `arena` on the pull thread (the event loop keeps serving); raise if
        any item could not be read."""
        loop = asyncio.get_running_loop()
        progresses = source.mapping is None  # the pull progresses the reader worker
        if token:
            job = loop.run_in_executor(self._pull_thread(), arena.pull_am, self.am_inbox, token,
                                       offsets, keys, gens, lengths, PULL_TIMEOUT)
        elif source.mapping is not None:
            job = loop.run_in_executor(self._pull_thread(), arena.pull_mapped, source, offsets,
                                       keys, gens, src_offsets, lengths, self._copy_pool())
        else:
            job = loop.run_in_executor(self._pull_thread(), arena.pull, source, offsets, keys,
                                       gens, np.uint64(source.base) + src_offsets, lengths,
                                       PULL_TIMEOUT)
        self._progressing += progresses
        try:
            statuses = await asyncio.shield(job)
        except asyncio.CancelledError:
            # The slots are freed by the caller: never while the thread writes them.
            await asyncio.wait([job])
            raise
        finally:
            self._pulled(progresses)
        bad = np.flatnonzero(statuses)
        if bad.size:
            status = int(statuses[bad[0]])
            raise from_native(
                status, _native.status_name(status),
                f"storage node {self.name} could not read {bad.size} of {len(statuses)} "
                f"items from {source.name} (via {source.via}); none of the batch was stored",
                source.name,
            )

    def pulled_here(self, arena, source, offsets, keys, gens, src_offsets, lengths,
                    nbytes: int | None = None) -> bool:
        """Copy a same-host batch of at most INLINE_COPY_BYTES (`nbytes`, if
        the caller knows it) out of its writer's mapped staging now, on the
        event loop (True); False for any other batch, which `pull` reads on
        the pull thread."""
        if source.mapping is None:
            return False
        if (int(lengths.sum()) if nbytes is None else nbytes) > INLINE_COPY_BYTES:
            return False
        # A copy out of a mapping cannot wait on anyone: done here, it saves
        # two thread hand-offs per batch, which cost the node CPU per GB on
        # small items.
        arena.pull_mapped(source, offsets, keys, gens, src_offsets, lengths, self._copy_pool())
        return True

    def _pulled(self, progressed: bool) -> None:
        """A pull handed to the pull thread ended; the last of those that
        progressed the reader worker has its event fd watched again if it
        fired meanwhile (after a tick that arms the worker)."""
        self._progressing -= progressed
        if self._unwatched and not self._progressing:
            self._unwatched = False
            self._tick_armed()

    def progress_between_pulls(self) -> None:
        """Have the pull thread, once there is one, handle writers' connection
        set-ups and closes that arrived between pulls on the reader worker
        (one at a time: none piles up behind a pull that waits)."""
        if self._thread is not None and not self._closed and (
                self._tick is None or self._tick.done()):
            self._tick = self._thread.submit(self._progress_reader)

    def _on_reader_event(self) -> None:
        # The event fd stays readable until the worker is progressed and
        # armed again: stop watching it until the tick has done both, or,
        # while pulls progress the worker anyway, until they are done.
        self._loop.remove_reader(self._reader_fd)
        if self._progressing:
            self._unwatched = True
            return
        self._tick_armed()

    def _tick_armed(self) -> None:
        """Have the pull thread progress the reader worker until it can be
        armed, then watch its event fd again (on the loop)."""
        if self._closed or self._thread is None:
            return
        try:
            tick = self._thread.submit(self._progress_reader, True)
        except RuntimeError:  # the thread is shutting down
            return
        tick.add_done_callback(self._tick_done)

    def _tick_done(self, tick) -> None:  # on the pull thread
        armed = not tick.cancelled() and tick.exception() is None and tick.result()
        try:
            if armed:
                self._loop.call_soon_threadsafe(self._watch_reader)
            else:
                self._loop.call_soon_threadsafe(self._loop.call_later, UNARMED_PAUSE,
                                                self._watch_reader)
        except RuntimeError:  # the loop has closed: the node is gone
            pass

    def _watch_reader(self) -> None:
        if not self._closed and self.am_inbox is not None:
            self._loop.add_reader(self._reader_fd, self._on_reader_event)

    async def close(self) -> None:
        """End the inbox (a pull under way fails; the writer resends), then
        the pull thread, after the pulls already handed to it: both before
        the node's UCX runtime closes. Later pulls raise ConnectionFailed."""
        self._closed = True
        loop = asyncio.get_running_loop()
        if self._reader_fd >= 0:
            self._loop.remove_reader(self._reader_fd)
            self._reader_fd = -1
        if self.am_inbox is not None:
            inbox, self.am_inbox = self.am_inbox, None
            await loop.run_in_executor(None, inbox.close)
        if self._thread is not None:
            await loop.run_in_executor(None, self._thread.shutdown)
        self._copy_helpers = None

    def _pull_thread(self) -> ThreadPoolExecutor:
        # One thread: pulls of one node run one after another, off the loop.
        if self._closed:
            raise ConnectionFailed(f"storage node {self.name} is shutting down")
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="pull")
        return self._thread

    def _copy_pool(self):
        """Helper threads for large same-host batch copies (made on first
        use); None where the copying thread works alone (copy_helpers())."""
        if self._copy_helpers is None and self._helpers:
            self._copy_helpers = _native.CopyPool(self._helpers)
        return self._copy_helpers

    def _progress_reader(self, arm: bool = False) -> bool:
        """The reader tick, on the pull thread: progress the reader worker
        (`arm`: until it can be armed, so that its event fd wakes the loop
        when more comes), then release old insert messages. Returns whether
        the worker was armed."""
        armed = False
        try:
            if arm:
                worker = self.runtime.reader_worker
                for _ in range(MAX_PROGRESS_PER_TICK):
                    worker.progress()
                    if worker.arm():
                        armed = True
                        break
            else:
                self.runtime.progress_reader()
            if self.am_inbox is not None:
                # Messages of batches whose descriptor never came (the writer
                # died between the two) go back to their senders.
                expired = self.am_inbox.expire(AM_MESSAGE_TTL)
                if expired:
                    log.warning("node %s: released %d insert messages that no descriptor "
                                "claimed within %g s", self.name, expired, AM_MESSAGE_TTL)
        except Exception as exc:  # the next pull reports a broken endpoint itself
            log.debug("node %s: progressing the reader worker: %s", self.name, exc)
        return armed


def copy_helpers(cores: int | None = None) -> int:
    """Helper threads a node's same-host batch copies use: COPY_HELPERS where
    this process may run on HELPER_MIN_CORES cores or more (`cores`, by
    default its CPU affinity), none on fewer. A writer on the node's host
    copies into its staging buffer while the node copies the batch before
    out of it: on 2 cores that pipeline holds both, and a helper only takes
    the writer's core (perf/insert_bandwidth.py, 3 MB items, 6 alternated
    pairs: 11.6 -> 12.6 GB/s one per call, 13.2 -> 13.9 32 per call)."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            cores = os.cpu_count() or 1
    return COPY_HELPERS if cores >= HELPER_MIN_CORES else 0
