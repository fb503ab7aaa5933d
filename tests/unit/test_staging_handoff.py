"""A same-host writer hands a node its staging buffer's sealed memfd
(transport/local_map.py `send_staging`, storage/pulls.py `Sources.offer`).

The writer sends only to the node's own process (pid check on the socket),
only after proving the token; the node maps only sealed memfds, read-only,
and a ticket is claimed once, by the first connection that names it.
"""

from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import numpy as np
import pytest

from distore_ucx import errors
from distore_ucx._native_loader import _native
from distore_ucx.storage.pulls import Sources
from distore_ucx.transport import UcxRuntime
from distore_ucx.transport.local_map import TICKET_BYTES, LocalMapServer, send_staging

SIZE = 1 << 20


@pytest.fixture
def runtime():
    with UcxRuntime(progress_thread=False, config={"TLS": "tcp"}) as rt:
        yield rt


@pytest.fixture
def staging(runtime):
    r = _native.MemoryRegion.write_protected(runtime.region_owner, SIZE, False)
    r.view()[:] = np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
    return r


@pytest.fixture
def arena(runtime):
    return _native.MemoryRegion.write_protected(runtime.region_owner, SIZE, False)


def serve(arena, sources, token=None):
    return LocalMapServer(arena.share_fd, arena.size, 7, arena.page_kind, token, "test-node",
                          on_staging=sources.offer if sources else None).start()


def peer():
    return SimpleNamespace(state={}, address="127.0.0.1:1")


def descriptor(staging, ticket, size=None):
    return {"staging": ticket, "base": staging.address, "size": size or staging.size}


def test_a_handed_buffer_is_mapped_read_only_and_claimed_once(runtime, staging, arena):
    sources = Sources(runtime, "test-node")
    server = serve(arena, sources)
    ticket = os.urandom(TICKET_BYTES)
    try:
        send_staging(server.name, staging.share_fd, staging.size, ticket, None, os.getpid(),
                     "test-node")
    finally:
        server.close()
    first = peer()
    src = sources.get(first, descriptor(staging, ticket))
    assert src.via == "mapped (same host)" and src.pid == os.getpid()
    got = np.ctypeslib.as_array((ctypes.c_uint8 * SIZE).from_address(src.mapping.address))
    assert np.array_equal(got, staging.view())  # the writer's bytes, through the mapping
    assert sources.get(first, descriptor(staging, ticket)) is src  # cached on the connection
    with pytest.raises(errors.InvalidArgument, match="never handed"):
        sources.get(peer(), descriptor(staging, ticket))  # another connection cannot use it


def test_the_writer_checks_the_socket_belongs_to_the_node(runtime, staging, arena):
    sources = Sources(runtime, "test-node")
    server = serve(arena, sources)
    try:
        with pytest.raises(errors.ConnectionFailed, match="not to the node"):
            send_staging(server.name, staging.share_fd, staging.size,
                         os.urandom(TICKET_BYTES), None, os.getpid() + 1, "test-node")
    finally:
        server.close()
    assert not sources._offered  # nothing was handed


def test_a_wrong_token_or_a_node_without_the_path_is_refused(runtime, staging, arena):
    token = os.urandom(32)
    sources = Sources(runtime, "test-node")
    server = serve(arena, sources, token)
    try:
        for wrong in (None, b"x" * 32):
            with pytest.raises(errors.ConnectionFailed):
                send_staging(server.name, staging.share_fd, staging.size,
                             os.urandom(TICKET_BYTES), wrong, os.getpid(), "test-node")
        send_staging(server.name, staging.share_fd, staging.size, os.urandom(TICKET_BYTES),
                     token, os.getpid(), "test-node")
    finally:
        server.close()
    assert len(sources._offered) == 1  # only the one with the token
    server = serve(arena, None)  # a node that takes no staging buffers
    try:
        with pytest.raises(errors.ConnectionFailed, match="does not take"):
            send_staging(server.name, staging.share_fd, staging.size,
                         os.urandom(TICKET_BYTES), None, os.getpid(), "test-node")
    finally:
        server.close()


