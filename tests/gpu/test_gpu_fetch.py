"""Batches sampled into GPU memory (marked gpu: skipped with a reason without CUDA)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SPEC = {"obs": ((4, 21, 21), "uint8"), "action": ((), "int64"), "reward": ((), "float32")}


def gpu_framework() -> str:
    """torch if it sees a GPU, else CuPy; skips the test when neither does."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            return "torch"
    if importlib.util.find_spec("cupy") is not None:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cupy"
    pytest.skip("neither torch nor CuPy sees a CUDA GPU (pip install a CUDA build of torch)")


def to_numpy(x) -> np.ndarray:
    return x.cpu().numpy() if hasattr(x, "cpu") else x.get()


def synchronize(framework: str) -> None:
    if framework == "torch":
        import torch

        torch.cuda.synchronize()
    else:
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def make_cuda_context_current(framework: str) -> None:
    if framework == "torch":
        import torch

        torch.zeros(1, device="cuda:0")
    else:
        import cupy

        cupy.zeros(1)
    synchronize(framework)


def fill(client, n: int, seed: int):
    """Table "replay" of SPEC with n random items; (items, their keys)."""
    client.create_table("replay", capacity=2000, spec=SPEC)
    rng = np.random.default_rng(seed)
    items = {"obs": rng.integers(0, 256, (n, 4, 21, 21), dtype=np.uint8),
             "action": np.arange(n, dtype=np.int64),
             "reward": rng.standard_normal(n).astype(np.float32)}
    with client.writer() as writer:
        keys = writer.insert("replay", items)
    return items, keys


@pytest.fixture
def filled(client):
    items, keys = fill(client, 500, seed=7)
    return client, items, keys


def check(batch, items, keys, framework):
    idx = np.searchsorted(keys, batch.keys)
    assert np.array_equal(keys[idx], batch.keys)
    for name in SPEC:
        field = batch.data[name]
        assert str(getattr(field, "device", "cuda")).startswith("cuda") or framework == "cupy"
        # Dense [batch, *shape] per field: a model takes it without another copy.
        assert tuple(field.shape) == (len(batch.keys), *items[name].shape[1:]), name
        dense = field.is_contiguous() if framework == "torch" else field.flags.c_contiguous
        assert dense, f"{name} is not C-contiguous on the device"
        assert np.array_equal(to_numpy(field), items[name][idx]), name


@pytest.mark.parametrize("path", ["host-staged", "gpu-direct"])
def test_sampled_bytes_on_the_device_equal_inserted_bytes(filled, tls, path):
    client, items, keys = filled
    framework = gpu_framework()
    from distore_ucx.transport import capabilities

    if path == "gpu-direct" and not capabilities.query(client.runtime.context).cuda:
        pytest.skip("the loaded UCX does not accept CUDA memory (see `distore doctor`)")
    learner = client.learner("replay", batch_size=32, device="cuda:0", prefetch=2,
                             framework=framework, path=path)
    assert learner.path == path
    for _ in range(5):
        check(learner.sample(), items, keys, framework)
    for i, batch in enumerate(learner):  # prefetching: 2 batches in flight
        synchronize(framework)
        check(batch, items, keys, framework)
        if i == 20:
            break
    kept = batch.clone()
    learner.close()
    check(kept, items, keys, framework)


def test_host_ring_is_pinned_when_cuda_is_present(filled, tls):
    framework = gpu_framework()
    if framework != "torch":
        pytest.skip("pinning is checked through torch")
    import torch

    client, items, keys = filled
    learner = client.learner("replay", batch_size=8, framework="torch")
    batch = learner.sample()
    assert learner.path == "host" and isinstance(batch.data["obs"], torch.Tensor)
    assert batch.data["obs"].is_pinned()
    idx = np.searchsorted(keys, batch.keys)
    assert np.array_equal(batch.data["obs"].numpy(), items["obs"][idx])
    learner.close()


def test_gpu_direct_with_cuda_transports(make_cluster, tls, monkeypatch):
    """gpu-direct where the learner's UCX has its CUDA transports (the test
    transports alone have none, so the parametrized test above skips it):
    UCX reads the node's arena straight into device memory."""
    framework = gpu_framework()
    monkeypatch.setenv("UCX_TLS", f"{tls},cuda_copy,cuda_ipc")
    import distore_ucx as ds
    from distore_ucx.transport import capabilities

    cluster = make_cluster()
    client = ds.connect(cluster.address)
    try:
        if not capabilities.query(client.runtime.context).cuda:
            pytest.skip("the loaded UCX has no CUDA transport (see `distore doctor`)")
        # A CUDA context current on this thread when the writer registers its
        # (read-only) staging memory: UCX's cuda_copy would pin it, and
        # pinning a read-only mapping fails (native/memory.cc).
        make_cuda_context_current(framework)
        items, keys = fill(client, 300, seed=11)
        learner = client.learner("replay", batch_size=32, device="cuda:0", prefetch=2,
                                 framework=framework, path="gpu-direct")
        assert learner.path == "gpu-direct"
        for _ in range(10):
            batch = learner.sample()
            synchronize(framework)
            check(batch, items, keys, framework)
        learner.close()
    finally:
        client.close()
