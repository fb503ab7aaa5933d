"""The listeners' capability and grants (native/am_grant.h): SipHash-2-4
as its reference computes it, the control plane's signing of sample
replies, and a node's sample server that serves only authenticated,
granted requests (both ends in one process over UCX tcp)."""

from __future__ import annotations

import os

import numpy as np

from distore_ucx import _tables
from distore_ucx._native_loader import _native
from distore_ucx.protocol import AM_SAMPLE_AUTH_ID, ITEM_LOCATION
from distore_ucx.transport import UcxRuntime

CONFIG = {"TLS": "tcp", "RNDV_SCHEME": "put_zcopy", "ADAPTIVE_PROGRESS": "n"}


def test_siphash_matches_the_reference_vectors():
    key = bytes(range(16))
    assert _tables.siphash24(key, bytes(range(15))) == 0xA129CA6149BE45E5
    assert _tables.siphash24(key, b"") == 0x726FDB47DD0E0E31


def test_sample_replies_are_signed_per_item_under_their_nodes_key():
    keys = np.frombuffer(os.urandom(3 * 16), np.uint8).reshape(3, 16).copy()
    items = np.zeros(5, ITEM_LOCATION)
    items["node"] = [1, 2, 1, 2, 7]  # node 7 has no key: tag 0
    items["offset"] = [0, 4112, 8224, 0, 16]
    _tables.am_sign(items.view(np.uint64), keys, 4112)
    for node in (1, 2):
        mine = items["node"] == node
        want = _tables.am_item_tags(keys[node].tobytes(), items["offset"][mine], 4112)
        assert np.array_equal(items["pad"][mine], want)
    assert items["pad"][4] == 0
    assert list(items["node"]) == [1, 2, 1, 2, 7]  # untouched
    # Another slot size, another grant: a grant names the slot's extent too.
    other = _tables.am_item_tags(keys[1].tobytes(), np.array([0], np.uint64), 4096)
    assert other[0] != items["pad"][0]
    a, b = _tables.am_connect_cap(keys[1].tobytes()), _tables.am_connect_cap(keys[2].tobytes())
    assert len(a) == 16 and a != b and a == _tables.am_connect_cap(keys[1].tobytes())


def test_a_keyed_sample_server_serves_only_authenticated_granted_requests():
    key = os.urandom(16)
    slot, slots = 4112, 8
    node = UcxRuntime(config=CONFIG, env_tls="tcp")
    learner = UcxRuntime(config=CONFIG, env_tls="tcp")
    arena = _native.MemoryRegion.write_protected(node.region_owner, slot * slots, False)
    arena.view()[:] = 0x5A
    server = _native.AmSampleServer(node.worker, arena)
    port = server.listen("127.0.0.1", 0, 16, key)
    worker = learner.reader_worker
    client = _native.AmSampleClient(worker)
    auth = _native.AmAuthClient(worker)
    layout = _native.BatchLayout(2, 0, np.array([16], np.uint64), np.array([4096], np.uint64),
                                 np.array([32], np.uint64))
    dest = learner.map_region(32 + 2 * 4096)
    offsets = np.array([0, 3 * slot], np.uint64)
    tags = _tables.am_item_tags(key, offsets, slot)

    def fetch(ep, tags, slot_size=slot):
        dest.view()[:] = 0
        got = client.fetch([ep], np.zeros(2, np.uint32), offsets, np.arange(2, dtype=np.uint64),
                           layout, dest, 2.0, tags=tags, slot_size=slot_size)
        return [_native.status_name(int(s)) for s in got], int(
            np.count_nonzero(dest.view()[32:] == 0x5A))

    try:
        silent = _native.Endpoint.to_listener(worker, "127.0.0.1", port, "node")
        assert silent.flush(5.0) == 0
        # Not authenticated: dropped unread, nothing sent.
        names, landed = fetch(silent, tags)
        assert landed == 0 and "UCS_OK" not in names
        assert server.stats["unauthorized"] >= 1
        wrong = _native.Endpoint.to_listener(worker, "127.0.0.1", port, "node")
        assert wrong.flush(5.0) == 0
        assert _native.status_name(auth.authenticate(
            wrong, AM_SAMPLE_AUTH_ID, os.urandom(16), 5.0)) == "UCS_ERR_REJECTED"
        good = _native.Endpoint.to_listener(worker, "127.0.0.1", port, "node")
        assert good.flush(5.0) == 0
        assert auth.authenticate(good, AM_SAMPLE_AUTH_ID, _tables.am_connect_cap(key), 5.0) == 0
        assert server.connections["open"] == 1
        names, landed = fetch(good, tags)
        assert names == ["UCS_OK"] * 2 and landed == 2 * 4096
        # A part past the slot its grant names: refused whole.
        names, landed = fetch(good, _tables.am_item_tags(key, offsets, 64), 64)
        assert landed == 0 and names == ["UCS_ERR_REJECTED"] * 2
        good2 = _native.Endpoint.to_listener(worker, "127.0.0.1", port, "node")
        assert good2.flush(5.0) == 0
        assert auth.authenticate(good2, AM_SAMPLE_AUTH_ID, _tables.am_connect_cap(key), 5.0) == 0
        names, landed = fetch(good2, tags ^ np.uint32(1))  # a forged grant
        assert landed == 0 and names == ["UCS_ERR_REJECTED"] * 2
        assert server.stats["held_bytes"] == 0
        for ep in (silent, wrong, good, good2):
            ep.close(True, 1.0)
    finally:
        auth.close()
        client.close()
        assert server.close(5.0)
        learner.close()
        node.close()
