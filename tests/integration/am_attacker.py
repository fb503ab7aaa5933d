"""A hostile peer of a storage node's active-message listeners, as an
attacker who found their ports by a port scan would write it: UCX endpoints
to the listeners, raw active messages, no control plane and no token (but
for `forge`, an authenticated client that asks for more than it was granted).

Prints one JSON line per step; a run ends by itself. Not a test module
(pytest collects test_*.py only); test_hostile_listeners.py runs it.

    am_attacker.py read HOST SAMPLE_PORT ARENA_SIZE [--cap HEX]
    am_attacker.py flood HOST INSERT_PORT --count N --bytes B [--linger S]
    am_attacker.py hold HOST PORT --count N --linger S
    am_attacker.py forge CONTROL NODE_ID --token-file F
    am_attacker.py beat CONTROL NODE_ID --token-file F
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import struct
import sys
import time

import numpy as np

import distore_ucx as ds
from distore_ucx._native_loader import _native
from distore_ucx.protocol import AM_INSERT_ID, AM_SAMPLE_AUTH_ID
from distore_ucx.transport.runtime import UcxRuntime

FILL = 0xAB  # what the read's destination holds before: any other byte came from the node


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def runtime() -> UcxRuntime:
    return UcxRuntime(config={"TLS": "tcp", "RNDV_SCHEME": "put_zcopy"}, env_tls="tcp")


def connect(rt: UcxRuntime, host: str, port: int, worker=None):
    ep = _native.Endpoint.to_listener(worker or rt.worker, host, port, "victim")
    return ep, ep.flush(5.0)


def read(args) -> None:
    """Ask the sample listener for the whole arena as one part of one item."""
    rt = runtime()
    worker = rt.reader_worker
    ep, status = connect(rt, args.host, args.port, worker)
    say(step="connect", status=status)
    if args.cap:
        status = _native.AmAuthClient(worker).authenticate(ep, AM_SAMPLE_AUTH_ID,
                                                           bytes.fromhex(args.cap), 3.0)
        say(step="authenticate", status=status, name=_native.status_name(status))
    size = args.arena_size - 16
    layout = _native.BatchLayout(1, 0, np.array([16], np.uint64), np.array([size], np.uint64),
                                 np.array([16], np.uint64))
    dest = rt.map_region(16 + size)
    dest.view()[:] = FILL
    client = _native.AmSampleClient(worker)
    got = client.fetch([ep], np.zeros(1, np.uint32), np.zeros(1, np.uint64),
                       np.zeros(1, np.uint64), layout, dest, args.timeout,
                       tags=np.zeros(1, np.uint32), slot_size=args.arena_size)
    view = dest.view()[16:]  # the header row is the fetch's own (0, 0) for a failed item
    say(step="read", status=int(got[0]), name=_native.status_name(int(got[0])),
        bytes_read=int(np.count_nonzero(view != FILL)), alive=ep.alive)
    client.close()
    ep.close(True, 1.0)
    rt.close()


def flood(args) -> None:
    """Eager insert messages with well-formed headers and random batch tokens."""
    rt = runtime()
    ep, status = connect(rt, args.host, args.port)
    say(step="connect", status=status)
    header = struct.pack("<QII", int.from_bytes(os.urandom(8), "little") | 1, 0, 1 << 20)
    t0 = time.monotonic()
    sent = _native.am_send_raw(ep, AM_INSERT_ID, header, b"\xee" * args.bytes, args.count,
                               True, 5.0)
    say(step="flood", sent=sent, seconds=round(time.monotonic() - t0, 2), alive=ep.alive)
    time.sleep(args.linger)  # stays connected while the test looks at the node
    say(step="done", alive=ep.alive)
    rt.close()


def hold(args) -> None:
    """Open many connections to a listener and keep them, saying nothing."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    rt = runtime()
    eps = []
    t0 = time.monotonic()
    for _ in range(args.count):
        try:
            eps.append(_native.Endpoint.to_listener(rt.worker, args.host, args.port, "victim"))
        except ds.DistoreError as exc:
            say(step="endpoint", error=str(exc))
            break
    say(step="opened", count=len(eps), seconds=round(time.monotonic() - t0, 2))
    deadline = time.monotonic() + args.linger
    while time.monotonic() < deadline:
        time.sleep(0.5)
        say(step="holding", alive=sum(ep.alive for ep in eps))
    for ep in eps:
        ep.close(True, 0.0)
    rt.close()


def forge(args) -> None:
    """An authenticated client that reads a slot it was not granted."""
    client = ds.connect(args.control, token_file=args.token_file)
    node = [n for n in client.nodes() if n["node_id"] == args.node_id][0]
    host = node["address"].rpartition(":")[0]
    rt = client.runtime
    ep = rt.listener_endpoint(host, node["sample_port"], "victim", reader=True,
                              cap=node["am_cap"], auth_id=AM_SAMPLE_AUTH_ID)
    say(step="authenticated", alive=ep.alive)
    layout = _native.BatchLayout(1, 0, np.array([16], np.uint64), np.array([4096], np.uint64),
                                 np.array([16], np.uint64))
    dest = rt.map_region(16 + 4096)
    dest.view()[:] = FILL
    got = rt.am_sample_client().fetch([ep], np.zeros(1, np.uint32), np.zeros(1, np.uint64),
                                      np.zeros(1, np.uint64), layout, dest, args.timeout,
                                      tags=np.array([12345], np.uint32), slot_size=4112)
    say(step="read", status=int(got[0]), name=_native.status_name(int(got[0])),
        bytes_read=int(np.count_nonzero(dest.view()[16:] != FILL)))
    client.close()


def beat(args) -> None:
    """An authenticated client that heartbeats for a node that is not it."""
    client = ds.connect(args.control, token_file=args.token_file)
    try:
        client.call("heartbeat", node_id=args.node_id, used_bytes=0)
        say(step="beat", ok=True)
    except ds.DistoreError as exc:
        say(step="beat", ok=False, error=str(exc))
    client.close()


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("read")
    r.add_argument("host")
    r.add_argument("port", type=int)
    r.add_argument("arena_size", type=int)
    r.add_argument("--cap", default="", help="hex: authenticate with this capability first")
    r.add_argument("--timeout", type=float, default=3.0)
    f = sub.add_parser("flood")
    f.add_argument("host")
    f.add_argument("port", type=int)
    f.add_argument("--count", type=int, default=65600)
    f.add_argument("--bytes", type=int, default=8)
    f.add_argument("--linger", type=float, default=0.0)
    h = sub.add_parser("hold")
    h.add_argument("host")
    h.add_argument("port", type=int)
    h.add_argument("--count", type=int, default=4000)
    h.add_argument("--linger", type=float, default=5.0)
    for name in ("forge", "beat"):
        a = sub.add_parser(name)
        a.add_argument("control")
        a.add_argument("node_id", type=int)
        a.add_argument("--token-file", required=True)
        a.add_argument("--timeout", type=float, default=3.0)
    args = p.parse_args()
    {"read": read, "flood": flood, "hold": hold, "forge": forge, "beat": beat}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
