"""Same-host mapping: a storage node hands its sealed arena to local learners.

A storage node's arena is a memfd sealed against any new writable mapping
(native/memory.cc). A learner on the same host (same boot id, pid and
network namespace: `same_host.host_id()`) connects to the node's Unix domain
socket (abstract namespace, named in the node's description), proves the
store's token with the same HMAC challenge as every other connection, and
receives the memfd (`SCM_RIGHTS`). It maps it PROT_READ and from then on
reads that node's items with plain loads: no system call and no page
pinning per item. The seals make a writable mapping of the fd impossible,
so a learner still cannot change storage.

Wire format (fixed sizes, nothing else is read, so a hostile peer costs a
few bytes and at most `HANDSHAKE_TIMEOUT` seconds of the serving thread):

    node -> learner   b"DSMP" version:u8 token_required:u8 nonce:32
    learner -> node   b"DSMP" mac:32 arena_id:u64
    node -> learner   b"OK" arena_id:u64 size:u64 page_kind:8s high_water:u64   + the fd
                   or b"NO" length:u16 message

Without a token, only a peer of the same user (or root) may map the arena
(`SO_PEERCRED`). Thread safety: a LocalMapServer runs one accept thread.

The same socket takes a same-host writer's staging buffer the other way
(inserts: the node copies batches out of it, storage/pulls.py). After the
same challenge the writer sends

    writer -> node    b"DSWB" mac:32 size:u64
    node -> writer    b"GO"            (or b"NO" length:u16 message)
    writer -> node    ticket:16                                     + the fd
    node -> writer    b"OK"            (or b"NO" length:u16 message)

The writer first checks (`SO_PEERCRED`) that the socket belongs to the
node's own pid, so its buffer goes to no other process; the ticket, a
random name for the buffer, is what its insert descriptors then carry.
The memfd is sealed against writes: the node can only map it read-only.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
import time

from ..errors import ConnectionFailed
from . import auth

log = logging.getLogger(__name__)

MAGIC = b"DSMP"
VERSION = 1
HANDSHAKE_TIMEOUT = 2.0
_HELLO = struct.Struct("<4sBB32s")
_PROOF = struct.Struct("<4s32sQ")
_GRANT = struct.Struct("<2sQQ8sQ")
STAGING_MAGIC = b"DSWB"
TICKET_BYTES = 16


def socket_name(pid: int) -> str:
    """A fresh abstract-namespace socket name for a node process ("@..." form)."""
    return f"@distore-arena-{pid}-{secrets.token_hex(8)}"


def _address(name: str) -> str:
    # "@name" is Linux's abstract namespace: no file to clean up, and it is
    # private to the network namespace (which host_id() includes).
    return "\0" + name[1:] if name.startswith("@") else name


def _connect(sock: socket.socket, name: str, timeout: float) -> None:
    """Connect `sock` to map socket `name` within `timeout` s. A Unix socket
    whose listen queue is full refuses at once (EAGAIN) rather than waiting,
    as a TCP one would: hundreds of writers starting together queue up, so
    try again until the node has accepted the ones ahead, up to `timeout`."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        try:
            sock.connect(_address(name))
            return
        except BlockingIOError:  # EAGAIN: the queue is full
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, 0.05)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed the connection during the handshake")
        buf += part
    return buf


