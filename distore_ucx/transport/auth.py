"""The authentication handshake: a shared-secret challenge and response.

Every server greets a new connection with a hello frame carrying a fresh
random nonce when it wants a token; the client answers with an ``auth``
request whose ``mac`` is HMAC-SHA256(token, context + nonce)
(protocol.auth_mac); the server compares it in constant time and replies
ok, or with an AuthenticationFailed error and closes the connection. The
token itself never crosses the wire, and a recorded answer is worthless on
the next connection (another nonce).

Three layers, usable from any transport that carries our frames:

- the primitives: ``make_challenge()``, ``answer(token, nonce)``,
  ``verify(token, nonce, mac)``;
- the framed exchange over plain blocking sockets (TCP or Unix):
  ``client_handshake(sock, token, name)``, ``server_handshake(sock, token,
  peer)``;
- the same over asyncio streams: ``client_handshake_async``,
  ``server_handshake_async``.

Until a peer has proved the token, a server reads no frame longer than
MAX_HANDSHAKE_FRAME bytes: an unauthenticated peer cannot make it buffer
anything larger (frames.FrameTooLarge, and the connection is closed).

Example, a blocking Unix-socket server and client::

    conn, _ = listener.accept()
    if not auth.server_handshake(conn, token, "unix peer"):
        conn.close()
    ...
    auth.client_handshake(sock, token, "storage node")   # raises if refused
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import select
import socket

from .. import errors, protocol
from .frames import read_frame, recv_frame, send_frame

log = logging.getLogger(__name__)

NONCE_BYTES = 32
# The hello and the auth request/reply are well under 200 bytes; nothing
# longer is read from a peer before it is authenticated.
MAX_HANDSHAKE_FRAME = 512
AUTH_ID = 1  # message id of the auth request (the connection's first)
# Seconds a client waits for a greeting before asking the silent peer whether
# it is an HTTP server (a metrics port given as the control plane's address).
PROBE_AFTER = 1.0


def make_challenge() -> bytes:
    """A fresh random nonce for one connection's challenge."""
    return secrets.token_bytes(NONCE_BYTES)


def answer(token: bytes, nonce: bytes) -> bytes:
    """The response to a challenge: HMAC-SHA256(token, context + nonce)."""
    return protocol.auth_mac(token, nonce)


def verify(token: bytes, nonce: bytes, mac) -> bool:
    """Whether `mac` answers `nonce` with `token` (constant-time compare)."""
    if not isinstance(mac, (bytes, bytearray, memoryview)):
        return False
    return hmac.compare_digest(bytes(mac), answer(token, nonce))


# -- what both transports share -------------------------------------------------

def _judge(msg, token: bytes, nonce: bytes) -> tuple[dict, str | None]:
    """The server's reply to the first frame of a connection, and why it
    failed (None: authenticated)."""
    mid = msg.get("id", 0) if isinstance(msg, dict) else 0
    try:
        op, fields = protocol.validate_request(msg)
    except protocol.ProtocolError as exc:
        reason = f"malformed first message ({exc})"
    else:
        if op == "auth" and verify(token, nonce, fields["mac"]):
            return protocol.reply(mid), None
        reason = "wrong token" if op == "auth" else f"{op!r} before authenticating"
    exc = errors.AuthenticationFailed(f"authentication failed: {reason}")
    return protocol.error_reply(mid, exc), reason


def _no_token(name: str) -> errors.AuthenticationFailed:
    return errors.AuthenticationFailed(
        f"the {name} requires a token: pass --token-file FILE (distore commands; or set "
        "DISTORE_TOKEN_FILE), or token_file=FILE in Python, FILE holding the store's "
        "shared secret"
    )


def _refused(name: str, msg) -> errors.AuthenticationFailed:
    why = msg.get("message", "no reason given") if isinstance(msg, dict) else "connection closed"
    return errors.AuthenticationFailed(
        f"the {name} refused our token ({why}); check that both sides use the same token file"
    )


# -- blocking sockets -------------------------------------------------------------

def server_handshake(sock: socket.socket, token: bytes | None, peer: str = "peer",
                     role: str | None = None) -> bool:
    """Greet a new connection and, with a token, check its answer.

    Returns True when the peer may go on (no token required, or it proved
    it); False when it failed, after telling it why (the caller closes the
    socket). The socket's timeout bounds each read.
    """
    nonce = make_challenge() if token is not None else None
    try:
        send_frame(sock, protocol.hello(nonce, role))
        if token is None:
            return True
        msg = recv_frame(sock, MAX_HANDSHAKE_FRAME, "handshake frame")
    except protocol.ProtocolError as exc:
        log.warning("authentication failed for %s: %s", peer, exc)
        try:
            send_frame(sock, protocol.error_reply(0, exc))
        except OSError:
            pass
        return False
    except OSError as exc:
        log.warning("authentication failed for %s: %s", peer, exc)
        return False
    reply, reason = _judge(msg, token, nonce)
    if reason is not None:
        log.warning("authentication failed for %s: %s", peer, reason)
    try:
        send_frame(sock, reply)
    except OSError:
        return False
    return reason is None


