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

import numpy as np

from .. import protocol
from .._native_loader import _native
from ..errors import StagingFull
from ..slot_format import stride_of

log = logging.getLogger(__name__)

STAGE_WAIT = 5.0  # s a sample's cold items may wait for room in the staging area


class ColdStaging:
    """Reads sampled cold items into the staging area.

    Mixed into StorageNode (storage/node.py): uses its config, name, arena,
    tier, staging area, control connection, node id, `_staged` and `_disk()`.
    """

    async def _stage(self, f: dict) -> None:
        """Read a sample's cold items into the staging area and tell the
        control plane where they are (a `staged` push)."""
        req, keys, slot_size = f["request"], f["keys"], f["slot_size"]
        stride = stride_of(slot_size)
        need = len(keys) * stride
        try:
            if need > self.staging.size:
                raise StagingFull(
                    f"node {self.name}: a sample needs {len(keys)} cold items of table "
                    f"{f['table']!r} staged ({need} bytes) but the staging area holds "
                    f"{self.staging.size}: raise --disk-staging or sample smaller batches")
            deadline = time.monotonic() + STAGE_WAIT
            while (room := self.staging.take(len(keys), stride)) is None:
                # Staged extents come back when learners release their leases.
                self._staged.clear()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingFull(
                        f"node {self.name}: staging area full ({self.staging.used_bytes} of "
                        f"{self.staging.size} bytes leased) for {STAGE_WAIT:g} s, {need} bytes "
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
                    self._disk(), self.tier.read, f["offsets"], slot_size,
                    self.arena.region, dest, keys, f["generations"])
            except BaseException:
                for start in extents:
                    self.staging.give(start)
                self._staged.set()
                raise
            bad = statuses != 0
            if bad.any():
                self.tier.read_errors += int(bad.sum())
                first = int(statuses[bad][0])
                why = os.strerror(first) if first > 0 else _native.status_name(first)
                log.error("node %s: %d of %d cold items of table %r could not be read back from "
                          "%s (%s: an I/O error, a slot failing its checksum, or another "
                          "item's); reported lost", self.name, int(bad.sum()), len(keys),
                          f["table"], self.config.disk, why)
            self.control.push("staged", node_id=self.node_id, request=req, extents=extents,
                              offsets=dest, statuses=statuses.view(np.uint32))
            log.debug("staged %d cold items of table %r (%d bytes) in %.1f ms", len(keys),
                      f["table"], need, 1e3 * (time.perf_counter() - t0))
        except Exception as exc:  # the sample waiting on this must hear why
            log.error("%s", exc)
            if self.control is not None:
                self.control.push("staged", node_id=self.node_id, request=req,
                                  error=str(exc)[:4000], code=protocol.error_code(exc))

    def _unstage(self, extents) -> None:
        """Take back staged extents that learners released."""
        for start in extents:
            self.staging.give(int(start))
        self._staged.set()
