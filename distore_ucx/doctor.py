"""`distore doctor`: what this host offers a learner, and what is missing.

Reports the UCX that is loaded (version, and whether it is the PyPI wheel or
a system UCX), its transports and CUDA support (cuda_copy, cuda_ipc,
gdr_copy, InfiniBand), GPUs (through pynvml: name, memory, PCIe bus, NUMA
node), NICs, hugepages and the GPU frameworks, then one line per missing
piece of the GPU-direct path with what to install or set. It only reads:
nothing is changed, no network traffic is sent.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import asdict, dataclass, field

from .client.learner.device import cuda_present
from .errors import install_hint


@dataclass
class Report:
    """Everything doctor found; `missing` holds (what, how to fix) pairs."""

    ucx: dict = field(default_factory=dict)
    gpus: list = field(default_factory=list)
    gpu_error: str = ""
    nics: list = field(default_factory=list)
    rdma_devices: list = field(default_factory=list)
    hugepages: dict = field(default_factory=dict)
    local_map: dict = field(default_factory=dict)
    frameworks: dict = field(default_factory=dict)
    paths: dict = field(default_factory=dict)
    missing: list = field(default_factory=list)

    def to_dict(self) -> dict:
        """A JSON-serialisable form."""
        return asdict(self)


def _read(path: str, default: str = "") -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return default


def _numa(sysfs_device: str) -> int | None:
    text = _read(os.path.join(sysfs_device, "numa_node"))
    try:
        return int(text)
    except ValueError:
        return None


def ucx_info() -> dict:
    """Version, library file and origin, transports and memory types of the loaded UCX."""
    from ._native_loader import _native
    from .transport import capabilities

    lib = capabilities.library_path()
    info = {
        "version": _native.ucx_version(),
        "library": lib,
        "origin": capabilities.library_origin(lib),
        "prefer_system": os.environ.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", ""),
        "UCX_TLS": os.environ.get("UCX_TLS", ""),
    }
    try:
        import ucxx._lib.libucxx as ucxx

        ctx = ucxx.UCXContext(feature_flags=(ucxx.Feature.TAG, ucxx.Feature.RMA))
        caps = capabilities.query(ctx)
        info.update(
            memory_types=sorted(caps.memory_types),
            components=caps.components,
            transports=caps.transports,
            cuda=caps.cuda,
            cuda_copy=caps.cuda_copy,
            cuda_ipc=caps.cuda_ipc,
            gdr_copy=caps.gdr_copy,
            rdma=caps.rdma,
            gpu_direct=caps.gpu_direct,
            remote_inserts=_remote_inserts(caps.rdma),
            remote_samples=_remote_samples(caps.rdma),
        )
        del ctx
    except Exception as exc:  # report, do not fail: doctor runs on broken hosts
        info["error"] = f"cannot create a UCX context: {exc}"
    return info


def _remote_inserts(rdma: bool) -> str:
    """How a storage node on this host reads inserts from writers on other
    hosts (storage/pulls.py)."""
    from ._native_loader import _native
    from .config import am_insert_runs_enabled, am_min_item_bytes
    from .storage.pulls import am_inserts

    why_not = am_inserts(rdma)
    if why_not:
        return f"one-sided gets ({why_not})"
    runs = (f"items that fit several to {_native.AmInbox.run_bytes >> 20} MiB go several to a "
            "message, received through a bounce chunk (DISTORE_AM_INSERT_RUNS=0: one a message)"
            if am_insert_runs_enabled() else
            "one item a message (DISTORE_AM_INSERT_RUNS=0)")
    return (f"UCX active messages for items of {am_min_item_bytes() >> 10} KiB and more "
            "(rendezvous over connections to the node's insert listener, with peer-failure "
            "handling, received into the slots: UCX emulates RMA in software here; "
            f"DISTORE_AM_INSERTS=0 turns them off; {runs}), one-sided gets below")


def _remote_samples(rdma: bool) -> str:
    """How learners on other hosts read a storage node on this host
    (storage/sample_server.py)."""
    from .config import am_samples_enabled

    if not am_samples_enabled():
        return "one-sided gets (samples by active message switched off: DISTORE_AM_SAMPLES=0)"
    if rdma:
        return "one-sided gets (UCX has an RDMA transport)"
    return ("UCX active messages through the node's sample listener (rendezvous put_zcopy "
            "straight into the learner's ring: UCX emulates RMA here)")


def gpu_info() -> tuple[list[dict], str]:
    """GPUs through pynvml: ([{index, name, memory_bytes, pci_bus, numa_node}], error)."""
    try:
        import pynvml
    except ImportError:
        return [], f"pynvml is not installed ({install_hint('gpu')}, or nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return [], f"NVML cannot start ({exc}): no NVIDIA driver or no GPU"
    gpus = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            name = name.decode() if isinstance(name, bytes) else name
            bus = bus.decode() if isinstance(bus, bytes) else bus
            sysfs_bus = bus[-12:].lower()  # "00000000:3B:00.0" -> "0000:3b:00.0"
            gpus.append({
                "index": i,
                "name": name,
                "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                "pci_bus": sysfs_bus,
                "numa_node": _numa(f"/sys/bus/pci/devices/{sysfs_bus}"),
            })
    finally:
        pynvml.nvmlShutdown()
    return gpus, ""


def nic_info() -> tuple[list[dict], list[dict]]:
    """(network interfaces, RDMA devices) from sysfs, with NUMA nodes."""
    nics = []
    for name in sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []:
        if name == "lo":
            continue
        base = f"/sys/class/net/{name}"
        speed = _read(f"{base}/speed")
        nics.append({
            "name": name,
            "state": _read(f"{base}/operstate", "unknown"),
            "speed_mbps": int(speed) if speed.lstrip("-").isdigit() and int(speed) > 0 else None,
            "numa_node": _numa(f"{base}/device"),
            "driver": os.path.basename(os.path.realpath(f"{base}/device/driver"))
            if os.path.exists(f"{base}/device/driver") else "",
        })
    rdma = []
    ib = "/sys/class/infiniband"
    for name in sorted(os.listdir(ib)) if os.path.isdir(ib) else []:
        rdma.append({"name": name, "numa_node": _numa(f"{ib}/{name}/device")})
    return nics, rdma


def hugepage_info() -> dict:
    """Reserved 2 MiB pages and the transparent hugepage setting."""
    meminfo = {}
    for line in _read("/proc/meminfo").splitlines():
        key, _, value = line.partition(":")
        meminfo[key] = value.strip()
    thp = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    return {
        "total": int(meminfo.get("HugePages_Total", "0") or 0),
        "free": int(meminfo.get("HugePages_Free", "0") or 0),
        "size": meminfo.get("Hugepagesize", ""),
        "transparent": thp[thp.find("[") + 1 : thp.find("]")] if "[" in thp else thp,
    }


def local_map_info() -> dict:
    """Whether same-host learners can map storage arenas here: a memfd sealed
    against writable mappings, passed over a Unix socket (SCM_RIGHTS), maps
    read-only and refuses a writable mapping; and what pages arenas get."""
    import fcntl
    import mmap
    import socket

    from .storage.arena import page_advice, page_size_label

    out = {"works": False, "why": ""}
    hugepages = hugepage_info().get("total", 0) > 0
    kind = "hugetlb" if hugepages else "thp"
    out["arena_pages"] = page_size_label(kind)
    out["advice"] = page_advice(kind)
    seal_future_write = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
    fd = a = b = None
    try:
        fd = os.memfd_create("distore-doctor", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        os.ftruncate(fd, 1 << 16)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | seal_future_write | fcntl.F_SEAL_SEAL)
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        socket.send_fds(a, [b"x"], [fd])
        _, fds, _, _ = socket.recv_fds(b, 1, 1)
        try:
            with mmap.mmap(fds[0], 1 << 16, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ):
                pass
            try:
                mmap.mmap(fds[0], 1 << 16, flags=mmap.MAP_SHARED,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE).close()
                out["why"] = "the sealed memfd still allowed a writable mapping"
                return out
            except PermissionError:
                pass
        finally:
            for f in fds:
                os.close(f)
        out["works"] = True
    except (OSError, AttributeError) as exc:
        out["why"] = (f"{exc} (needs Linux >= 5.1 for F_SEAL_FUTURE_WRITE and Python >= 3.9); "
                      "same-host learners then read over UCX")
    finally:
        for s in (a, b):
            if s is not None:
                s.close()
        if fd is not None:
            os.close(fd)
    return out


def framework_info() -> dict:
    """torch / CuPy: installed version and whether they see a GPU."""
    out = {}
    for name in ("torch", "cupy"):
        if importlib.util.find_spec(name) is None:
            out[name] = {"installed": False}
            continue
        entry = {"installed": True}
        try:
            mod = importlib.import_module(name)
            entry["version"] = getattr(mod, "__version__", "")
            if name == "torch":
                entry["cuda_build"] = mod.version.cuda or ""
                entry["cuda_available"] = bool(mod.cuda.is_available())
            else:
                entry["cuda_available"] = mod.cuda.runtime.getDeviceCount() > 0
        except Exception as exc:  # CuPy raises when no driver is present
            entry["cuda_available"] = False
            entry["error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        out[name] = entry
    return out


def diagnose() -> Report:
    """Collect the report and list what the GPU-direct path lacks."""
    r = Report()
    r.ucx = ucx_info()
    r.gpus, r.gpu_error = gpu_info()
    r.nics, r.rdma_devices = nic_info()
    r.hugepages = hugepage_info()
    r.local_map = local_map_info()
    r.frameworks = framework_info()
    miss = r.missing.append
    has_gpu = bool(r.gpus) or cuda_present()
    if not has_gpu:
        miss(("GPU", "no NVIDIA GPU or driver found: learners sample into host memory "
                     "(device='cpu', path host). For device='cuda' install the NVIDIA driver "
                     "on a host with a GPU"))
    if not r.gpus and r.gpu_error and has_gpu:
        miss(("pynvml", r.gpu_error))
    if "error" in r.ucx:
        miss(("UCX context", r.ucx["error"]))
    elif not r.ucx.get("cuda"):
        miss(("UCX CUDA support", "the loaded UCX does not accept CUDA memory (cuda_copy not "
                                  "loaded): it needs libcuda.so.1 from the NVIDIA driver and a "
                                  "UCX built with CUDA (the libucx-cu12 wheel is)"))
    if not r.ucx.get("rdma"):
        miss(("InfiniBand / RoCE", "UCX has no verbs transport, so reads reach a GPU through "
                                   "host memory (path host-staged). GPUDirect RDMA needs an "
                                   "RDMA NIC with MLNX_OFED/rdma-core and a UCX built with "
                                   "verbs: export RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true to "
                                   "load the system UCX (HPC-X / MOFED)"))
    if has_gpu and not (os.path.isdir("/sys/module/nvidia_peermem")
                        or os.path.isdir("/sys/module/nv_peer_mem")):
        miss(("nvidia-peermem", "the kernel module that lets the NIC write GPU memory is not "
                                "loaded: sudo modprobe nvidia-peermem"))
    if has_gpu and not r.ucx.get("gdr_copy"):
        miss(("gdr_copy", "GDRCopy is not available to UCX (faster small GPU copies): install "
                          "gdrcopy and load its gdrdrv module"))
    if not any(f.get("cuda_available") for f in r.frameworks.values()):
        miss(("GPU framework", "neither torch nor CuPy can use a GPU here: pip install torch "
                               f"(a CUDA build) or CuPy on a GPU host ({install_hint('cupy')})"))
    if r.hugepages.get("total", 0) == 0:
        # What arenas get without reserved pages: transparent hugepages only
        # where shared-memory ones are on (arena_pages says which).
        pages = r.local_map.get("arena_pages", "4 KiB")
        then = ("so storage nodes use transparent hugepages" if pages.startswith("2 MiB")
                else "and shared-memory transparent hugepages are off, so storage nodes' "
                     "arenas get 4 KiB pages")
        miss(("hugepages", f"no reserved 2 MiB pages, {then}: "
                           "echo 1024 | sudo tee /proc/sys/vm/nr_hugepages"))
    if not r.local_map.get("works"):
        miss(("same-host mapping", r.local_map.get("why", "")))
    if r.local_map.get("advice"):
        miss(("arena pages", r.local_map["advice"]))
    if r.ucx.get("gpu_direct"):
        cuda_path = "gpu-direct"
    elif has_gpu:
        cuda_path = "host-staged"
    else:
        cuda_path = "unavailable (no GPU)"
    r.paths = {"cpu": "host", "cuda": cuda_path,
               "same-host nodes": "mapped" if r.local_map.get("works") else "ucx"}
    return r


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def format_report(r: Report) -> list[str]:
    """Human-readable lines of a report."""
    u = r.ucx
    lines = [f"UCX {u.get('version', '?')} from the {u.get('origin', '?')} "
             f"({u.get('library') or 'library path unknown'})"]
    if u.get("prefer_system"):
        lines.append(f"  RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY={u['prefer_system']}")
    if u.get("UCX_TLS"):
        lines.append(f"  UCX_TLS={u['UCX_TLS']}")
    if "error" in u:
        lines.append(f"  {u['error']}")
    else:
        lines.append(f"  transports: {', '.join(u['transports']) or 'none'}")
        lines.append(f"  memory types: {', '.join(u['memory_types'])}")
        flags = [f"{k}={'yes' if u[k] else 'no'}"
                 for k in ("cuda_copy", "cuda_ipc", "gdr_copy", "rdma")]
        lines.append(f"  CUDA support: {' '.join(flags)}")
        if u.get("remote_inserts"):
            lines.append(f"  inserts from other hosts: {u['remote_inserts']}")
        if u.get("remote_samples"):
            lines.append(f"  remote samples: {u['remote_samples']}")
    if r.gpus:
        for g in r.gpus:
            lines.append(f"GPU {g['index']}: {g['name']}, {_gib(g['memory_bytes'])}, "
                         f"PCIe {g['pci_bus']}, NUMA node {g['numa_node']}")
    else:
        lines.append(f"GPUs: none found ({r.gpu_error or 'NVML reports none'})")
    for n in r.nics:
        speed = f"{n['speed_mbps']} Mb/s" if n["speed_mbps"] else "speed unknown"
        lines.append(f"NIC {n['name']}: {n['state']}, {speed}, driver {n['driver'] or '?'}, "
                     f"NUMA node {n['numa_node']}")
    if not r.nics:
        lines.append("NICs: none besides loopback")
    for d in r.rdma_devices:
        lines.append(f"RDMA device {d['name']}: NUMA node {d['numa_node']}")
    if not r.rdma_devices:
        lines.append("RDMA devices: none (/sys/class/infiniband is empty)")
    h = r.hugepages
    lines.append(f"hugepages: {h.get('total', 0)} reserved ({h.get('free', 0)} free) of "
                 f"{h.get('size') or '?'}; transparent: {h.get('transparent') or '?'}")
    m = r.local_map
    lines.append(f"same-host mapping: {'works' if m.get('works') else 'NOT available'} "
                 f"(learners on a node's host read its arena read-only with plain loads); "
                 f"arena pages: {m.get('arena_pages', '?')}")
    for name, f in r.frameworks.items():
        if not f["installed"]:
            lines.append(f"{name}: not installed")
        else:
            extra = f", CUDA build {f['cuda_build']}" if f.get("cuda_build") else ""
            lines.append(f"{name} {f.get('version', '')}{extra}: GPU "
                         f"{'available' if f.get('cuda_available') else 'not available'}")
    lines.append(f"learner paths: device='cpu' -> {r.paths['cpu']}; "
                 f"device='cuda' -> {r.paths['cuda']}; same-host nodes -> "
                 f"{r.paths['same-host nodes']}")
    for what, fix in r.missing:
        lines.append(f"MISSING {what}: {fix}")
    if not r.missing:
        lines.append("nothing missing: the GPU-direct path is available")
    return lines
