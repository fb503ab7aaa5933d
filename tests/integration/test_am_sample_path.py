"""Samples by active message end to end (client/learner/gather.py, storage/
sample_server.py): over UCX tcp with same-host mapping off, what a learner
on another host sees: learners connect to each node's sample listener, with
peer-failure handling. tests/integration/test_am_sample.py covers the
native path alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import numpy as np
import pytest
from helpers import wait_for
from prometheus_client.parser import text_string_to_metric_families

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
    # On by default; DISTORE_AM_SAMPLES=0 turns it off on nodes and learners.
    if am:
        monkeypatch.delenv("DISTORE_AM_SAMPLES", raising=False)
    else:
        monkeypatch.setenv("DISTORE_AM_SAMPLES", "0")
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
        # The node descriptor says which nodes serve samples by active
        # message, and the port of their listener.
        assert all(bool(n.get("am_sample")) == am for n in client.nodes())
        assert all(bool(n.get("sample_port")) == am for n in client.nodes())


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


def node_sample_metrics(cluster) -> dict:
    """Both nodes' sample counters (/metrics), summed: failed and done
    batches, stuck ones, batches in flight, learners' connections open."""
    names = {"distore_node_sample_batches_stuck": "stuck",
             "distore_node_sample_batches_in_flight": "in_flight",
             "distore_node_sample_connections": "connections",
             "distore_node_sample_run_messages_total": "runs"}
    got = {"failed": 0.0, "done": 0.0, "stuck": 0.0, "in_flight": 0.0, "connections": 0.0,
           "runs": 0.0}
    for role, url in cluster.metrics_urls().items():
        if not role.startswith("node"):
            continue
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                if sample.name == "distore_node_sample_batches_total":
                    outcome = sample.labels.get("outcome")
                    if outcome in ("failed", "done"):
                        got[outcome] += sample.value
                elif sample.name in names:
                    got[names[sample.name]] += sample.value
    return got


KILLS = 24  # learners SIGKILLed mid-stream, ROUNDS at a time
ROUND = 4


def test_learners_killed_mid_sample_leave_the_node_serving(make_cluster, tls, tmp_path,
                                                           monkeypatch):
    monkeypatch.delenv("DISTORE_AM_SAMPLES", raising=False)  # on by default
    cluster = make_cluster(metrics=True)
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=1000, spec=SPEC)
        items = make_items(300, seed=4)
        with client.writer(max_items=64) as writer:
            keys = writer.insert("t", items)
        for attempt in range(KILLS // ROUND):
            children = [subprocess.Popen([sys.executable, "-c", KILLED_LEARNER, cluster.address],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, cwd=tmp_path) for _ in range(ROUND)]
            try:
                # Killed while its batches stream in: after its 2nd to 5th.
                for k, child in enumerate(children):
                    for _ in range(2 + (attempt + k) % 4):
                        line = child.stdout.readline()
                        assert line, child.stderr.read()[-3000:]
                    child.send_signal(signal.SIGKILL)
            finally:
                for child in children:
                    child.kill()
                    child.wait()
                    child.stdout.close()
                    child.stderr.close()
        # Every dead learner's batches end (their sends fail: peer-failure
        # handling), none is left to UCX, and their connections are closed.
        wait_for(lambda: (lambda m: m["in_flight"] == 0 and m["connections"] == 0)(
            node_sample_metrics(cluster)), 40.0, "the dead learners' batches and connections "
            "to be gone", lambda: node_sample_metrics(cluster))
        m = node_sample_metrics(cluster)
        print(f"{KILLS} learners killed: {m}")
        assert m["failed"] >= 1 and m["stuck"] == 0, m
        # Items of 30 KB go in runs (a field of a node's items that follow
        # one another in a batch, in one message from a bounce chunk); the
        # killed learners' failed runs gave their chunks back: the next
        # batches still go in runs.
        assert m["runs"] > 0, m
        time.sleep(2.5)  # the nodes' counters, read each second, are all in
        before = node_sample_metrics(cluster)["runs"]
        with client.learner("t", batch_size=32) as learner:
            check_batches(learner, keys, items, 5)
            assert set(learner.paths.values()) == {"ucx-am:tcp"}
        time.sleep(2.5)
        runs = node_sample_metrics(cluster)["runs"] - before
        # At least one run per field a batch; never more messages than the
        # 5 batches' 32 items x 4 fields.
        assert 5 * 4 <= runs <= 5 * 4 * 32, (runs, m)
        nodes = client.status()["nodes"]
        assert len(nodes) == 2 and all(n["state"] == "live" for n in nodes), nodes


@pytest.mark.parametrize("iterate", [False, True], ids=["sample", "iterated"])
def test_a_node_stopped_mid_batch_is_routed_around(make_cluster, tls, monkeypatch, iterate):
    # A stopped node (SIGSTOP) keeps its sockets open and answers nothing:
    # the learner's fetch gives up after its stall, force-closes the
    # endpoint, and resamples; the control plane marks the node unresponsive.
    # Iterated, batches read ahead are also re-checked at hand-out by a
    # headers-only request to the stopped node, which gives up the same way.
    monkeypatch.delenv("DISTORE_AM_SAMPLES", raising=False)
    cluster = make_cluster()
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=1000, spec=SPEC)
        items = make_items(300, seed=5)
        with client.writer(max_items=64) as writer:
            keys = writer.insert("t", items)
        with client.learner("t", batch_size=32) as learner:
            if iterate:
                next(iter(learner))  # sample() now takes the prefetch thread's batches
            check_batches(learner, keys, items, 3)
            assert set(learner.paths.values()) == {"ucx-am:tcp"}, learner.paths
            victim = cluster.nodes[0]
            os.kill(victim.pid, signal.SIGSTOP)
            try:
                stopped = time.monotonic()
                longest = 0.0
                while time.monotonic() - stopped < 5.0:
                    t0 = time.monotonic()
                    check_batches(learner, keys, items, 1)
                    longest = max(longest, time.monotonic() - t0)
            finally:
                os.kill(victim.pid, signal.SIGCONT)
            assert longest < 3.0, longest  # the heartbeat timeout and a margin
        wait_for(lambda: all(n["state"] == "live" for n in client.status()["nodes"]), 15.0,
                 "the stopped node to be live again", lambda: client.status()["nodes"])
        # It serves by active message again.
        with client.learner("t", batch_size=32) as learner:
            check_batches(learner, keys, items, 5)
            assert set(learner.paths.values()) == {"ucx-am:tcp"}, learner.paths
            assert learner.stats.fetched_items["ucx-am"] >= 5 * 32
