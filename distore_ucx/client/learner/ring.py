"""The learner's ring of destination buffers, one batch each.

Each slot is mapped with UCX once, at start, and reused: on the "host" path
a page-aligned host region (pinned with cudaHostRegister when CUDA is
present); on "gpu-direct" a device buffer registered as CUDA memory; on
"host-staged" both, a pinned host region the gather writes and a device
buffer one asynchronous copy per batch fills.

A slot holds its batch as a structure of arrays (spec.BatchLayout): the
items' slot headers in one (n, 2) array the learner checks, and each field
in its own C-contiguous [n, *shape] array, so `batch.data[f]` is dense on
every path. The per-field views of every slot are made once, too: handing
out a batch costs no allocation. A batch's views stay valid until its slot
comes round again (`len(ring)` batches later).

Ordering with the GPU (both GPU paths): before a slot is written again, the
work the consumer enqueued on its current stream while it held that slot's
batch must be done (a "release" event recorded when the consumer takes its
next batch); the consumer's stream waits for the staging copy before it
uses a batch. Thread safety: the ring is driven by one producer thread and
one consumer thread; `acquire`/`fill`/`headers` are the producer's,
`hand_out`/`release` the consumer's, and
a slot is released before the producer may refill it.
"""

from __future__ import annotations

import logging

import numpy as np

from ..._native_loader import _native
from ...spec import SLOT_HEADER
from .device import CudaOps, Device, host_cuda_ops, host_header_view, host_views

log = logging.getLogger(__name__)

CUDA_MEMORY = 1  # ucs_memory_type_t UCS_MEMORY_TYPE_CUDA


class _Slot:
    __slots__ = ("dest", "host", "device", "device_address", "data", "header", "copied",
                 "released")

    def __init__(self):
        self.dest = None  # the MemoryRegion the gather writes
        self.host = None  # numpy uint8 view of the host region, if any
        self.device = None  # device buffer (torch tensor / cupy array), if any
        self.device_address = 0
        self.data = None  # cached per-field views handed out as batch.data
        self.header = None  # (n, 2) header view (host numpy or device)
        self.copied = None  # event: staging copy done
        self.released = None  # event: consumer done with the last batch here


