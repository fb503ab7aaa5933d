"""Devices, frameworks, the sample-path choice and UCX capabilities."""

from __future__ import annotations

import numpy as np
import pytest

from distore_ucx.client.learner.device import (
    Device,
    choose_path,
    host_header_view,
    host_views,
    resolve_framework,
)
from distore_ucx.errors import ConfigError
from distore_ucx.spec import TableSpec
from distore_ucx.transport import capabilities
from distore_ucx.transport.capabilities import UcxCapabilities

SPEC = TableSpec.parse({"obs": ((3, 5), "uint8"), "reward": ((), "float32")})

INFO_WITH_GPU_AND_IB = """#
#     component 0  :  self
#     component 1  :  tcp
#     component 2  :  cuda_cpy
#     component 3  :  ib
#     component 4  :  gdr_copy
#
#      resource 0  :  md 0  dev 0  flags -- self/memory
#      resource 1  :  md 1  dev 1  flags -- tcp/eth0
#      resource 2  :  md 2  dev 2  flags -- cuda_copy/cuda
#      resource 3  :  md 3  dev 3  flags -- rc_mlx5/mlx5_0:1
#      resource 4  :  md 4  dev 4  flags -- gdr_copy/cuda
"""


def caps(memory_types, info=""):
    comps, tls = capabilities.parse_info(info)
    return UcxCapabilities(set(memory_types), comps, tls)


def test_device_names():
    assert Device.parse("cpu") == Device("cpu")
    assert Device.parse("cuda") == Device("cuda", 0)
    assert Device.parse("CUDA:3") == Device("cuda", 3)
    assert str(Device.parse("cuda:1")) == "cuda:1"
    for bad in ("gpu", "cuda:x", "cuda:-1", ""):
        with pytest.raises(ConfigError, match="expected 'cpu', 'cuda' or 'cuda:N'"):
            Device.parse(bad)


def test_frameworks():
    cpu, gpu = Device("cpu"), Device("cuda", 0)
    assert resolve_framework(cpu, None) == "numpy"
    with pytest.raises(ConfigError, match="GPU memory only"):
        resolve_framework(cpu, "cupy")
    with pytest.raises(ConfigError, match="host memory only"):
        resolve_framework(gpu, "numpy")
    with pytest.raises(ConfigError, match="expected one of"):
        resolve_framework(cpu, "jax")


def test_path_follows_ucx_capabilities():
    cpu, gpu = Device("cpu"), Device("cuda", 0)
    assert choose_path(cpu, None) == "host"
    no_cuda = caps({"host"})
    cuda_only = caps({"host", "cuda"}, "#     component 0  :  cuda_cpy\n")
    cuda_rdma = caps({"host", "cuda"}, INFO_WITH_GPU_AND_IB)
    assert choose_path(gpu, no_cuda) == "host-staged"
    assert choose_path(gpu, cuda_only) == "host-staged"  # UCX would stage in fragments
    assert choose_path(gpu, cuda_rdma) == "gpu-direct"
    assert choose_path(gpu, cuda_rdma, "host-staged") == "host-staged"
    assert choose_path(gpu, cuda_only, "gpu-direct") == "gpu-direct"
    with pytest.raises(ConfigError, match="does not accept CUDA memory.*distore doctor"):
        choose_path(gpu, no_cuda, "gpu-direct")
    with pytest.raises(ConfigError, match="needs a GPU device"):
        choose_path(cpu, None, "host-staged")
    with pytest.raises(ConfigError, match="expected 'auto'"):
        choose_path(gpu, no_cuda, "fast")


def test_info_text_is_parsed():
    c = caps({"host", "cuda"}, INFO_WITH_GPU_AND_IB)
    assert c.components == ["self", "tcp", "cuda_cpy", "ib", "gdr_copy"]
    assert "rc_mlx5/mlx5_0:1" in c.transports
    assert c.cuda and c.cuda_copy and c.gdr_copy and c.rdma and not c.cuda_ipc


def test_loaded_ucx_is_queried():
    import ucxx._lib.libucxx as ucxx

    ctx = ucxx.UCXContext(feature_flags=(ucxx.Feature.TAG, ucxx.Feature.RMA))
    c = capabilities.query(ctx)
    assert "host" in c.memory_types
    assert "self" in c.components and c.transports
    path = capabilities.library_path()
    assert "libucp.so" in path
    assert capabilities.library_origin(path) in ("wheel", "system")


def test_host_views_are_dense_and_share_the_buffer():
    layout = SPEC.layout(4)
    buf = np.zeros(layout.nbytes, np.uint8)
    views = host_views(SPEC, buf, layout, "numpy")
    views["obs"][2] = 7
    obs_at = layout.offsets[0]
    assert np.shares_memory(views["obs"], buf) and buf[obs_at + 2 * 15] == 7
    for v in views.values():
        assert v.flags.c_contiguous
    header = host_header_view(SPEC, buf, layout)
    header[1] = (11, 12)
    assert buf[16:32].view(np.uint64).tolist() == [11, 12]


def test_dlpack_round_trip_without_copies():
    torch = pytest.importorskip("torch", reason="torch not installed (pip install '.[torch]')")
    layout = SPEC.layout(4)
    buf = np.zeros(layout.nbytes, np.uint8)
    tensors = host_views(SPEC, buf, layout, "torch")
    assert isinstance(tensors["obs"], torch.Tensor) and tensors["obs"].shape == (4, 3, 5)
    assert tensors["reward"].dtype == torch.float32
    assert all(t.is_contiguous() for t in tensors.values())
    numpy_views = host_views(SPEC, buf, layout, "numpy")
    numpy_views["reward"][:] = [1, 2, 3, 4]
    assert tensors["reward"].tolist() == [1, 2, 3, 4]  # same memory, no copy
    back = np.from_dlpack(tensors["obs"])
    assert np.shares_memory(back, buf) and back.strides == numpy_views["obs"].strides
    assert tensors["obs"].data_ptr() == buf.ctypes.data + layout.offsets[0]
    assert torch.utils.dlpack.to_dlpack(tensors["reward"]) is not None  # still DLPack-able


def test_gpu_ring_views_follow_the_host_layout():
    # The GPU ring's views (CudaOps.views / header_view) over a torch buffer,
    # here a CPU tensor: the same arrays at the same offsets as host_views.
    torch = pytest.importorskip("torch", reason="torch not installed (pip install '.[torch]')")
    from distore_ucx.client.learner.device import CudaOps

    spec = TableSpec.parse({"obs": ((3, 5), "uint8"), "action": ((), "int64"),
                            "reward": ((2,), "float32")})
    layout = spec.layout(4)
    buf = np.random.default_rng(0).integers(0, 256, layout.nbytes, dtype=np.uint8)
    ops = CudaOps.__new__(CudaOps)  # no GPU here: only the view arithmetic
    ops.framework, ops._torch = "torch", torch
    device = ops.views(spec, torch.from_numpy(buf), layout)
    host = host_views(spec, buf, layout, "numpy")
    for name, v in host.items():
        assert device[name].is_contiguous() and tuple(device[name].shape) == v.shape
        assert np.array_equal(device[name].numpy(), v)
    header = ops.header_view(torch.from_numpy(buf), layout)
    assert np.array_equal(header.numpy().view(np.uint64), host_header_view(spec, buf, layout))
