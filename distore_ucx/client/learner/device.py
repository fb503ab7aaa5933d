"""Where sampled batches land: device names, frameworks and the sample path.

A learner's device is "cpu" or "cuda[:N]"; its framework is what
`batch.data` holds: numpy arrays or torch tensors on the CPU, torch tensors
or CuPy arrays on a GPU. torch and CuPy are imported only when asked for
(or, for pinning host memory, when already imported): a CPU learner never
pays for them.

The sample path follows from the device and from what the loaded UCX can do
(see transport/capabilities.py):

- "host": device="cpu"; UCX reads into a page-aligned host ring.
- "gpu-direct": UCX reads straight into GPU memory (it accepts CUDA memory
  and has an RDMA transport: GPUDirect RDMA).
- "host-staged": UCX reads into a pinned host ring; one asynchronous
  host-to-device copy per batch on a CUDA stream moves it to the GPU.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

import numpy as np

from ...config import local_map_default
from ...errors import ConfigError, install_hint
from ...transport import capabilities

log = logging.getLogger(__name__)

PATHS = ("host", "gpu-direct", "host-staged")
FRAMEWORKS = ("numpy", "torch", "cupy")


@dataclass(frozen=True)
class Device:
    """A parsed device name: kind "cpu" or "cuda", and the GPU index."""

    kind: str
    index: int = 0

    @classmethod
    def parse(cls, name: str) -> Device:
        """'cpu', 'cuda' or 'cuda:N'.

        >>> Device.parse("cuda:1")
        Device(kind='cuda', index=1)
        """
        text = str(name).strip().lower()
        if text == "cpu":
            return cls("cpu")
        if text == "cuda" or text.startswith("cuda:"):
            idx = text[5:] or "0"
            if idx.isdigit():
                return cls("cuda", int(idx))
        raise ConfigError(f"device {name!r}: expected 'cpu', 'cuda' or 'cuda:N'")

    @property
    def is_cuda(self) -> bool:
        """True for a GPU."""
        return self.kind == "cuda"

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


def resolve_framework(device: Device, framework: str | None) -> str:
    """The framework for `device`: the one asked for, checked, or the default
    (numpy on the CPU; torch on a GPU if installed, else CuPy)."""
    if framework is None:
        if not device.is_cuda:
            return "numpy"
        framework = "torch" if _importable("torch") else "cupy"
    if framework not in FRAMEWORKS:
        raise ConfigError(f"framework {framework!r}: expected one of {', '.join(FRAMEWORKS)}")
    if device.is_cuda and framework == "numpy":
        raise ConfigError("framework 'numpy' holds host memory only: use device='cpu', "
                          "or framework='torch' / 'cupy' for a GPU")
    if not device.is_cuda and framework == "cupy":
        raise ConfigError("framework 'cupy' holds GPU memory only: use device='cuda:N', "
                          "or framework='numpy' / 'torch' for device='cpu'")
    if framework != "numpy" and not _importable(framework):
        extra = "torch" if framework == "torch" else "cupy"
        raise ConfigError(f"framework {framework!r} is not installed: {install_hint(extra)}")
    return framework


def choose_path(device: Device, caps, forced: str = "auto") -> str:
    """The sample path for `device` given UCX capabilities `caps`
    (a transport.capabilities.UcxCapabilities); `forced` overrides "auto"."""
    if forced not in ("auto",) + PATHS:
        raise ConfigError(f"path {forced!r}: expected 'auto' or one of {', '.join(PATHS)}")
    if not device.is_cuda:
        if forced not in ("auto", "host"):
            raise ConfigError(f"path {forced!r} needs a GPU device; device='cpu' uses 'host'")
        return "host"
    if forced == "host":
        raise ConfigError("path 'host' is for device='cpu'; a GPU learner uses 'gpu-direct' "
                          "or 'host-staged'")
    if forced == "gpu-direct" and not caps.cuda:
        raise ConfigError(
            "path 'gpu-direct': the loaded UCX does not accept CUDA memory (no CUDA modules "
            "loaded: NVIDIA driver missing, or a UCX built without CUDA); run `distore doctor`, "
            "or use path='host-staged'"
        )
    if forced != "auto":
        return forced
    return "gpu-direct" if caps.gpu_direct else "host-staged"


def cuda_present() -> bool:
    """Cheap check for an NVIDIA driver with a GPU, without importing CUDA libraries."""
    return os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia/gpus")


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


# -- typed views of one gathered buffer -------------------------------------
# A ring slot holds a batch as a structure of arrays (spec.BatchLayout): an
# (n, 2) header array and one C-contiguous [n, *shape] array per field, on
# the host and on a GPU alike.
def host_views(spec, buffer: np.ndarray, layout, framework: str):
    """Per-field dense views (numpy, or torch CPU tensors through DLPack: no copy)."""
    views = spec.views(buffer, layout)
    if framework == "numpy":
        return views
    import torch

    if isinstance(views, dict):
        return {k: torch.from_dlpack(v) for k, v in views.items()}
    return torch.from_dlpack(views)


def host_header_view(spec, buffer: np.ndarray, layout) -> np.ndarray:
    """(n, 2) uint64 view of every item's slot header (key, generation)."""
    return spec.header_view(buffer, layout)