class SlowGreeting(errors.ConnectionFailed):
    """A distore server greeted only after `probe_after` s, so the probe went
    out and spoilt the connection: connect again and wait without one."""


# A request every HTTP server answers; sent only to a peer that stays silent.
_HTTP_PROBE = b"HEAD / HTTP/1.0\r\n\r\n"

# -- what answered, when it was not the server expected -----------------------------
# One diagnosis for every client (ds.connect, the CLI, a storage node joining
# its control plane), over blocking sockets and asyncio streams alike.


def _use_instead(expect: str | None) -> str:
    """Which address to give instead of a wrong one."""
    if expect == "control plane":
        return ("use the control plane's address (the one `distore control` logs as "
                "'control plane listening on')")
    return f"use the {expect or 'distore-ucx server'}'s own address"


def _silent_peer_error(first: bytes, name: str, expect: str | None,
                       timeout: float | None) -> errors.ConnectionFailed | errors.Timeout:
    """What a peer that sent no greeting is, from the first bytes it answered
    our HTTP probe with (b"": none)."""
    if first.startswith(b"HTTP/"):
        what = expect or "distore-ucx server"
        return errors.WrongPeer(f"the {name} is an HTTP server (a /metrics port?), not a "
                                f"{what}: {_use_instead(expect)}")
    if first:  # greeted after all: our probe went to a distore server
        return SlowGreeting(f"the {name} greeted late")
    return errors.Timeout(f"the {name} sent no greeting within {timeout} s, and does not "
                          "answer as an HTTP server either: is this the address of a "
                          "distore-ucx process?")


def _check_role(greeting: dict, name: str, expect: str | None) -> None:
    """Refuse a greeting from a server of another role than `expect`."""
    role = protocol.hello_role(greeting)
    if expect is not None and role is not None and role != expect:
        raise errors.WrongPeer(f"the {name} is a {role}, not a {expect}: "
                               f"{_use_instead(expect)}")


def _probe_silent_peer(sock: socket.socket, name: str, expect: str | None,
                       waited: float) -> None:
    """The peer sent no greeting within the probe time (`waited` s): distore
    servers greet at once, HTTP servers (a metrics port) wait to be asked.
    Ask it as HTTP and say what answered, within a second instead of the
    whole timeout."""
    try:
        sock.sendall(_HTTP_PROBE)
        # An HTTP server answers at once; the greeting's wait ends at the timeout.
        left = max((sock.gettimeout() or waited) - waited, PROBE_AFTER)
        ready, _, _ = select.select([sock], [], [], left)
        first = sock.recv(5, socket.MSG_PEEK) if ready else b""
    except OSError:
        first = b""
    raise _silent_peer_error(first, name, expect, sock.gettimeout()) from None


def client_handshake(sock: socket.socket, token: bytes | None, name: str,
                     expect: str | None = None, probe_after: float | None = None) -> None:
    """Read a server's greeting and answer its challenge with `token`.

    `name` says who the server is in errors ("control plane at H:P");
    `expect` is the role it must have ("control plane"): a greeting from
    another role (a storage node) is refused, saying what answered. With
    `probe_after`, a peer silent that long is asked whether it is an HTTP
    server (raises SlowGreeting when it greets after all: connect again
    without a probe).
    Raises errors.Timeout (no greeting within the socket's timeout),
    errors.ConnectionFailed (not a distore-ucx server, or it went away) or
    errors.AuthenticationFailed (we have no token, or it refused ours).
    """
    if probe_after is not None and probe_after < (sock.gettimeout() or float("inf")):
        try:
            ready, _, _ = select.select([sock], [], [], probe_after)
        except (OSError, ValueError):
            ready = [sock]  # the read below says what happened
        if not ready:
            _probe_silent_peer(sock, name, expect, probe_after)
    try:
        greeting = recv_frame(sock, MAX_HANDSHAKE_FRAME, "greeting")
        nonce = protocol.check_hello(greeting)
    except TimeoutError:
        raise errors.Timeout(
            f"the {name} sent no greeting within {sock.gettimeout()} s"
        ) from None
    except (OSError, protocol.ProtocolError) as exc:
        raise errors.ConnectionFailed(f"bad greeting from the {name}: {exc}") from None
    _check_role(greeting, name, expect)
    if nonce is None:
        return
    if token is None:
        raise _no_token(name)
    try:
        send_frame(sock, protocol.request("auth", AUTH_ID, mac=answer(token, nonce)))
        msg = recv_frame(sock, MAX_HANDSHAKE_FRAME, "authentication reply")
    except TimeoutError:
        raise errors.Timeout(f"the {name} did not answer our token within "
                             f"{sock.gettimeout()} s") from None
    except (OSError, protocol.ProtocolError) as exc:
        raise _refused(name, {"message": str(exc)}) from None
    if not msg.get("ok"):
        raise _refused(name, msg)


