"""No peer writes a storage node's memory, and every reader is served.

A hostile client authenticates as a learner does, takes a node's worker
address and remote key, makes a UCX endpoint with or without peer-failure
handling and puts 256 bytes at the arena, past its end, at the node's
writable alias of the arena and into its heap (tests/integration/
hostile_peer.py). After each put the node must be alive and every byte it
stores unchanged, read through /proc/PID/mem (the tests run as the node's
parent). Readers over either kind of endpoint must be served, before and
after each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import wait_for

import distore_ucx as ds

HOSTILE = os.path.join(os.path.dirname(__file__), "hostile_peer.py")
SPEC = {"payload": ((240,), "uint8"), "key": ((), "uint64")}
ARENA = 16 << 20
TARGETS = ("arena", "past_end", "alias", "heap")
# Memory nobody but a put may change; what lies past the arena's end and the
# heap are the node's own live memory (a thread's stack, allocator state),
# which changes by itself: there the put's own bytes must not appear.
STABLE = ("arena", "alias")
PUT_BYTE, PUT_LENGTH = 0xEE, 256  # what hostile_peer.py --put writes


def _put_landed(before: bytes, after: bytes) -> bool:
    """Whether the hostile put's bytes replaced what was at its target: every
    byte of its span that changed now holds PUT_BYTE."""
    changed = [i for i in range(PUT_LENGTH) if after[i] != before[i]]
    return bool(changed) and all(after[i] == PUT_BYTE for i in changed)


def _items(keys: np.ndarray) -> dict:
    keys = np.asarray(keys, np.uint64)
    payload = (keys[:, None] * np.uint64(31) + np.arange(240, dtype=np.uint64)).astype(np.uint8)
    return {"payload": payload, "key": keys}


def _bad(batch) -> int:
    return int((~(_items(batch.keys)["payload"] == batch.data["payload"]).all(axis=1)).sum())


def _maps(pid: int) -> list[tuple[int, int, str, int]]:
    """(start, end, perms, inode) of each mapping of process `pid`."""
    out = []
    with open(f"/proc/{pid}/maps") as fh:
        for line in fh:
            f = line.split()
            start, end = (int(x, 16) for x in f[0].split("-"))
            out.append((start, end, f[1], int(f[4]), f[5] if len(f) > 5 else ""))
    return out


def _read(pid: int, address: int, n: int) -> bytes | None:
    """n bytes of process `pid` at `address`, or None where nothing is mapped."""
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as fh:
            fh.seek(address)
            return fh.read(n)
    except OSError:
        return None


def _target(pid: int, node: dict, target: str) -> int:
    base, size = node["arena_base"], node["arena_size"]
    maps = _maps(pid)
    if target == "arena":
        return base
    if target == "past_end":
        return base + size
    if target == "alias":
        inode = next(m[3] for m in maps if m[0] <= base < m[1])
        alias = [m for m in maps if m[3] == inode and "w" in m[2] and m[0] != base]
        assert alias, f"no writable alias of the arena in {maps}"
        return alias[0][0]
    heap = [m for m in maps if m[4] == "[heap]"]
    assert heap, "the node has no [heap] mapping"
    start, end = heap[0][0], heap[0][1]
    return (start + (end - start) // 2) & ~0xFFF


def _wait_log(process, text: str, timeout: float = 10.0) -> str:
    """The process's log once it contains `text` (polled)."""
    return wait_for(lambda: text in (log := process.log_tail(200)) and log, timeout,
                    f"{text!r} in the node's log", state=lambda: process.log_tail(5))


def _hostile(address: str, node_id: int, *args: str, timeout: float = 30.0) -> list[dict]:
    """Run the hostile peer; its JSON lines (a refused put may never end:
    it is killed after `timeout` s, which is an acceptable outcome)."""
    try:
        out = subprocess.run([sys.executable, HOSTILE, address, str(node_id), *args],
                             capture_output=True, text=True, timeout=timeout)
        stdout = out.stdout
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_no_remote_put_lands_in_a_node(make_cluster, tls):
    cluster = make_cluster(nodes=1, arena_bytes=ARENA)
    victim = cluster.nodes[0]
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=1000, spec=SPEC)
        with client.writer(max_items=50) as w:
            w.insert("t", _items(w.next_keys(200)))
        node = client.nodes()[0]
        pid = node["pid"]
        arena = _read(pid, node["arena_base"], ARENA)
        assert arena is not None and any(arena)
        for error_handling in (False, True):
            for target in TARGETS:
                what = f"{'with' if error_handling else 'without'} peer-failure handling, " \
                       f"at the {target}"
                address = _target(pid, node, target)
                near = _read(pid, address, 4096)
                lines = _hostile(cluster.address, node["node_id"], "--put", hex(address),
                                 *(["--error-handling"] if error_handling else []))
                assert lines and lines[0]["op"] == "endpoint", what
                assert victim.alive(), f"{what}: the node died\n{victim.log_tail()}"
                assert _read(pid, node["arena_base"], ARENA) == arena, f"{what}: arena changed"
                after = _read(pid, address, 4096)
                if target in STABLE:
                    assert after == near, f"{what}: bytes changed"
                else:
                    assert not _put_landed(near, after), f"{what}: the put's bytes landed"
        learner = client.learner("t", batch_size=64)
        assert sum(_bad(learner.sample(timeout=10)) for _ in range(20)) == 0
        assert victim.alive()