def test_the_node_refuses_an_fd_that_is_not_a_sealed_memfd(runtime, arena):
    sources = Sources(runtime, "test-node")
    server = serve(arena, sources)
    fd = os.memfd_create("unsealed")
    os.ftruncate(fd, SIZE)
    try:
        with pytest.raises(errors.ConnectionFailed, match="sealed"):
            send_staging(server.name, fd, SIZE, os.urandom(TICKET_BYTES), None, os.getpid(),
                         "test-node")
    finally:
        os.close(fd)
        server.close()
    assert not sources._offered


def test_hundreds_of_writers_handing_buffers_at_once_are_all_mapped(runtime, staging, arena):
    # 256 actors starting together: the node's map socket queue fills, and a
    # Unix socket refuses a connect to a full queue at once (EAGAIN); each
    # writer must wait its turn, not fall back to slower reads for 30 s.
    import threading

    sources = Sources(runtime, "test-node")
    server = serve(arena, sources)
    tickets = [os.urandom(TICKET_BYTES) for _ in range(300)]
    failed = []

    def hand(ticket):
        try:
            send_staging(server.name, staging.share_fd, staging.size, ticket, None,
                         os.getpid(), "test-node", timeout=20.0)
        except errors.ConnectionFailed as exc:
            failed.append(str(exc))

    threads = [threading.Thread(target=hand, args=(t,)) for t in tickets]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        server.close()
    assert failed == []
    for ticket in tickets:
        assert sources.get(peer(), descriptor(staging, ticket)).mapping is not None


def test_a_connect_to_a_full_queue_waits_its_turn():
    import socket
    import threading

    from distore_ucx.transport.local_map import _connect

    name = f"@distore-test-queue-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name[1:])
    listener.listen(1)
    queued = []
    try:
        while True:  # fill the queue until the kernel refuses at once
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(1.0)
            try:
                s.connect("\0" + name[1:])
            except BlockingIOError:
                s.close()
                break
            queued.append(s)
        accepted = []
        acceptor = threading.Timer(0.2, lambda: accepted.extend(
            listener.accept()[0] for _ in range(len(queued) + 1)))
        acceptor.start()
        late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        late.settimeout(5.0)
        _connect(late, name, 5.0)  # refused at first, then taken
        acceptor.join(5)
        assert len(accepted) == len(queued) + 1
        late.close()
        with pytest.raises(BlockingIOError):  # within its timeout only
            full = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            full.settimeout(0.05)
            for _ in range(len(queued) + 2):
                extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                extra.settimeout(1.0)
                try:
                    extra.connect("\0" + name[1:])
                except BlockingIOError:
                    break
                queued.append(extra)
            _connect(full, name, 0.05)
    finally:
        for s in queued:
            s.close()
        listener.close()


def test_buffers_handed_by_writers_that_exited_unclaimed_are_unmapped(runtime, staging, arena,
                                                                      monkeypatch):
    # A writer hands same-host nodes its first buffer when it is made and may
    # never send to one of them: once it exits, that node unmaps the buffer
    # (its pages are freed) instead of holding it until newer ones push it out.
    import subprocess
    import sys

    from distore_ucx.storage import pulls

    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    sources = Sources(runtime, "test-node")
    mine, theirs = os.urandom(TICKET_BYTES), os.urandom(TICKET_BYTES)
    assert sources.offer(staging.share_fd, staging.size, mine, os.getpid()) == ""
    assert sources.offer(staging.share_fd, staging.size, theirs, exited.pid) == ""
    assert sources.forget_departed() == 0  # not before SWEEP_EVERY s
    monkeypatch.setattr(pulls, "SWEEP_EVERY", 0.0)
    assert sources.forget_departed() == 1
    with pytest.raises(errors.InvalidArgument, match="never handed"):
        sources.get(peer(), descriptor(staging, theirs))
    src = sources.get(peer(), descriptor(staging, mine))  # a live writer's is kept
    assert src.pid == os.getpid()
