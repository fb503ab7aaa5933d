"""The learner's destination ring on the host path: reuse and view lifetime."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from distore_ucx.client.learner.device import Device
from distore_ucx.client.learner.ring import Ring
from distore_ucx.spec import TableSpec

SPEC = TableSpec.parse({"obs": ((3, 5), "uint8"), "action": ((), "int64")})


@pytest.fixture(scope="module")
def runtime():
    from distore_ucx.transport import UcxRuntime

    rt = UcxRuntime(progress_thread=False)
    yield rt
    rt.close()


def write(ring, slot, value):
    """What a gather would do: fill slot's whole destination region."""
    dest = ring.acquire(slot)
    dest.view()[:] = value
    ring.fill(slot, ring.batch_size)


def test_slots_are_reused_and_views_live_until_the_slot_comes_round(runtime):
    ring = Ring(runtime, SPEC, batch_size=4, slots=3, device=Device("cpu"),
                framework="numpy", path="host")
    assert len(ring) == 3 and ring.nbytes == SPEC.layout(4).nbytes
    batches = []
    for i in range(3):
        write(ring, i, i + 1)
        batches.append(ring.hand_out(i))
    for i, data in enumerate(batches):  # each slot still holds its own batch
        assert np.all(data["obs"] == i + 1)
        assert all(v.flags.c_contiguous for v in data.values())
    write(ring, 0, 9)  # slot 0 comes round again: its old views show the new batch
    assert np.all(batches[0]["obs"] == 9) and np.all(batches[1]["obs"] == 2)
    again = ring.hand_out(0)
    assert again is not batches[0]  # a fresh dict over the same cached views
    assert again["obs"] is batches[0]["obs"]


def test_regions_are_page_aligned_and_outlive_the_ring_while_viewed(runtime):
    ring = Ring(runtime, SPEC, batch_size=2, slots=2, device=Device("cpu"),
                framework="numpy", path="host")
    dest = ring.acquire(1)
    assert dest.address % 4096 == 0
    write(ring, 1, 5)
    data = ring.hand_out(1)
    headers = ring.headers(1)
    assert headers.shape == (2, 2) and headers.dtype == np.uint64
    ring.close()
    del dest
    gc.collect()
    assert np.all(data["obs"] == 5)  # the view keeps its region mapped


def test_torch_cpu_ring_hands_out_tensors_over_the_same_memory(runtime):
    torch = pytest.importorskip("torch", reason="torch not installed (pip install '.[torch]')")
    ring = Ring(runtime, SPEC, batch_size=4, slots=2, device=Device("cpu"),
                framework="torch", path="host")
    write(ring, 0, 3)
    data = ring.hand_out(0)
    assert isinstance(data["obs"], torch.Tensor) and data["obs"].shape == (4, 3, 5)
    assert data["obs"].data_ptr() == ring.acquire(0).address + ring.layout.offsets[0]
    assert data["obs"].is_contiguous() and data["action"].is_contiguous()
    assert bool((data["obs"] == 3).all())
