"""The two processes of test_am_insert_kills.py: a receiver that takes insert
messages as a storage node does, and a zygote that forks writers to kill.

    python am_kill_peers.py receiver ITEM_BYTES   # commands on stdin, JSON lines out
    python am_kill_peers.py zygote ITEM_BYTES     # "spawn PORT THEN RUN TOKEN..." -> a writer

The receiver runs the node's pieces, not the node: its UCX runtime with the
remote-write guard installed first (storage/guard.py), an
Arena, an AmInbox on the reader worker listening on 127.0.0.1, and
Arena.pull_am on one pull thread, which also runs the node's reader tick
between pulls (progress, then the inbox's expiry) every 50 ms. Commands (one per line):

    pull TOKEN COUNT TIMEOUT   receive batch TOKEN into COUNT fresh slots; prints
                               {"pulled", "statuses", "bad", "ms"} when it ends
    discard TOKEN COUNT        what the node does when a writer's control
                               connection closes (from the main thread, as the
                               node's event loop does)
    stats                      after the pulls queued before it: inbox, connections,
                               slots in use, late writes seen, RSS
    puts                       at once: how many TCP puts have landed in slots being
                               received into so far (rendezvous data flowing)
    quit                       close everything in order; prints {"closed": true}

Every item that a pull reports received is checked against the bytes its
(token, index) names; the slots of items that failed are filled with a
canary and kept until the next `stats`, which checks that nothing wrote
into them after their pull returned, and frees them.

The zygote imports distore_ucx once and forks a writer per `spawn PORT
THEN RUN TOKEN...` line (fork, not exec: starting Python and UCX for each of
100 writers would take most of the test's time). No UCX context exists in
the zygote; each child makes its own, connects to the receiver's listener
(UcxRuntime.listener_endpoint), posts one batch per token from its own part of a
staging buffer (am_send; RUN > 0: items in runs of up to RUN bytes, as
to a node that takes them, else one a message), prints {"sent", "pid"}, and then (THEN) either
`waits` to be killed or, once its endpoint has failed (the receiver died),
`closes` everything as a writer does and prints {"writer_closed", "status"}.
Not a test module itself.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ITEMS = 8  # per batch


def pattern(token: int, index: int, nbytes: int) -> np.ndarray:
    """The bytes of item `index` of batch `token`."""
    words = np.arange(nbytes // 8, dtype=np.uint64)
    seed = np.uint64((token * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % 2**64)
    return (words * np.uint64(0x94D049BB133111EB) ^ seed).view(np.uint8)


def emit(obj: dict) -> None:
    """One JSON line, written whole (the zygote's children share its stdout)."""
    os.write(1, (json.dumps(obj) + "\n").encode())


def rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def receiver(item_bytes: int) -> None:
    from distore_ucx._native_loader import _native
    from distore_ucx.config import rendezvous_config, ucx_tls
    from distore_ucx.protocol import AM_INSERT_ID
    from distore_ucx.spec import SLOT_HEADER
    from distore_ucx.storage.arena import Arena
    from distore_ucx.storage.guard import guard_remote_access
    from distore_ucx.transport.runtime import UcxRuntime

    guarded = guard_remote_access()  # before the worker exists, as the node does
    runtime = UcxRuntime(config={**rendezvous_config(), **guarded}, env_tls=ucx_tls())
    # Room for the batches in flight and the failed slots kept until the
    # next `stats`; every page touched now, so that RSS shows leaks only.
    arena = Arena(runtime, 32 * ITEMS * (SLOT_HEADER + item_bytes), hugepages=False)
    arena.region.view()[:] = 0
    inbox = _native.AmInbox(runtime.reader_worker, AM_INSERT_ID)
    port = inbox.listen("127.0.0.1", 0)
    view = arena.region.view()
    slot = SLOT_HEADER + item_bytes
    canary = np.full(item_bytes, 0xEE, np.uint8)
    quarantined: list[np.ndarray] = []  # offsets of failed items' slots, canary inside
    pulls = ThreadPoolExecutor(1, thread_name_prefix="pull")
    lock = threading.Lock()  # the arena is used from the pull thread only; emit is shared

    def pull(token: int, count: int, timeout: float) -> None:
        t0 = time.perf_counter()
        offsets = arena.allocate("t", slot, count)
        keys = np.arange(1, count + 1, dtype=np.uint64) + np.uint64(token << 8 & (2**63 - 1))
        gens = arena.next_generations(count)
        lengths = np.full(count, item_bytes, np.uint64)
        statuses = arena.pull_am(inbox, token, offsets, keys, gens, lengths, timeout)
        ms = 1e3 * (time.perf_counter() - t0)
        bad = 0
        failed = []
        for i, off in enumerate(offsets.tolist()):
            payload = view[off + SLOT_HEADER: off + slot]
            if statuses[i] == 0:
                bad += not np.array_equal(payload, pattern(token, i, item_bytes))
            else:
                payload[:] = canary
                failed.append(off)
        ok = offsets[statuses == 0]
        arena.free("t", ok)
        if failed:
            quarantined.append(np.array(failed, np.uint64))
        with lock:
            emit({"pulled": token, "statuses": [int(s) for s in statuses], "bad": bad,
                  "ms": round(ms, 1)})

    def stats() -> None:
        late = 0
        for offs in quarantined:
            for off in offs.tolist():
                late += not np.array_equal(view[off + SLOT_HEADER: off + slot], canary)
            arena.free("t", offs)
        quarantined.clear()
        # The node's reader tick: progress, then old messages and failed connections.
        runtime.progress_reader()
        inbox.expire(0.0)
        with lock:
            emit({"waiting": inbox.waiting, "refused": inbox.refused,
                  "connections": inbox.connections, "used_bytes": arena.used_bytes,
                  "late_writes": late, "rss_kb": rss_kb()})

    def tick() -> None:  # the node's reader tick between pulls (storage/puller.py)
        runtime.progress_reader()
        inbox.expire(60.0)

    done = threading.Event()

    def ticks() -> None:
        pending = None
        while not done.wait(0.05):
            if pending is None or pending.done():
                pending = pulls.submit(tick)

    ticker = threading.Thread(target=ticks)
    ticker.start()
    emit({"port": port})
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "pull":
            pulls.submit(pull, int(args[0]), int(args[1]), float(args[2]))
        elif cmd == "discard":
            inbox.discard(int(args[0]), int(args[1]))
        elif cmd == "stats":
            pulls.submit(stats).result()
        elif cmd == "puts":
            with lock:
                emit({"puts": _native.refused_remote_access()["tcp_puts_accepted"]})
        elif cmd == "quit":
            break
    done.set()
    ticker.join()
    pulls.shutdown(wait=True)
    inbox.close()
    runtime.close()
    emit({"closed": True})  # the rest goes at interpreter exit (its exit status is checked)


def writer(port: int, then: str, run_bytes: int, tokens: list[int], item_bytes: int) -> None:
    """A forked child: connect, post one batch per token, then wait to be
    killed, or close once the receiver is gone."""
    from distore_ucx._native_loader import _native
    from distore_ucx.config import rendezvous_config, ucx_tls
    from distore_ucx.protocol import AM_INSERT_ID
    from distore_ucx.transport.runtime import UcxRuntime

    runtime = UcxRuntime(config=rendezvous_config(), env_tls=ucx_tls())  # as the client's
    region = _native.MemoryRegion.write_protected(runtime.region_owner,
                                                  len(tokens) * ITEMS * item_bytes)
    staging = region.view()
    ep = runtime.listener_endpoint("127.0.0.1", port, "receiver")  # connected when returned
    lengths = np.full(ITEMS, item_bytes, np.uint64)
    for b, token in enumerate(tokens):
        offsets = (np.arange(ITEMS, dtype=np.uint64) + np.uint64(b * ITEMS)) * np.uint64(item_bytes)
        for i, off in enumerate(offsets.tolist()):
            staging[off: off + item_bytes] = pattern(token, i, item_bytes)
        _native.am_send(ep, region, AM_INSERT_ID, token, offsets, lengths, run_bytes)
    emit({"sent": tokens, "pid": os.getpid()})
    while then == "waits" or ep.alive:  # UCX's progress thread sends meanwhile
        time.sleep(0.01)
    # The receiver died with sends pending: the endpoint, the staging buffer
    # and UCX itself close as a writer's do (nothing may crash here).
    status = ep.status
    runtime.drop_listener_endpoint("127.0.0.1", port)
    del staging, ep, region
    runtime.close()
    del runtime
    gc.collect()  # the context goes with its last holder
    emit({"writer_closed": os.getpid(), "status": _native.status_name(status)})


def zygote(item_bytes: int) -> None:
    import distore_ucx._native_loader  # noqa: F401  (libucx loaded, no UCX context made)
    import distore_ucx.transport.runtime  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    emit({"zygote": os.getpid()})
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd != "spawn":
            continue
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                os.close(0)  # the zygote's commands are not the child's
                writer(int(args[0]), args[1], int(args[2]), [int(t) for t in args[3:]],
                       item_bytes)
                os._exit(0)
            finally:
                os._exit(1)


if __name__ == "__main__":
    role, nbytes = sys.argv[1], int(sys.argv[2])
    {"receiver": receiver, "zygote": zygote}[role](nbytes)