# -- asyncio streams -----------------------------------------------------------------

async def server_handshake_async(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                 token: bytes | None, peer: str = "peer",
                                 role: str | None = None) -> bool:
    """As server_handshake, over asyncio streams (the caller bounds the time
    with asyncio.wait_for and closes the writer when this returns False)."""
    nonce = make_challenge() if token is not None else None
    writer.writelines(protocol.encode(protocol.hello(nonce, role)))
    if token is None:
        return True
    try:
        msg = await read_frame(reader, MAX_HANDSHAKE_FRAME, "handshake frame")
    except protocol.ProtocolError as exc:
        log.warning("authentication failed for %s: %s", peer, exc)
        writer.writelines(protocol.encode(protocol.error_reply(0, exc)))
        return False
    if msg is None:
        return False
    reply, reason = _judge(msg, token, nonce)
    if reason is not None:
        log.warning("authentication failed for %s: %s", peer, reason)
    writer.writelines(protocol.encode(reply))
    return reason is None


async def client_handshake_async(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                 token: bytes | None, name: str, timeout: float,
                                 expect: str | None = None,
                                 probe_after: float | None = None) -> None:
    """As client_handshake, over asyncio streams; `timeout` bounds each read.

    `expect` and `probe_after` as in client_handshake: a server of another
    role, or an HTTP server, is refused at once (errors.WrongPeer), saying
    what answered; SlowGreeting when a silent peer greets after the probe.
    Raises errors.ConnectionFailed (no valid greeting in time, or the
    connection broke) or errors.AuthenticationFailed.
    """
    first = None
    if probe_after is not None and probe_after < timeout:
        try:
            # Cancelled while waiting, readexactly has consumed nothing.
            first = await asyncio.wait_for(
                read_frame(reader, MAX_HANDSHAKE_FRAME, "greeting"), probe_after)
        except asyncio.TimeoutError:
            writer.write(_HTTP_PROBE)
            try:  # an HTTP server answers at once; the greeting's wait ends at `timeout`
                head = await asyncio.wait_for(reader.read(5),
                                              max(timeout - probe_after, PROBE_AFTER))
            except (asyncio.TimeoutError, ConnectionError):
                head = b""
            raise _silent_peer_error(head, name, expect, timeout) from None
        except (protocol.ProtocolError, ConnectionError) as exc:
            raise errors.ConnectionFailed(f"bad greeting from the {name}: {exc}") from None
    try:
        if first is None:
            first = await asyncio.wait_for(
                read_frame(reader, MAX_HANDSHAKE_FRAME, "greeting"), timeout)
        nonce = protocol.check_hello(first)
    except asyncio.TimeoutError:
        raise errors.Timeout(f"the {name} sent no greeting within {timeout} s") from None
    except (protocol.ProtocolError, ConnectionError) as exc:
        raise errors.ConnectionFailed(f"bad greeting from the {name}: {exc}") from None
    _check_role(first, name, expect)
    if nonce is None:
        return
    if token is None:
        raise _no_token(name)
    writer.writelines(protocol.encode(
        protocol.request("auth", AUTH_ID, mac=answer(token, nonce))))
    try:
        msg = await asyncio.wait_for(
            read_frame(reader, MAX_HANDSHAKE_FRAME, "authentication reply"), timeout)
    except asyncio.TimeoutError:
        raise errors.ConnectionFailed(
            f"the {name} did not answer our token within {timeout} s") from None
    except (protocol.ProtocolError, ConnectionError) as exc:
        raise _refused(name, {"message": str(exc)}) from None
    if not msg or not msg.get("ok"):
        raise _refused(name, msg)


__all__ = [
    "MAX_HANDSHAKE_FRAME",
    "NONCE_BYTES",
    "PROBE_AFTER",
    "answer",
    "client_handshake",
    "client_handshake_async",
    "make_challenge",
    "server_handshake",
    "server_handshake_async",
    "verify",
]
