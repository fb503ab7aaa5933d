"""The servers' event loop end to end: a cluster serves on uvloop by default
and on asyncio's loop with DISTORE_UVLOOP=0 (transport/event_loop.py), and
says which in its start-up log."""

from __future__ import annotations

import numpy as np
import pytest

SPEC = {"obs": ((3072,), "uint8"), "key": ((), "uint64")}


def _items(n: int) -> dict:
    k = np.arange(n, dtype=np.uint64)
    return {"obs": (k[:, None] * 3 + np.arange(3072)).astype(np.uint8), "key": k}


@pytest.mark.parametrize("tls", ["tcp", "mapped"], indirect=True)
@pytest.mark.parametrize("uvloop", ["1", "0"])
def test_inserts_and_samples_on_either_loop(make_cluster, tls, uvloop, monkeypatch):
    import distore_ucx as ds

    if uvloop == "1":
        expect = f"uvloop {pytest.importorskip('uvloop').__version__}"
    else:
        expect = "asyncio"
    monkeypatch.setenv("DISTORE_UVLOOP", uvloop)
    cluster = make_cluster(log_level="INFO")
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=1_000, spec=SPEC)
        with client.writer(max_items=8) as writer:  # many small batches, as actors send
            writer.insert("t", _items(200))
        assert client.table_info("t")["size"] == 200
        with client.learner("t", batch_size=64) as learner:
            batch = learner.sample(timeout=30)
            obs = (batch.data["key"][:, None] * 3 + np.arange(3072)).astype(np.uint8)
            assert np.array_equal(batch.data["obs"], obs)
    assert f"(event loop {expect})" in cluster.control.log_tail(200)
    for node in cluster.nodes:
        assert f"event loop {expect}" in node.log_tail(200)