class LocalMapServer:
    """Serves a node's sealed arena fd to same-host learners that prove the token.

    >>> server = LocalMapServer(region.share_fd, region.size, arena_id, token=None)
    >>> server.start(); server.name   # goes into the node's description
    """

    def __init__(self, fd: int, size: int, arena_id: int, page_kind: str,
                 token: bytes | None, node_name: str = "node", high_water=None,
                 on_staging=None):
        """`high_water()`: bytes of the arena written so far (from offset 0),
        which a learner maps at once; None: the whole arena.
        `on_staging(fd, size, ticket, pid)`: takes a writer's staging buffer
        (None: writers are refused); returns "" or why it refused; the fd is
        closed after it returns (it maps what it keeps)."""
        self.on_staging = on_staging
        self.fd = fd
        self.high_water = high_water or (lambda: size)
        self.size = size
        self.arena_id = arena_id
        self.page_kind = page_kind
        self.token = token
        self.node_name = node_name
        self.name = socket_name(os.getpid())
        self.granted = 0
        self.refused = 0
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self) -> LocalMapServer:
        """Listen and serve on a background thread (it blocks in accept, idle)."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(_address(self.name))
        # Hundreds of writers and learners may start at once: the kernel caps
        # the queue at net.core.somaxconn; clients retry a full one (_connect).
        self._sock.listen(socket.SOMAXCONN)
        self._thread = threading.Thread(target=self._serve, name="distore-local-map",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving (learners that mapped the arena keep their mappings)."""
        self._stopping = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
            except OSError:
                pass
            self._sock.close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _serve(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(HANDSHAKE_TIMEOUT)
                    self._grant(conn)
                except (OSError, ConnectionError, struct.error) as exc:
                    self.refused += 1
                    log.debug("same-host map handshake failed: %s", exc)

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self.refused += 1
        log.warning("node %s refused to share its arena with a local process: %s",
                    self.node_name, why)
        msg = why.encode()[:1024]
        conn.sendall(b"NO" + struct.pack("<H", len(msg)) + msg)

    def _grant(self, conn: socket.socket) -> None:
        nonce = auth.make_challenge()
        conn.sendall(_HELLO.pack(MAGIC, VERSION, self.token is not None, nonce))
        magic, mac, arena_id = _PROOF.unpack(_recv_exact(conn, _PROOF.size))
        if magic not in (MAGIC, STAGING_MAGIC):
            raise ConnectionError("not a distore same-host map request")
        if self.token is not None:
            if not auth.verify(self.token, nonce, mac):
                self._refuse(conn, "wrong token")
                return
        else:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if uid not in (0, os.getuid()):
                self._refuse(conn, f"uid {uid} is not this node's user and the store has no "
                                   "token; start the store with --token-file")
                return
        if magic == STAGING_MAGIC:
            self._take_staging(conn, size=arena_id)
            return
        if arena_id != self.arena_id:
            self._refuse(conn, f"arena {arena_id:#x} is not this node's ({self.arena_id:#x}); "
                               "the node restarted: look it up again")
            return
        grant = _GRANT.pack(b"OK", self.arena_id, self.size, self.page_kind.encode()[:8],
                            min(int(self.high_water()), self.size))
        self.granted += 1  # counted first: the peer may look before we return
        socket.send_fds(conn, [grant], [self.fd])

    def _take_staging(self, conn: socket.socket, size: int) -> None:
        """The peer proved the token: receive its staging buffer's fd."""
        if self.on_staging is None:
            self._refuse(conn, "this node does not take staging buffers")
            return
        conn.sendall(b"GO")
        ticket, fds, _, _ = socket.recv_fds(conn, TICKET_BYTES, 1)
        try:
            if len(ticket) != TICKET_BYTES or len(fds) != 1:
                self._refuse(conn, "expected a ticket and one file descriptor")
                return
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize("3i"))
            pid, _, _ = struct.unpack("3i", creds)
            why = self.on_staging(fds[0], size, bytes(ticket), pid)
            if why:
                self._refuse(conn, why)
                return
        finally:
            for fd in fds:
                os.close(fd)
        conn.sendall(b"OK")


