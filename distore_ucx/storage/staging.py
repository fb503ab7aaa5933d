"""Staging a sample's cold items: reading them from the disk tier into the
arena's staging area (StagingArea, storage/tier.py) when the control plane
asks (a `stage` push), and taking back the extents learners released (an
`unstage` push). control/tiers.py is the control plane's side.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import Executor

import numpy as np

from .. import protocol
from .._native_loader import _native
from ..errors import StagingFull
from ..slot_format import stride_of
from .state import NodeState

log = logging.getLogger(__name__)

STAGE_WAIT = 5.0  # s a sample's cold items may wait for room in the staging area


class ColdStaging:
    """Reads sampled cold items into the staging area; serves the control
    plane's `stage` and `unstage` pushes (storage/session.py routes them).

    Made only with a disk tier. Given the node's shared state
    (storage/state.py: its config, name, arena, tier, staging area, control
    connection and node id) and the node's disk threads, on which the
    items are read.
    """

    def __init__(self, state: NodeState, disk: Executor):
        self.state = state
        self._disk = disk
        self._staged = asyncio.Event()  # set when staged extents come back

    def op_stage(self, peer, f: dict) -> None:
        """Stage a sample's cold items (`peer`: None, a push), on a task of
        its own: the control connection's reader goes on meanwhile."""
        asyncio.get_running_loop().create_task(self._stage(f))

    def op_unstage(self, peer, f: dict) -> None:
        """Take back staged extents that learners released (`peer`: None, a push)."""
        for start in f["extents"]:
            self.state.staging.give(int(start))
        self._staged.set()

    async def _stage(self, f: dict) -> None:
        """Read a sample's cold items into the staging area and tell the
        control plane where they are (a `staged` push)."""
        state = self.state
        req, keys, slot_size = f["request"], f["keys"], f["slot_size"]
        stride = stride_of(slot_size)
        need = len(keys) * stride
        try:
            if need > state.staging.size:
                raise StagingFull(
                    f"node {state.name}: a sample needs {len(keys)} cold items of table "
                    f"{f['table']!r} staged ({need} bytes) but the staging area holds "
                    f"{state.staging.size}: raise --disk-staging or sample smaller batches")
            deadline = time.monotonic() + STAGE_WAIT
            while (room := state.staging.take(len(keys), stride)) is None:
                # Staged extents come back when learners release their leases.
                self._staged.clear()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingFull(
                        f"node {state.name}: staging area full ({state.staging.used_bytes} of "
                        f"{state.staging.size} bytes leased) for {STAGE_WAIT:g} s, {need} bytes "
                        f"of cold items of table {f['table']!r} wanted. Each learner holds "
                        "the cold items of 3 batches (the one it reads and two asked ahead) "
                        "until it releases them: raise --disk-staging, or sample smaller "
                        "batches")
                try:
                    await asyncio.wait_for(self._staged.wait(), left)
                except asyncio.TimeoutError:
                    pass
            dest, extents = room
            t0 = time.perf_counter()  # the debug log's time includes the wait for the disk
            try:
                # Samples' batches queue in the tier's native reader, first
                # in, first out (storage/tier.py).
                statuses = await asyncio.get_running_loop().run_in_executor(
                    self._disk, state.tier.read, f["offsets"], slot_size,
                    state.arena.region, dest, keys, f["generations"])
            except BaseException:
                for start in extents:
                    state.staging.give(start)
                self._staged.set()
                raise
            bad = statuses != 0
            if bad.any():
                state.tier.read_errors += int(bad.sum())
                first = int(statuses[bad][0])
                why = os.strerror(first) if first > 0 else _native.status_name(first)
                log.error("node %s: %d of %d cold items of table %r could not be read back from "
                          "%s (%s: an I/O error, a slot failing its checksum, or another "
                          "item's); reported lost", state.name, int(bad.sum()), len(keys),
                          f["table"], state.config.disk, why)
            state.control.push("staged", node_id=state.node_id, request=req, extents=extents,
                               offsets=dest, statuses=statuses.view(np.uint32))
            log.debug("staged %d cold items of table %r (%d bytes) in %.1f ms", len(keys),
                      f["table"], need, 1e3 * (time.perf_counter() - t0))
        except Exception as exc:  # the sample waiting on this must hear why
            log.error("%s", exc)
            if state.control is not None:
                state.control.push("staged", node_id=state.node_id, request=req,
                                   error=str(exc)[:4000], code=protocol.error_code(exc))
