"""A control plane's restore from its checkpoint: which tables come back,
which items the re-joining storage nodes re-send, and when it ends.

The request server only routes: `register_node`'s reply says whether a
node should re-send its items, `items_restored` hands them here, and the
housekeeping loop ends the restore after `restore_grace` seconds. What
comes back and what is dropped is described in docs/semantics.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import numpy as np

from ..errors import CheckpointError, DistoreError, InvalidRequest
from ..progress import Progress
from . import checkpoint
from .tables import Freed, Table

log = logging.getLogger(__name__)


class Restore:
    """A restore in progress: nodes may re-send their items until `until`."""

    def __init__(self, path: str, grace: float):
        self.path = path
        self.grace = grace
        self.until = time.monotonic() + grace
        self.progress: Progress | None = None  # items re-sent against the checkpoint's

    def load(self, seeds: Iterator[int] | None) -> dict[str, Table]:
        """The checkpoint's tables, empty until nodes re-send their items
        ({} when there is no checkpoint yet)."""
        if not os.path.exists(self.path):
            log.warning("--restore: no checkpoint at %s yet; starting with the configured "
                        "tables only (re-joining nodes keep their items of those)", self.path)
            return {}
        image = checkpoint.read(self.path)
        ours = checkpoint.IdState.store_of(self.path + ".ids")
        if image.store_id and ours and image.store_id != ours:
            raise CheckpointError(
                f"{self.path} is a checkpoint of store {image.store_id}, but its id file "
                f"{self.path}.ids belongs to store {ours}: restore a checkpoint and id file "
                "written together, or start without --restore")
        # A bar on a terminal, a log line every few seconds otherwise.
        self.progress = Progress("restoring checkpointed items", total=image.items,
                                 unit="items", logger=log, every=5.0)
        tables = {}
        for t in image.tables:
            seed = next(seeds) if seeds is not None else None
            try:
                tables[t.name] = Table.from_image(t, seed)
            except (DistoreError, ValueError, TypeError, KeyError) as exc:
                raise CheckpointError(f"{self.path}: table {t.name!r} cannot be restored "
                                      f"({exc}); restore an older copy or start without "
                                      "--restore") from None
        log.info("restoring %d tables, %d items from %s (written %.0f s ago by run %d); nodes "
                 "have %g s to re-send their items", len(image.tables), image.items, self.path,
                 time.time() - image.created, image.incarnation, self.grace)
        return tables

    def report(self, tables: dict[str, Table]) -> None:
        """Show how many checkpointed items the nodes have re-sent so far."""
        if self.progress is not None and self.progress.total:
            self.progress.set(self.progress.total - sum(
                t.pending.unclaimed for t in tables.values() if t.pending))

    def over(self, now: float) -> bool:
        """Has the time nodes had to re-send their items run out?"""
        return now >= self.until

    def items(self, tables: dict[str, Table], node_id: int,
              f: dict) -> tuple[Table | None, Freed, dict]:
        """Items a re-joined node re-sent (an items_restored request): the
        table that took them (None: no table could), the slots to free on
        the node, and the counts for the reply."""
        if (f["priorities"] < 0).any():
            raise InvalidRequest("priorities must be >= 0")
        name, n = f["table"], len(f["keys"])
        table = tables.get(name)
        if table is None or table.spec.slot_size != f["slot_size"]:
            why = "no such table" if table is None else (
                f"its slots are {table.spec.slot_size} bytes, the node's {f['slot_size']}")
            log.warning("node %d re-sent %d items of table %r, which this control plane cannot "
                        "take (%s); the node frees them", node_id, n, name, why)
            return None, Freed(np.full(n, node_id, np.uint32), f["offsets"].copy()), {
                "restored": 0, "adopted": 0, "discarded": n}
        freed, counts = table.restore_items(node_id, f["keys"], f["offsets"], f["generations"],
                                            f["priorities"])
        log.info("node %d re-sent %d items of table %r: %d restored from the checkpoint, %d "
                 "newer ones adopted, %d discarded", node_id, n, name, counts["restored"],
                 counts["adopted"], counts["discarded"])
        return table, freed, counts

    def end(self, tables: dict[str, Table]) -> None:
        """Close the restore: checkpointed items no node re-sent are dropped."""
        for table in tables.values():
            lost = table.end_restore()
            if lost:
                log.warning("table %r: %d checkpointed items were not re-sent by any node within "
                            "%g s (their nodes are gone); they are dropped", table.name, lost,
                            self.grace)
        if self.progress is not None:
            self.progress.close()
        log.info("restore complete: %s", ", ".join(
            f"{t.name} {t.size} items" for t in tables.values()) or "no tables")


__all__ = ["Restore"]