class Ring:
    """`slots` destination buffers of `batch_size` items each.

    >>> ring = Ring(runtime, spec, batch_size=32, slots=3, device=Device("cpu"),
    ...             framework="numpy", path="host")
    """

    def __init__(self, runtime, spec, batch_size: int, slots: int, device: Device,
                 framework: str, path: str):
        self.path = path
        self.framework = framework
        self.batch_size = batch_size
        self.layout = spec.layout(batch_size)
        # The same layout for the native readers: where each field's bytes
        # lie in a node's slot, and where its array lies in a ring slot.
        self._slot_size = spec.slot_size
        self.reads = _native.BatchLayout(
            batch_size, self.layout.header,
            np.array([SLOT_HEADER + f.offset for f in spec.fields], np.uint64),
            np.array([f.nbytes for f in spec.fields], np.uint64),
            np.array(self.layout.offsets, np.uint64))
        nbytes = self.layout.nbytes
        self.nbytes = nbytes
        self._runtime = runtime
        self._staging = None  # see staging()
        self._pinned: list[int] = []
        self._pin_ok = True
        self._slots: list[_Slot] = []
        if path == "host":
            self._ops = host_cuda_ops(framework)
        else:
            self._ops = CudaOps(framework, device)
        try:
            for _ in range(slots):
                self._slots.append(self._make_slot(runtime, spec, nbytes))
        except BaseException:
            self.close()
            raise
        log.debug("ring: %d slots of %d bytes, path=%s, pinned=%s", slots, nbytes, path,
                  bool(self._pinned))

    def _make_slot(self, runtime, spec, nbytes: int) -> _Slot:
        s = _Slot()
        layout = self.layout
        if self.path in ("host", "host-staged"):
            region = runtime.map_region(nbytes)
            s.dest, s.host = region, region.view()
            # Touch every page now: the first batches would otherwise pay a
            # page fault per 4 KiB of destination.
            s.host.fill(0)
            s.header = host_header_view(spec, s.host, layout)
            if self._ops is not None and self._pin_ok:
                try:
                    self._ops.pin(region.address, region.size)
                    self._pinned.append(region.address)
                except Exception as exc:  # still correct unpinned, only slower
                    self._pin_ok = False
                    log.warning("cannot pin the learner's host ring (%s): host-to-device "
                                "copies will not be asynchronous", exc)
        if self.path == "host":
            s.data = host_views(spec, s.host, layout, self.framework)
            return s
        s.device, address = self._ops.allocate(nbytes)
        s.device_address = address
        s.data = self._ops.views(spec, s.device, layout)
        if self.path == "gpu-direct":
            s.dest = _native.MemoryRegion.register(runtime.region_owner, address, nbytes,
                                                   s.device, CUDA_MEMORY)
            s.header = self._ops.header_view(s.device, layout)
        return s

    def __len__(self) -> int:
        return len(self._slots)

    # -- producer side ----------------------------------------------------
    def acquire(self, i: int):
        """Slot i's gather destination, once nothing still uses its bytes."""
        s = self._slots[i]
        if s.copied is not None:  # the last staging copy out of the host region
            CudaOps.synchronize(s.copied)
        if self.path == "gpu-direct" and s.released is not None:
            # UCX writes device memory outside any stream: wait on the host.
            CudaOps.synchronize(s.released)
            s.released = None
        return s.dest

    def staging(self):
        """Host memory where UCX reads whole slots, one get each (or a run of
        them that follow each other in a node's arena), before they
        are copied into a ring slot's arrays (_native.gather_dense): where RMA
        is emulated (TCP) a get per header and per field costs a round trip
        each. Made on first use (learners reading only mapped nodes never
        need it); None for a device ring (gpu-direct: one get per part)."""
        if self.path == "gpu-direct":
            return None
        if self._staging is None:
            # Slots staged a slot size apart, as in a node's arena, so that
            # a run of them is one get (_native.gather_dense's slot_stride).
            region = self._runtime.map_region(self.batch_size * self._slot_size)
            region.view().fill(0)  # fault its pages in now, not during a read
            self._staging = region
        return self._staging

    def headers(self, i: int) -> np.ndarray:
        """(n, 2) uint64 [key, generation] of every row of slot i, on the host."""
        s = self._slots[i]
        if self.path == "gpu-direct":  # one small device-to-host read per check
            return self._ops.to_host(s.header).view(np.uint64)
        return s.header

    def fill(self, i: int, n: int) -> None:
        """The gather of n items into slot i is complete: stage it to the
        device if needed. The whole slot goes in one copy (headers and every
        field's array: the layout is fixed, n is always the batch size)."""
        if self.path != "host-staged":
            return
        s = self._slots[i]
        nbytes = self.nbytes
        s.copied = self._ops.copy_to_device(s.device, s.device_address, s.dest.address, s.host,
                                            nbytes, wait_for=s.released)
        s.released = None

    # -- consumer side ----------------------------------------------------
    def hand_out(self, i: int):
        """The data views of slot i for the consumer (its stream made to wait
        for the staging copy). Returns a fresh dict each time, so callers
        can add to it."""
        s = self._slots[i]
        if self.path == "host-staged" and s.copied is not None:
            self._ops.wait_current(s.copied)
        return dict(s.data) if isinstance(s.data, dict) else s.data

    def release(self, i: int) -> None:
        """Slot i may be refilled after the work the consumer has enqueued so
        far (GPU paths: an event on its current stream; host: nothing)."""
        if self.path != "host":
            self._slots[i].released = self._ops.record_current()

    def release_all(self) -> None:
        """release() every slot with one event."""
        if self.path != "host":
            event = self._ops.record_current()
            for s in self._slots:
                s.released = event

    def close(self) -> None:
        """Wait for copies in flight, unpin, and drop every buffer (unmapped when
        the last view of it goes)."""
        for s in self._slots:
            if s.copied is not None:
                CudaOps.synchronize(s.copied)
        if self._ops is not None:
            for address in self._pinned:
                try:
                    self._ops.unpin(address)
                except Exception as exc:  # unpinning is best effort at teardown
                    log.debug("cudaHostUnregister: %s", exc)
        self._pinned.clear()
        self._slots.clear()
        self._staging = None
