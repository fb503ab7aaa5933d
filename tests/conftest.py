"""Shared fixtures: real local clusters over tcp and shared memory.

Every cluster a test starts is stopped by the fixture, also when the test
fails; LocalCluster's children also die with the test process.
"""

from __future__ import annotations

import os
import shutil

import pytest

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCX_LOG_LEVEL", "error")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
# The test processes and every client process they start load UCX before
# running any thread of their own: UCX's grace period after patching each
# memory function (50 ms, for other threads running it) only adds 0.4 s of
# a core to each of the suite's hundreds of process starts (distore node
# sets it so for itself; see cli.py).
os.environ.setdefault("UCX_MEM_BISTRO_GRACE_DURATION", "0")

TRANSPORTS = ["tcp", "sm"]
# Read paths a test can ask for with
#   @pytest.mark.parametrize("tls", ["tcp", "sm", "mapped"], indirect=True)
# "tcp"/"sm": learners read over UCX with that UCX_TLS (same-host mapping
# off); "mapped": UCX_TLS=sm and same-host learners map the nodes' arenas.


def _has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidia0")


# The fast lane (`pytest -m "not slow"`): every unit test and the end-to-end
# smoke test (tests/integration/test_smoke.py, marked `smoke`). Every other
# test that starts real processes (tests/integration, tests/cluster) is in the
# slow lane, so a new integration test is never silently added to the fast one.
SLOW_DIRS = ("integration", "cluster")


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    no_rdma = pytest.mark.skip(reason="needs RDMA hardware (InfiniBand/RoCE); none here")
    has_rdma = os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")
    for item in items:
        folder = item.path.parent.name
        if folder in SLOW_DIRS and "smoke" not in item.keywords and "slow" not in item.keywords:
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and not _has_cuda():
            item.add_marker(no_gpu)
        if "rdma" in item.keywords and not has_rdma:
            item.add_marker(no_rdma)


def _read_path_env(monkeypatch, path: str) -> str:
    """Set the environment of read path `path` (see `tls`); its UCX_TLS."""
    mapped = path == "mapped"
    value = "sm" if mapped else path
    monkeypatch.setenv("UCX_TLS", value)
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # loopback only, never another interface
    monkeypatch.setenv("DISTORE_LOCAL_MAP", "1" if mapped else "0")
    return value


@pytest.fixture(params=TRANSPORTS)
def tls(request, monkeypatch):
    """UCX_TLS for the test and every process it starts ("mapped": sm, with
    same-host learners reading mapped arenas; otherwise mapping is off so
    that the UCX read path is what runs)."""
    return _read_path_env(monkeypatch, request.param)


@pytest.fixture
def make_cluster(tls):
    """Factory of LocalClusters over `tls`; all are stopped after the test."""
    import distore_ucx as ds

    clusters = []

    def make(**kwargs):
        kwargs.setdefault("nodes", 2)
        kwargs.setdefault("arena_bytes", 64 << 20)
        kwargs.setdefault("log_level", "WARNING")
        cluster = ds.LocalCluster(env={"UCX_TLS": tls}, **kwargs)
        clusters.append(cluster)
        return cluster.start()

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(scope="module")
def module_clusters():
    """LocalClusters that a module's tests share, one per read path, each
    started with that path's environment (as `make_cluster` starts one) when
    a test first asks for it and stopped after the module: a cluster's start
    and stop cost ~0.8 s of the suite's 2 busy cores each time. Only for tests
    that leave nothing another test sees: a table of their own (no table is
    ever dropped), no node stopped or killed, no store-wide figure asserted
    (used bytes, table lists). Tests ask through `shared_cluster`."""
    import distore_ucx as ds

    clusters = {}

    def get(path: str, **kwargs):
        """The cluster of read path `path` started with `kwargs` (as make_cluster's)."""
        key = (path, tuple(sorted(kwargs.items())))
        if key not in clusters:
            with pytest.MonkeyPatch.context() as mp:
                value = _read_path_env(mp, path)
                kwargs.setdefault("nodes", 2)
                kwargs.setdefault("arena_bytes", 64 << 20)
                kwargs.setdefault("log_level", "WARNING")
                clusters[key] = ds.LocalCluster(env={"UCX_TLS": value}, **kwargs).start()
        return clusters[key]

    yield get
    for cluster in clusters.values():
        cluster.stop()


@pytest.fixture
def shared_cluster(module_clusters, tls, request):
    """The running two-node LocalCluster of this module and read path (the
    test's `tls` parameter), shared with the module's other tests: see
    `module_clusters` for what a test that uses it may not do."""
    return module_clusters(request.node.callspec.params["tls"])


@pytest.fixture
def shared_client(shared_cluster):
    """A client connected to `shared_cluster`, closed after the test."""
    import distore_ucx as ds

    c = ds.connect(shared_cluster.address)
    yield c
    c.close()


@pytest.fixture
def cluster(make_cluster):
    """A running two-node LocalCluster."""
    return make_cluster()


@pytest.fixture
def client(cluster):
    """A client connected to `cluster`, closed after the test."""
    import distore_ucx as ds

    c = ds.connect(cluster.address)
    yield c
    c.close()


@pytest.fixture
def token_file(tmp_path, monkeypatch):
    """A fresh store token in a file only its owner reads (DISTORE_TOKEN_FILE unset)."""
    monkeypatch.delenv("DISTORE_TOKEN_FILE", raising=False)
    path = tmp_path / "token"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return str(path)