@pytest.mark.slow
def test_readers_of_either_endpoint_kind_are_served(make_cluster, tls):
    cluster = make_cluster(nodes=1, arena_bytes=ARENA)
    victim = cluster.nodes[0]
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=1000, spec=SPEC)
        with client.writer(max_items=50) as w:
            w.insert("t", _items(w.next_keys(200)))
        node = client.nodes()[0]
        size = 1 << 16
        expect = hashlib.sha256(_read(node["pid"], node["arena_base"], size)).hexdigest()
        # A careless reader first, then a careful one, then careless again.
        for error_handling in (False, True, False):
            lines = _hostile(cluster.address, node["node_id"], "--get", str(size),
                             *(["--error-handling"] if error_handling else []))
            what = f"a reader {'with' if error_handling else 'without'} peer-failure handling"
            assert lines and lines[0]["op"] == "endpoint", what
            if lines[0]["status"] != 0:  # UCX offers no such endpoint here (sm)
                assert error_handling and tls == "sm", (what, lines)
                continue
            gets = [x for x in lines if x["op"] == "get"]
            assert len(gets) == 4, (what, lines, victim.log_tail())
            assert all(g["status"] == 0 and g["sha256"] == expect for g in gets), (what, gets)
        learner = client.learner("t", batch_size=64)
        assert sum(_bad(learner.sample(timeout=10)) for _ in range(20)) == 0
        assert victim.alive()


def _listening_ports(pid: int) -> set[int]:
    """TCP ports process `pid` listens on (its sockets' inodes in /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as fh:
            for line in list(fh)[1:]:
                f = line.split()
                if f[3] == "0A" and int(f[9]) in inodes:  # LISTEN
                    ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.slow
@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_raw_tcp_put_without_ucx_or_token_is_refused(make_cluster, tls):
    # UCX's TCP transport takes a put frame even from a connection that never
    # completed its handshake: 8 bytes of magic number, then a PUT_REQ frame
    # (id 33, 20 bytes: address, length, sequence number) and the bytes. No
    # token, no UCX, no worker address: reaching the port is enough.
    cluster = make_cluster(nodes=1, arena_bytes=ARENA)
    victim = cluster.nodes[0]
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=1000, spec=SPEC)
        with client.writer(max_items=50) as w:
            w.insert("t", _items(w.next_keys(200)))
        node = client.nodes()[0]
        pid = node["pid"]
        target = _target(pid, node, "alias")  # the arena's first slot, writable here
        arena = _read(pid, node["arena_base"], ARENA)
        rpc_port = int(victim.info["address"].rsplit(":", 1)[1])
        ports = _listening_ports(pid) - {rpc_port}
        assert ports, "the node listens on no UCX TCP port"
        frame = (struct.pack("<Q", 0xCAFEBABE12345678) + struct.pack("<BI", 33, 20)
                 + struct.pack("<QQI", target, 256, 1) + b"\xee" * 256)
        # Whole, and a byte at a time (the node sees the headers in pieces),
        # each on a connection of its own, all sent before any is waited on.
        socks = []
        try:
            for port, pieces in [(p, n) for p in sorted(ports) for n in (1, len(frame))]:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                socks.append(sock)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                step = len(frame) // pieces
                try:
                    for i in range(0, len(frame), step):
                        sock.sendall(frame[i:i + step])
                        if pieces > 1:
                            select.select([], [], [], 0.001)  # let each byte go alone
                except OSError:  # refused before the last byte: the node closed it
                    pass
            # The node closes each connection (b"" or a reset) or leaves it
            # silent (4 connections here): each gets 2 s after the last frame
            # was sent for any put it let through to land (as when they were
            # waited on one after another), then the arena is compared.
            deadline = time.monotonic() + 2.0
            open_socks = list(socks)
            while open_socks and (left := deadline - time.monotonic()) > 0:
                for sock in select.select(open_socks, [], [], left)[0]:
                    try:
                        if sock.recv(4096):
                            continue
                    except OSError:
                        pass
                    open_socks.remove(sock)
        finally:
            for sock in socks:
                sock.close()
        assert victim.alive(), victim.log_tail()
        assert _read(pid, node["arena_base"], ARENA) == arena, f"ports {sorted(ports)}: changed"
        learner = client.learner("t", batch_size=64)
        assert sum(_bad(learner.sample(timeout=10)) for _ in range(10)) == 0
        assert "TCP connection(s) ended for a put" in _wait_log(victim, "ended for a put")
