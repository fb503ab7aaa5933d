"""What the loaded UCX can do: memory types, transports, where it came from.

Two sources, both read from a live UCP context:

- `ucp_context_query` with `UCP_ATTR_FIELD_MEMORY_TYPES` (called through
  ctypes on the already-loaded `libucp.so.0`: one stable C call, not worth a
  native rebuild) says which memory types the context accepts as buffers.
  CUDA is in it only when UCX loaded its CUDA modules (driver present).
- The context's info text (what `ucx_info -d` prints per context) names the
  memory domains ("components") and transport resources, e.g.
  `cuda_cpy`, `gdr_copy`, `ib`, `rc_mlx5/mlx5_0:1`.

ucxx's `UCXContext.cuda_support` is not used: it only reflects whether
UCX_TLS allows CUDA transports ("all" does), and is True on a host with no
GPU at all.
"""

from __future__ import annotations

import ctypes
import logging
import re
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# ucs_memory_type_t (ucs/memory/memory_type.h), in order.
MEMORY_TYPES = ("host", "cuda", "cuda-managed", "rocm", "rocm-managed", "rdma",
                "ze-host", "ze-device", "ze-managed")
_UCP_ATTR_FIELD_MEMORY_TYPES = 1 << 2
# Transports that move bytes between a remote host and GPU memory without a
# host bounce buffer of ours (GPUDirect RDMA through verbs).
_RDMA_TRANSPORTS = ("rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs", "ud_mlx5", "rc", "dc")


class _ContextAttr(ctypes.Structure):
    # ucp_context_attr_t up to memory_types, then room for the fields newer
    # UCX versions append (name[32], device_counter_size, ...).
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("request_size", ctypes.c_size_t),
        ("thread_mode", ctypes.c_int),
        ("memory_types", ctypes.c_uint64),
        ("_rest", ctypes.c_char * 512),
    ]


def _libucp():
    # Binds to the UCX that libucx.load_library() already loaded (same SONAME).
    from .._native_loader import _native  # noqa: F401  (loads UCX first)

    lib = ctypes.CDLL("libucp.so.0")
    lib.ucp_context_query.argtypes = [ctypes.c_void_p, ctypes.POINTER(_ContextAttr)]
    lib.ucp_context_query.restype = ctypes.c_int
    return lib


def memory_types(context) -> set[str]:
    """Memory types a UCP context accepts (`ucp_context_query`), e.g. {"host", "cuda"}.

    `context`: a ucxx UCXContext (or anything with a `.handle`).
    """
    attr = _ContextAttr()
    attr.field_mask = _UCP_ATTR_FIELD_MEMORY_TYPES
    status = _libucp().ucp_context_query(ctypes.c_void_p(context.handle), ctypes.byref(attr))
    if status != 0:
        log.warning("ucp_context_query failed (status %d); assuming host memory only", status)
        return {"host"}
    return {name for bit, name in enumerate(MEMORY_TYPES) if attr.memory_types >> bit & 1}


@dataclass
class UcxCapabilities:
    """What one UCP context offers: memory types, components, transports."""

    memory_types: set[str]
    components: list[str]  # memory domains' components: self, tcp, cma, cuda_cpy, ib, ...
    transports: list[str]  # transport resources: "tcp/lo", "cuda_copy/cuda", ...
    tl_names: set[str] = field(init=False)

    def __post_init__(self) -> None:
        self.tl_names = {t.split("/", 1)[0] for t in self.transports}

    @property
    def cuda(self) -> bool:
        """UCX accepts CUDA device memory as a buffer (its CUDA modules loaded)."""
        return "cuda" in self.memory_types

    @property
    def cuda_copy(self) -> bool:
        """The cuda_copy transport (host <-> device copies inside UCX)."""
        return "cuda_copy" in self.tl_names or "cuda_cpy" in self.components

    @property
    def cuda_ipc(self) -> bool:
        """The cuda_ipc transport (GPU to GPU on one host)."""
        return "cuda_ipc" in self.tl_names or "cuda_ipc" in self.components

    @property
    def gdr_copy(self) -> bool:
        """gdr_copy (GDRCopy: CPU maps GPU memory, low-latency small copies)."""
        return "gdr_copy" in self.tl_names or "gdr_copy" in self.components

    @property
    def rdma(self) -> bool:
        """A verbs transport (InfiniBand / RoCE)."""
        return "ib" in self.components or bool(self.tl_names & set(_RDMA_TRANSPORTS))

    @property
    def gpu_direct(self) -> bool:
        """Remote reads can land in GPU memory without our staging: UCX takes
        CUDA memory and has an RDMA transport to write it (GPUDirect RDMA).

        Without RDMA, UCX would stage CUDA destinations itself in small
        fragments; one large copy of our own per batch is faster, so that
        case counts as not direct.
        """
        return self.cuda and self.rdma


def parse_info(info: str) -> tuple[list[str], list[str]]:
    """(components, transport resources) named in a UCP context's info text."""
    components = re.findall(r"#\s+component \d+\s*:\s*(\S+)", info)
    transports = re.findall(r"#\s+resource \d+\s*:.*flags \S*\s+(\S+)", info)
    return components, transports


def query(context) -> UcxCapabilities:
    """Capabilities of a ucxx UCXContext."""
    components, transports = parse_info(str(getattr(context, "info", "") or ""))
    return UcxCapabilities(memory_types(context), components, transports)


def library_path() -> str:
    """File of the libucp actually mapped into this process ('' if unknown)."""
    from .._native_loader import _native  # noqa: F401  (loads UCX first)

    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                if "libucp.so" in line:
                    return line.split(None, 5)[-1].strip()
    except OSError:
        pass
    return ""


def library_origin(path: str) -> str:
    """'wheel' (libucx from PyPI), 'system' or 'unknown' for a libucp path."""
    if not path:
        return "unknown"
    return "wheel" if "site-packages/libucx" in path or "dist-packages/libucx" in path else "system"