class CudaOps:
    """The few CUDA operations a GPU ring needs, from torch or CuPy.

    Allocation, typed strided views, a side stream for staging copies,
    events, pinning host memory and small device-to-host reads.
    """

    def __init__(self, framework: str, device: Device):
        if framework not in ("torch", "cupy"):
            raise ConfigError(f"a GPU ring needs torch or cupy, not {framework!r}")
        self.framework = framework
        self.device = device
        if framework == "torch":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(
                    f"device {device}: torch sees no CUDA GPU (torch "
                    f"{torch.__version__}, CUDA build: {torch.version.cuda}); install a CUDA "
                    "build of torch or run `distore doctor`"
                )
            self._torch = torch
            self._dev = torch.device("cuda", device.index)
            self.stream = torch.cuda.Stream(device=self._dev)
        else:
            import cupy

            self._cupy = cupy
            self._dev = cupy.cuda.Device(device.index)
            with self._dev:
                self.stream = cupy.cuda.Stream(non_blocking=True)

    # memory
    def allocate(self, nbytes: int):
        """A device buffer of nbytes: (owner object, address)."""
        if self.framework == "torch":
            t = self._torch.empty(nbytes, dtype=self._torch.uint8, device=self._dev)
            return t, t.data_ptr()
        with self._dev:
            a = self._cupy.empty(nbytes, self._cupy.uint8)
        return a, a.data.ptr

    def views(self, spec, buffer, layout):
        """Per-field dense views of a device buffer laid out like host_views
        (`layout` aligns every array to 64 bytes, so any dtype can be viewed)."""
        out = {}
        for f, offset in zip(spec.fields, layout.offsets):
            out[f.name] = self._view(buffer, f.dtype, (layout.rows,) + f.shape, offset)
        return out[""] if spec.unnamed else out

    def header_view(self, buffer, layout):
        """(n, 2) int64 device view of the slot headers (read back with to_host)."""
        return self._view(buffer, np.dtype(np.int64), (layout.rows, 2), layout.header)

    def _view(self, buffer, dtype: np.dtype, shape, byte_offset: int):
        """A C-contiguous typed view of `buffer` (uint8) from byte_offset."""
        count = int(np.prod(shape, dtype=np.int64))
        if self.framework == "torch":
            torch = self._torch
            tdtype = torch.from_numpy(np.empty(0, dtype)).dtype
            raw = buffer[byte_offset:byte_offset + count * dtype.itemsize]
            return raw.view(tdtype).view(shape)
        return self._cupy.ndarray(shape, dtype, memptr=buffer.data + byte_offset)

    def to_host(self, x) -> np.ndarray:
        """A small device array copied to a numpy array (synchronous)."""
        if self.framework == "torch":
            return x.cpu().numpy()
        return x.get()

    # host memory pinning (cudaHostRegister)
    def pin(self, address: int, size: int) -> None:
        """Page-lock host memory so copies from it are asynchronous DMA."""
        if self.framework == "torch":
            rc = self._torch.cuda.cudart().cudaHostRegister(address, size, 0)
            if int(rc) != 0:
                raise ConfigError(f"cudaHostRegister of {size} bytes failed ({rc}); "
                                  "check the memlock limit (ulimit -l)")
        else:
            self._cupy.cuda.runtime.hostRegister(address, size, 0)

    def unpin(self, address: int) -> None:
        """Undo pin()."""
        if self.framework == "torch":
            self._torch.cuda.cudart().cudaHostUnregister(address)
        else:
            self._cupy.cuda.runtime.hostUnregister(address)

    # streams and events
    def copy_to_device(self, dst, dst_address: int, src_address: int, src_host: np.ndarray,
                       nbytes: int, wait_for=None):
        """Enqueue one host-to-device copy on the side stream after `wait_for`
        (an event or None); returns an event recorded after it."""
        if self.framework == "torch":
            torch = self._torch
            with torch.cuda.stream(self.stream):
                if wait_for is not None:
                    self.stream.wait_event(wait_for)
                dst[:nbytes].copy_(torch.from_dlpack(src_host[:nbytes]), non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            return ev
        cupy = self._cupy
        with self._dev:
            if wait_for is not None:
                self.stream.wait_event(wait_for)
            cupy.cuda.runtime.memcpyAsync(dst_address, src_address, nbytes,
                                          cupy.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
            ev = cupy.cuda.Event()
            ev.record(self.stream)
        return ev

    def record_current(self):
        """An event on the calling thread's current stream: everything the
        caller has enqueued so far (its work on the batch it held)."""
        if self.framework == "torch":
            ev = self._torch.cuda.Event()
            ev.record(self._torch.cuda.current_stream(self._dev))
            return ev
        with self._dev:
            ev = self._cupy.cuda.Event()
            ev.record(self._cupy.cuda.get_current_stream())
        return ev

    def wait_current(self, event) -> None:
        """Make the calling thread's current stream wait for `event`."""
        if self.framework == "torch":
            self._torch.cuda.current_stream(self._dev).wait_event(event)
        else:
            with self._dev:
                self._cupy.cuda.get_current_stream().wait_event(event)

    @staticmethod
    def synchronize(event) -> None:
        """Block the calling thread until `event` has completed."""
        event.synchronize()


def host_cuda_ops(framework: str) -> CudaOps | None:
    """CudaOps for pinning a host ring when CUDA is present, else None.

    Only a framework the learner already uses (torch) or one already imported
    by the program is used: a numpy learner on a GPU host does not import
    torch just to pin its ring.
    """
    import sys

    if not cuda_present():
        return None
    for name in ("torch", "cupy"):
        if name == framework or name in sys.modules:
            try:
                return CudaOps(name, Device("cuda", 0))
            except Exception:  # no usable CUDA in that framework: stay unpinned
                continue
    return None


def read_settings(runtime, dev: Device, path: str, copy_threads: int | None,
                   local_map: bool | None, table: str) -> tuple[str, int, bool]:
    """How a learner reads: (its path, copy threads, whether it maps
    same-host nodes), from what was asked and what this machine has."""
    caps = capabilities.query(runtime.context) if dev.is_cuda else None
    path = choose_path(dev, caps, path)
    if copy_threads is None:
        copy_threads = max(2, min(4, os.cpu_count() or 2))
    if copy_threads < 1:
        raise ConfigError(f"copy_threads must be >= 1, got {copy_threads}")
    if local_map is None:
        local_map = local_map_default()
    if local_map and path == "gpu-direct":
        log.info("learner on table %r: gpu-direct ring is device memory; same-host nodes "
                 "are read over UCX", table)
        local_map = False
    return path, copy_threads, local_map