def receive_arena(name: str, arena_id: int, token: bytes | None, node: str,
                  timeout: float = 5.0) -> tuple[int, int, str, int]:
    """Ask a same-host node for its arena: (fd, size, page_kind, high_water),
    high_water being the bytes it has written so far (map them at once).

    The caller owns the returned fd (map it, then close it). Raises
    ConnectionFailed saying why when the node refuses or cannot be reached.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            _connect(sock, name, timeout)
            magic, version, wants_token, nonce = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
        except (OSError, ConnectionError, struct.error) as exc:
            raise ConnectionFailed(f"cannot reach {node}'s same-host map socket ({exc})") from None
        if magic != MAGIC or version != VERSION:
            raise ConnectionFailed(f"{node}'s map socket speaks another protocol "
                                   f"(version {version}); upgrade both to the same release")
        if wants_token and token is None:
            raise ConnectionFailed(f"{node} requires a token to share its arena: pass "
                                   "token_file= (or set DISTORE_TOKEN_FILE)")
        mac = auth.answer(token, nonce) if wants_token else bytes(32)
        sock.sendall(_PROOF.pack(MAGIC, mac, arena_id))
        try:
            msg, fds, _, _ = socket.recv_fds(sock, _GRANT.size, 1)
        except OSError as exc:
            raise ConnectionFailed(f"{node} did not answer the map request ({exc})") from None
        if msg[:2] == b"NO":
            for fd in fds:
                os.close(fd)
            rest = msg[2:] + sock.recv(4096)
            (n,) = struct.unpack("<H", rest[:2])
            raise ConnectionFailed(f"{node} refused to share its arena: "
                                   f"{rest[2:2 + n].decode(errors='replace')}")
        if len(msg) < _GRANT.size or msg[:2] != b"OK" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ConnectionFailed(f"{node} sent a malformed map grant")
        _, got_id, size, kind, high_water = _GRANT.unpack(msg)
        if got_id != arena_id:
            os.close(fds[0])
            raise ConnectionFailed(f"{node} granted arena {got_id:#x}, not {arena_id:#x}")
        return fds[0], size, kind.rstrip(b"\0").decode(), high_water
    finally:
        sock.close()


def send_staging(name: str, fd: int, size: int, ticket: bytes, token: bytes | None,
                 node_pid: int, node: str, timeout: float = 5.0) -> None:
    """Hand a same-host node (its map socket `name`, its process `node_pid`)
    the sealed memfd behind a writer's staging buffer of `size` bytes, under
    `ticket` (TICKET_BYTES random bytes its insert descriptors will name).

    Raises ConnectionFailed saying why when the socket is not the node's,
    the node refuses, or it cannot be reached. The caller keeps its fd.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            _connect(sock, name, timeout)
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize("3i"))
            pid, _, _ = struct.unpack("3i", creds)
            if pid != node_pid:
                raise ConnectionFailed(f"{node}'s map socket belongs to pid {pid}, not to the "
                                       f"node (pid {node_pid}); not sending it a staging buffer")
            magic, version, wants_token, nonce = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
            if magic != MAGIC or version != VERSION:
                raise ConnectionFailed(f"{node}'s map socket speaks another protocol "
                                       f"(version {version}); upgrade both to the same release")
            if wants_token and token is None:
                raise ConnectionFailed(f"{node} requires a token: pass token_file= (or set "
                                       "DISTORE_TOKEN_FILE)")
            mac = auth.answer(token, nonce) if wants_token else bytes(32)
            sock.sendall(_PROOF.pack(STAGING_MAGIC, mac, size))
            _expect_ok(sock, b"GO", node)
            socket.send_fds(sock, [ticket], [fd])
            _expect_ok(sock, b"OK", node)
        except (OSError, ConnectionError, struct.error) as exc:
            raise ConnectionFailed(f"cannot hand {node} a staging buffer ({exc})") from None
    finally:
        sock.close()


def _expect_ok(sock: socket.socket, word: bytes, node: str) -> None:
    got = _recv_exact(sock, 2)
    if got == word:
        return
    if got == b"NO":
        (n,) = struct.unpack("<H", _recv_exact(sock, 2))
        why = _recv_exact(sock, n).decode(errors="replace")
        raise ConnectionFailed(f"{node} refused the staging buffer: {why}")
    raise ConnectionFailed(f"{node} answered the staging handoff with {got!r}")
