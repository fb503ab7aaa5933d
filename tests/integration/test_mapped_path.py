"""The same-host mapped read path end to end: mixed batches, forcing UCX,
node restarts, tokens."""

from __future__ import annotations

import os

import pytest
from helpers import check_keyed, keyed_items

import distore_ucx as ds

SPEC = {"obs": ((4000,), "uint8"), "key": ((), "uint64")}


def items(keys_from: int, n: int) -> dict:
    return keyed_items(keys_from, n, 4000, mult=7)


def check(batch) -> None:
    check_keyed(batch, 4000, mult=7)


def fill(client, table="t", n=400, start=0):
    with client.writer(max_items=50) as writer:
        for i in range(start, start + n, 50):
            writer.insert(table, items(i, 50))


@pytest.mark.parametrize("tls", ["tcp", "sm"], indirect=True)
def unmapped(tls: str) -> str:
    """How a same-host node that is not mapped is read: over shared memory
    with process_vm_readv ("cma", a dead node cannot abort us), else UCX:
    over tcp, where UCX emulates RMA, the node sends samples as active messages."""
    return "cma" if tls == "sm" else f"ucx-am:{tls}"


def test_one_batch_mixes_mapped_and_ucx_nodes(make_cluster, tls, monkeypatch):
    monkeypatch.setenv("DISTORE_LOCAL_MAP", "1")
    cluster = make_cluster(nodes=1)
    cluster.add_node(extra_args=["--no-write-protect"])  # cannot share: read over UCX
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=10_000, spec=SPEC)
        fill(client)
        with client.learner("t", batch_size=64) as learner:
            assert sorted(learner.paths.values()) == sorted(["mapped", unmapped(tls)])
            for _ in range(40):
                check(learner.sample())
            assert learner.resampled == 0


def test_local_map_off_reads_over_ucx(make_cluster, tls, monkeypatch):
    monkeypatch.setenv("DISTORE_LOCAL_MAP", "1")
    cluster = make_cluster(nodes=2)
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=10_000, spec=SPEC)
        fill(client)
        with client.learner("t", batch_size=32, local_map=False) as learner:
            assert set(learner.paths.values()) == {unmapped(tls)}
            check(learner.sample())
        monkeypatch.setenv("DISTORE_LOCAL_MAP", "0")
        with client.learner("t", batch_size=32) as learner:
            assert set(learner.paths.values()) == {unmapped(tls)}
            check(learner.sample())


def test_a_restarted_node_is_mapped_anew_never_stale(make_cluster, monkeypatch):
    monkeypatch.setenv("DISTORE_LOCAL_MAP", "1")
    cluster = make_cluster(nodes=2)
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=10_000, spec=SPEC)
        fill(client)
        learner = client.learner("t", batch_size=64)
        old = dict(learner.paths)
        assert set(old.values()) == {"mapped"}
        for _ in range(5):
            check(learner.sample())
        cluster.kill_node(0)
        new = cluster.add_node().info["node_id"]
        fill(client, n=400, start=10_000)
        for _ in range(60):
            check(learner.sample(timeout=10))
        assert learner.paths.get(new) == "mapped"
        assert len(learner.paths) == 2  # the dead node's mapping is gone
        learner.close()


def test_mapping_with_a_token(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTORE_LOCAL_MAP", "1")
    monkeypatch.delenv("DISTORE_TOKEN_FILE", raising=False)
    token = tmp_path / "token"
    token.write_bytes(os.urandom(32).hex().encode())
    token.chmod(0o600)
    with ds.LocalCluster(nodes=2, arena_bytes=16 << 20, token_file=str(token),
                         env={"UCX_TLS": "tcp"}, log_level="WARNING") as cluster:
        with ds.connect(cluster.address, token_file=str(token)) as client:
            client.create_table("t", capacity=1000, spec=SPEC)
            fill(client)
            with client.learner("t", batch_size=32) as learner:
                assert set(learner.paths.values()) == {"mapped"}
                for _ in range(10):
                    check(learner.sample())


@pytest.mark.parametrize("tls", ["tcp", "sm", "mapped"], indirect=True)
def test_learner_reaches_every_node_when_created_not_on_first_sample(make_cluster, tls):
    # Endpoints, remote keys and mappings are made by client.learner(), so the
    # first sample costs what a warm one does (perf/latency.py --first-sample).
    cluster = make_cluster(nodes=2)
    with ds.connect(cluster.address) as client:
        client.create_table("t", capacity=1000, spec=SPEC)
        fill(client, n=100)
        with client.learner("t", batch_size=16) as learner:
            ids = {n["node_id"] for n in client.nodes()}
            assert set(learner.paths) == ids  # before any sample
            check(learner.sample())
