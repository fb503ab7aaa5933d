"""The runtime's reader worker (transport/runtime.py): a second UCX worker with
no progress thread, through which a storage node's pull thread reads
writers' staged batches (storage/pulls.py).

Two runtimes in one process over TCP: a 'writer' whose registered buffer is
readable remotely (its own progress thread answers the emulated gets) and a
'node' that reads it through its reader worker, from this thread alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from distore_ucx._native_loader import _native
from distore_ucx.errors import ConnectionFailed
from distore_ucx.storage.arena import Arena
from distore_ucx.storage.pulls import Source
from distore_ucx.transport import UcxRuntime

ITEM, SLOT = 3000, 4096


@pytest.fixture
def pair():
    with UcxRuntime(config={"TLS": "tcp"}) as writer, \
            UcxRuntime(config={"TLS": "tcp"}) as node:
        yield writer, node


def test_a_pull_through_the_reader_worker_lands_whole(pair):
    writer, node = pair
    staged = writer.map_region(1 << 16, remote_read=True)
    rows = np.random.default_rng(3).integers(0, 256, (8, ITEM), dtype=np.uint8)
    staged.view()[: rows.size] = rows.ravel()

    ep = node.endpoint(writer.address, "writer", reader=True)
    assert node.reader_worker is not node.worker
    assert node.endpoint(writer.address, "writer", reader=True) is ep  # made once
    assert node.endpoint(writer.address, "writer") is not ep  # the other worker's own
    rkey = _native.RemoteKey(ep, staged.pack_rkey(), staged.address, staged.size, "writer")
    src = Source("writer", "ucx", staged.address, staged.size, worker=node.reader_worker,
                 rkey=rkey)

    arena = Arena(node, 1 << 20)
    slots = np.arange(8, dtype=np.uint64)[::-1] * np.uint64(SLOT)
    keys = np.arange(500, 508, dtype=np.uint64)
    gens = arena.next_generations(8)
    offsets = np.uint64(staged.address) + np.arange(8, dtype=np.uint64) * np.uint64(ITEM)
    for _ in range(3):  # and again: the endpoint stays usable between pulls
        statuses = arena.pull(src, slots, keys, gens, offsets, np.full(8, ITEM, np.uint64), 10.0)
        assert not statuses.any(), statuses
        node.progress_reader()  # what the node does between pulls; nothing to fail
    view = arena.region.view()
    for i, s in enumerate(slots.astype(np.int64)):
        assert np.array_equal(view[s + 16: s + 16 + ITEM], rows[i])
        assert view[s: s + 16].view(np.uint64).tolist() == [keys[i], gens[i]]


def test_dropping_a_peer_closes_its_endpoints_on_both_workers(pair):
    writer, node = pair
    on_reader = node.endpoint(writer.address, "writer", reader=True)
    on_main = node.endpoint(writer.address, "writer")
    node.drop_endpoint(writer.address)
    assert not on_reader.alive and not on_main.alive
    assert node.endpoint(writer.address, "writer", reader=True) is not on_reader  # made anew


def test_a_closed_runtime_has_no_reader_worker():
    rt = UcxRuntime(config={"TLS": "tcp"})
    rt.progress_reader()  # none made yet: nothing to do
    assert rt.reader_worker is not None
    rt.close()
    rt.progress_reader()  # closed: a no-op, not a crash
    with pytest.raises(ConnectionFailed, match="closed"):
        rt.reader_worker  # noqa: B018
