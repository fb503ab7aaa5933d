"""Samples by active message end to end (client/gather.py, storage/
sample_server.py): over UCX tcp with same-host mapping off, what a learner
on another host sees. tests/integration/test_am_sample.py covers the native
path alone."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import distore_ucx as ds

pytestmark = pytest.mark.parametrize("tls", ["tcp"], indirect=True)

SPEC = {"obs": ((3, 100, 101), "uint8"), "action": ((), "int64"), "reward": ((), "float32"),
        "pair": ((3,), "int16")}


def make_items(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.integers(0, 256, (n, 3, 100, 101), dtype=np.uint8),
        "action": rng.integers(0, 18, n),
        "reward": rng.standard_normal(n).astype(np.float32),
        "pair": rng.integers(-999, 999, (n, 3), dtype=np.int16),
    }


def check_batches(learner, keys: np.ndarray, items: dict, batches: int) -> None:
    """`batches` batches, every field C-contiguous and equal to what was inserted."""
    order = np.argsort(keys)
    for _ in range(batches):
        batch = learner.sample()
        idx = order[np.searchsorted(keys, batch.keys, sorter=order)]
        assert np.array_equal(keys[idx], batch.keys)
        for name in SPEC:
            array = batch.data[name]
            assert array.flags.c_contiguous, (name, array.strides)
            assert np.shares_memory(np.ascontiguousarray(array), array), name  # no copy
            assert np.array_equal(array, items[name][idx]), name


@pytest.mark.parametrize("am", [True, False], ids=["active-messages", "gets"])
def test_remote_learner_reads_dense_batches_by_active_message(make_cluster, tls, am,
                                                              monkeypatch):
    # opt-in: nodes serve them and learners ask for them only when on
    monkeypatch.setenv("DISTORE_AM_SAMPLES", "1" if am else "0")
    cluster = make_cluster()
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=1000, spec=SPEC)
        items = make_items(400, seed=3)
        with client.writer(max_items=64) as writer:
            keys = writer.insert("t", items)
        with client.learner("t", batch_size=32) as learner:
            check_batches(learner, keys, items, 20)
            want = "ucx-am:tcp" if am else "ucx:tcp"
            assert set(learner.paths.values()) == {want}, learner.paths
            assert len(learner.paths) == 2
            fetched = learner.stats.fetched_items
            assert fetched["ucx-am" if am else "ucx"] >= 20 * 32, dict(fetched)
            assert fetched["ucx" if am else "ucx-am"] == 0, dict(fetched)
        # The node descriptor says which nodes serve samples by active message.
        assert all(bool(n.get("am_sample")) == am for n in client.nodes())


KILLED_LEARNER = textwrap.dedent("""
    import sys
    import distore_ucx as ds
    client = ds.connect(sys.argv[1])
    learner = client.learner("t", batch_size=32)
    assert set(learner.paths.values()) == {"ucx-am:tcp"}, learner.paths
    n = 0
    while True:
        learner.sample()
        n += 1
        print(n, flush=True)
""")


def test_learner_killed_mid_sample_leaves_the_node_serving(make_cluster, tls, tmp_path,
                                                          monkeypatch):
    monkeypatch.setenv("DISTORE_AM_SAMPLES", "1")  # opt-in
    cluster = make_cluster()
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=1000, spec=SPEC)
        items = make_items(300, seed=4)
        with client.writer(max_items=64) as writer:
            keys = writer.insert("t", items)
        for attempt in range(3):
            child = subprocess.Popen([sys.executable, "-c", KILLED_LEARNER, cluster.address],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=tmp_path)
            try:
                # Killed while its batches stream in: after its 3rd, 5th, 7th.
                for _ in range(3 + 2 * attempt):
                    line = child.stdout.readline()
                    assert line, child.stderr.read()[-3000:]
                child.send_signal(signal.SIGKILL)
            finally:
                child.kill()
                child.wait()
            with client.learner("t", batch_size=32) as learner:
                check_batches(learner, keys, items, 5)
                assert set(learner.paths.values()) == {"ucx-am:tcp"}
        nodes = client.status()["nodes"]
        assert len(nodes) == 2 and all(n["state"] == "live" for n in nodes), nodes
