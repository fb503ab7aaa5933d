"""distore_ucx.ray.deploy on a local multi-node Ray cluster (ray.cluster_utils)."""

from __future__ import annotations

import shutil
import tempfile
import time
import urllib.request

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install '.[ray]')")

import distore_ucx as ds  # noqa: E402
import distore_ucx.ray as dray  # noqa: E402

SPEC = {"obs": ((256,), "uint8"), "key": ((), "uint64")}


@pytest.fixture
def ray_cluster(monkeypatch, tmp_path):
    """A head and one worker Ray node on this machine; always torn down, and
    their folders with them (Ray's session folders, the deployed processes'
    distore-ray-* log folders)."""
    from ray.cluster_utils import Cluster

    # Ray puts the driver's working directory on its workers' sys.path: from
    # a source checkout that would import the uncompiled package there.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # Every Ray process and actor makes its temporary folders here (a short
    # path: Ray's Unix sockets live under it), removed after the test.
    scratch = tempfile.mkdtemp(prefix="dray-")
    monkeypatch.setenv("TMPDIR", scratch)
    monkeypatch.setenv("RAY_TMPDIR", scratch)
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 << 20})
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    try:
        cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="distore-test", log_to_driver=False)
        yield cluster
    finally:
        try:
            if ray.is_initialized():
                dray.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.slow
def test_deploy_puts_one_storage_node_on_each_ray_node(ray_cluster, tmp_path):
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
    # The processes listen on the Ray nodes' addresses: no token, no store.
    with pytest.raises(ds.ConfigError, match="pass token_file=.*or insecure=True"):
        dray.deploy(arena="32MiB", hugepages=False, env=env)
    with pytest.raises(ds.ConfigError, match="no store named"):
        dray.address()  # nothing was started
    token = tmp_path / "token"
    token.write_text("a-shared-secret-of-32-bytes-long\n")
    address = dray.deploy(arena="32MiB", hugepages=False, env=env, heartbeat_timeout=1.0,
                          token_file=str(token), metrics_port="auto", node_metrics_port="auto")
    assert dray.address() == address
    targets = dray.metrics_targets()  # control plane first, then each storage node
    assert len(targets) == 3
    for target in targets:
        text = urllib.request.urlopen(f"http://{target}/metrics", timeout=10).read().decode()
        assert "process_cpu_seconds_total" in text
    assert "distore_nodes" in urllib.request.urlopen(
        f"http://{targets[0]}/metrics", timeout=10).read().decode()
    placed = dray.storage_nodes()
    ray_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(ray_nodes) == 2
    assert {p["ray_node_id"] for p in placed} == ray_nodes  # one per Ray node, pinned

    with pytest.raises(ds.AuthenticationFailed):
        ds.connect(address, timeout=5).status()
    with ds.connect(address, token_file=str(token)) as client:
        status = client.status()
        assert sorted(n["node_id"] for n in status["nodes"] if n["alive"]) == sorted(
            p["node_id"] for p in placed)
        assert {n["name"] for n in status["nodes"]} == {
            f"ray-{p['ray_node_id'][:12]}" for p in placed}
        client.create_table("t", capacity=1000, spec=SPEC)
        with client.writer(max_items=20) as writer:
            k = np.arange(200, dtype=np.uint64)
            writer.insert("t", {"obs": (k[:, None] + np.arange(256)).astype(np.uint8),
                                "key": k})
        with client.learner("t", batch_size=16) as learner:
            for _ in range(10):
                b = learner.sample()
                expect = (b.data["key"][:, None] + np.arange(256)).astype(np.uint8)
                assert np.array_equal(b.data["obs"], expect)

        with pytest.raises(ds.ConfigError, match="already deployed"):
            dray.deploy(arena="32MiB", env=env)

        dray.shutdown()
        deadline = time.monotonic() + 20
        while True:  # the control plane process is gone: nothing answers
            # A client waits up to its timeout for a control plane that may
            # be restarting (this test's took 30 s): ask with a short one,
            # and count only a refused or lost connection (not a slow answer).
            try:
                with ds.connect(address, timeout=1.0, token_file=str(token)) as probe:
                    probe.status()
            except ds.ConnectionFailed:
                break
            except ds.Timeout:
                pass
            assert time.monotonic() < deadline, "the store still answers after shutdown"
            time.sleep(0.1)
    with pytest.raises(ds.ConfigError, match="no store named"):
        dray.address()


def test_deploy_without_ray_connection_says_so():
    if ray.is_initialized():
        pytest.skip("a Ray session is open in this process")
    with pytest.raises(ds.ConfigError, match="ray.init"):
        dray.deploy()
