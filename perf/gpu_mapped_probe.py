"""Probe for a future GPU read path: the GPU gathering sampled items straight
out of a storage node's read-only arena mapping.

Today a CUDA learner on a node's host copies each batch out of the node's
mapping into a pinned ring on the CPU, then to the device (perf/gpu_fetch.py
measures that path: 0.14-0.30x a pinned copy on a lent H200). This probe
asks whether the driver accepts what that path would need instead, and how
fast it is, without the store: a memfd "arena" of ``--arena`` bytes with a
known pattern, mapped read-only as learners map nodes' arenas, registered
with ``cudaHostRegister(Mapped | ReadOnly)``; per batch, one kernel copies
the batch's items (random slots, as sampled) from the mapping into device
memory. **Baseline, same run:** one pinned host-to-device copy of a batch's
bytes. Every batch's last copy is checked byte for byte against the mapping.
Needs CuPy and a CUDA GPU (CI has neither; it exits 2 saying so). Output:
JSON lines on stdout, then a short table. ::

    cd /tmp && python3 <repo>/perf/gpu_mapped_probe.py --arena 2G
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time

import numpy as np
from common import JsonLines, fmt, log, print_table, size_list

# (name, batch, item bytes): the workloads' W1 and R2D2 (perf/gpu_fetch.py's).
WORKLOADS = (("W1", 32, 112896), ("R2D2", 4, 10 << 20))
HEADER = 64  # bytes before each item in its slot, as the store's slots have
REGISTER_FLAGS = 2 | 8  # cudaHostRegisterMapped | cudaHostRegisterReadOnly
H2D = 1  # cudaMemcpyHostToDevice

GATHER = r"""
extern "C" __global__ void gather(const uint4* __restrict__ src,
                                  const unsigned long long* __restrict__ offsets,
                                  uint4* __restrict__ dst, unsigned long long n16) {
  const unsigned long long item = blockIdx.y;
  const uint4* s = src + offsets[item] / 16;
  uint4* d = dst + item * n16;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
       i < n16; i += (unsigned long long)gridDim.x * blockDim.x)
    d[i] = s[i];
}
"""


def make_arena(size: int) -> tuple[mmap.mmap, np.ndarray]:
    """A memfd of `size` bytes filled with a pattern, and its read-only
    mapping (kept open by the returned mmap) as a uint8 array."""
    fd = os.memfd_create("probe-arena")
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as rw:
            a = np.frombuffer(rw, np.uint8)
            pattern = (np.arange(1 << 20, dtype=np.uint64) * np.uint64(2654435761)).view(np.uint8)
            for off in range(0, size, pattern.size):
                a[off : off + pattern.size] = pattern[: min(pattern.size, size - off)]
            del a
        ro = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return ro, np.frombuffer(ro, np.uint8)


def measure(cp, kernel, src: np.ndarray, dev_src: int, name: str, batch: int, item: int,
            iters: int, rng) -> dict:
    """Kernel gathers out of the registered mapping against pinned copies:
    GB/s of item bytes each, and whether the last gathered batch is exact."""
    rt = cp.cuda.runtime
    slot = (HEADER + item + 63) // 64 * 64
    nslots = src.size // slot
    if nslots < batch:
        raise SystemExit(f"--arena holds {nslots} slots of {slot} bytes; {name} needs {batch}")
    draws = [np.sort(rng.choice(nslots, batch, replace=False)).astype(np.uint64)
             * np.uint64(slot) + np.uint64(HEADER) for _ in range(iters)]
    dst = cp.empty(batch * item, cp.uint8)
    pinned = cp.cuda.alloc_pinned_memory(batch * item)
    host = np.frombuffer(pinned, np.uint8, batch * item)
    stream = cp.cuda.Stream(non_blocking=True)
    n16 = cp.uint64(item // 16)

    def kernel_batch(k: int) -> None:
        offsets = cp.asarray(draws[k])
        with stream:
            kernel((64, batch), (256,), (cp.uint64(dev_src), offsets, dst, n16))
        stream.synchronize()

    def pinned_batch(k: int) -> None:
        rt.memcpyAsync(dst.data.ptr, host.ctypes.data, batch * item, H2D, stream.ptr)
        stream.synchronize()

    row = {"workload": name, "batch": batch, "item_bytes": item}
    for key, step in (("mapped_kernel_gbps", kernel_batch), ("pinned_copy_gbps", pinned_batch)):
        for k in range(3):  # warm-up
            step(k)
        t0 = time.perf_counter()
        for k in range(iters):
            step(k)
        row[key] = iters * batch * item / (time.perf_counter() - t0) / 1e9
        if step is kernel_batch:
            got = cp.asnumpy(dst).reshape(batch, item)
            last = draws[iters - 1]
            row["verified"] = bool(all(np.array_equal(got[i], src[int(o) : int(o) + item])
                                       for i, o in enumerate(last)))
    row["ratio"] = row["mapped_kernel_gbps"] / row["pinned_copy_gbps"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arena", type=size_list, default=[2 << 30], help="arena bytes (2G)")
    p.add_argument("--iters", type=int, default=100, help="timed batches per measurement")
    p.add_argument("--json-out", help="also write the JSON lines to this file")
    args = p.parse_args(argv)
    try:
        import cupy as cp
        cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no CuPy, no driver, or no GPU
        print(f"gpu_mapped_probe: needs CuPy and a CUDA GPU ({exc})", file=sys.stderr)
        return 2
    size = args.arena[0]
    log(f"filling a {size >> 20} MiB memfd arena")
    ro, src = make_arena(size)
    t0 = time.perf_counter()
    try:
        cp.cuda.runtime.hostRegister(src.ctypes.data, size, REGISTER_FLAGS)
    except Exception as exc:
        print(f"cudaHostRegister of a read-only mapping failed: {exc}", file=sys.stderr)
        return 1
    log(f"registered the read-only mapping in {time.perf_counter() - t0:.2f} s")
    rows = []
    try:
        kernel = cp.RawKernel(GATHER, "gather")
        rng = np.random.default_rng(0)
        with JsonLines(args.json_out) as out:
            for name, batch, item in WORKLOADS:
                # Unified addressing: a registered host pointer is a device pointer.
                row = measure(cp, kernel, src, src.ctypes.data, name, batch, item, args.iters,
                              rng)
                out.write(row)
                rows.append(row)
    finally:
        cp.cuda.runtime.hostUnregister(src.ctypes.data)
        del src
        ro.close()
    print_table(["workload", "batch", "item_B", "mapped_kernel", "pinned_copy", "ratio", "ok"],
                [[r["workload"], str(r["batch"]), str(r["item_bytes"]),
                  fmt(r["mapped_kernel_gbps"], ".2f"), fmt(r["pinned_copy_gbps"], ".2f"),
                  fmt(r["ratio"], ".2f"), "yes" if r["verified"] else "NO"] for r in rows])
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
