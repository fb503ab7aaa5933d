"""A control plane's restore from its checkpoint: which tables come back,
which items the re-joining storage nodes re-send, and when it ends.

`register_node`'s reply says whether a node should re-send its items
(control/nodes.py); `items_restored` hands them here and `items_resent`
says a node has sent them all (`Restoring`, which holds the restore in
progress). The restore ends once every node that may hold items of the
checkpoint (those it names, and any that joined after it) has re-sent them
or is gone, and at the latest after `restore_grace` seconds (nodes that
never come back). What comes back and what is dropped is described in
docs/semantics.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import numpy as np

from ..errors import CheckpointError, DistoreError, InvalidRequest
from ..progress import Progress
from ..protocol import steps_of
from ..transport.rpc import Peer
from . import checkpoint
from .admission import Admission
from .evictions import Freed
from .membership import Membership
from .reclaim import Reclaim
from .tables import Table

log = logging.getLogger(__name__)


class Restore:
    """A restore in progress: nodes may re-send their items until `until`,
    and it is over sooner once every node it waits for is done."""

    def __init__(self, path: str, grace: float):
        self.path = path
        self.grace = grace
        self.started = time.monotonic()
        self.until = self.started + grace
        self.progress: Progress | None = None  # items re-sent against the checkpoint's
        # Nodes that may hold checkpointed items and have not re-joined (id:
        # name, "" when unknown); None: unknown (an older checkpoint), so the
        # restore waits out its grace.
        self.absent: dict[int, str] | None = None
        self.resending: dict[int, str] = {}  # re-joined, re-sending, not done yet
        self.done = 0  # nodes that re-sent everything

    def load(self, seeds: Iterator[int] | None, next_node_id: int = 0) -> dict[str, Table]:
        """The checkpoint's tables, empty until nodes re-send their items
        ({} when there is no checkpoint yet). `next_node_id`: the first node
        id no run has handed out (IdState), so that nodes that joined after
        the checkpoint are waited for too."""
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
                tables[t.name] = table = Table.from_image(t, seed)
            except (DistoreError, ValueError, TypeError, KeyError) as exc:
                raise CheckpointError(f"{self.path}: table {t.name!r} cannot be restored "
                                      f"({exc}); restore an older copy or start without "
                                      "--restore") from None
            over = len(t.keys) - len(table.pending.keys)
            if over:
                log.warning("table %r: the checkpoint holds %d items, more than its capacity of "
                            "%d (taken during a restore by an older release); the %d its %s "
                            "remover would evict first are dropped", t.name, len(t.keys),
                            table.capacity, over, table.remover.kind)
        if image.nodes is not None:
            self.absent = dict(image.nodes)
            # Nodes that joined after the checkpoint may hold items too.
            self.absent.update({i: "" for i in range(max(image.next_node_id, 1), next_node_id)
                                if i not in self.absent})
        expected = sum(len(t.pending.keys) for t in tables.values())
        self.progress = Progress("restoring checkpointed items", total=expected,
                                 unit="items", logger=log, every=5.0)
        log.info("restoring %d tables, %d items from %s (written %.0f s ago by run %d); %s, "
                 "for at most %g s", len(image.tables), expected, self.path,
                 time.time() - image.created, image.incarnation,
                 "waiting for " + self.waiting_for() if self.absent is not None else
                 "the checkpoint names no nodes (an older release's): nodes re-send their "
                 "items", self.grace)
        return tables

    # -- the nodes it waits for ----------------------------------------------
    def joined(self, node_id: int, name: str, resends: bool) -> None:
        """A node registered; `resends`: it re-joined with its former id
        and re-sends the items it holds (then says `sent`)."""
        if self.absent is not None:
            self.absent.pop(node_id, None)
        if resends:
            self.resending[node_id] = name

    def sent(self, node_id: int) -> None:
        """A node has re-sent every item it holds (an items_resent request)."""
        if self.resending.pop(node_id, None) is not None:
            self.done += 1

    def gone(self, node_id: int) -> None:
        """A node died or left during the restore: its items are gone with it."""
        self.resending.pop(node_id, None)
        if self.absent is not None:
            self.absent.pop(node_id, None)

    def complete(self) -> bool:
        """Has every node that may hold checkpointed items re-sent them (or gone)?"""
        return self.absent is not None and not self.absent and not self.resending

    def waiting_for(self) -> str:
        """The nodes this restore waits for, in words."""
        def named(nodes: dict[int, str]) -> str:
            ids = sorted(nodes)
            text = ", ".join(f"{i} ({nodes[i]})" if nodes[i] else str(i) for i in ids[:5])
            more = f" and {len(ids) - 5} more" if len(ids) > 5 else ""
            return f"node{'s' if len(ids) > 1 else ''} {text}{more}"

        parts = []
        if self.absent is None:
            parts.append("nodes to re-join (the checkpoint does not name them)")
        elif self.absent:
            parts.append(named(self.absent) + " to re-join")
        if self.resending:
            parts.append(named(self.resending) + " to finish re-sending")
        return " and ".join(parts) or "nothing"

    def report(self, tables: dict[str, Table], now: float) -> None:
        """Show how many checkpointed items the nodes have re-sent so far,
        and what the restore waits for."""
        if self.progress is not None and self.progress.total:
            self.progress.set(self.progress.total - sum(
                t.pending.unclaimed for t in tables.values() if t.pending),
                f"waiting for {self.waiting_for()}, at most {max(0.0, self.until - now):.0f} s "
                "more")

    def over(self, now: float) -> bool:
        """Is the restore over: every node it waits for is done, or the time
        nodes had to re-send their items has run out?"""
        return self.complete() or now >= self.until

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
        steps = steps_of(f)
        freed, counts = table.restore_items(node_id, f["keys"], f["offsets"], f["generations"],
                                            f["priorities"], steps)
        log.info("node %d re-sent %d items of table %r: %d restored from the checkpoint, %d "
                 "newer ones adopted, %d discarded", node_id, n, name, counts["restored"],
                 counts["adopted"], counts["discarded"])
        return table, freed, counts

    def end(self, tables: dict[str, Table]) -> None:
        """Close the restore: checkpointed items no node re-sent are dropped."""
        took = time.monotonic() - self.started
        if self.complete():
            why = (f"every node re-sent its items ({self.done} node"
                   f"{'' if self.done == 1 else 's'}) after {took:.1f} s")
            gone = "their nodes had freed them (evicted after the checkpoint) or are gone"
        else:
            why = f"its grace of {self.grace:g} s is over, still waiting for {self.waiting_for()}"
            gone = "their nodes are gone"
        for table in tables.values():
            lost = table.end_restore()
            if lost:
                log.warning("table %r: %d checkpointed items were not re-sent by any node (%s); "
                            "they are dropped", table.name, lost, gone)
        if self.progress is not None:
            self.progress.close()
        log.info("restore complete, %s: %s", why, ", ".join(
            f"{t.name} {t.size} items" for t in tables.values()) or "no tables")


class Restoring:
    """The restore in progress (None when there is none) and the requests
    of nodes re-sending their items; one per control plane."""

    def __init__(self, tables: dict[str, Table], members: Membership, reclaim: Reclaim,
                 admission: Admission):
        self.tables = tables
        self.members = members
        self.reclaim = reclaim
        self.admission = admission
        self.current: Restore | None = None

    def begin(self, path: str, grace: float, seeds: Iterator[int] | None,
              next_node_id: int) -> None:
        """Start restoring the checkpoint at `path`: its tables join ours,
        empty until nodes re-send their items (`Restore.load`)."""
        self.current = Restore(path, grace)
        self.tables.update(self.current.load(seeds, next_node_id))

    def tick(self, now: float) -> None:
        """Report progress, and end the restore if it is over (housekeeping)."""
        if self.current is not None:
            self.current.report(self.tables, now)
            self.end_if_over(now)

    def end_if_over(self, now: float) -> None:
        """End the restore once it is over (every node it waits for is done,
        or its grace has run out)."""
        if self.current is not None and self.current.over(now):
            self.current, restore = None, self.current
            restore.end(self.tables)

    def op_items_restored(self, peer: Peer, f: dict) -> dict:
        """Items a re-registered node still holds (sent only while restoring)."""
        node_id = self.members.sender(peer, f, "items_restored")
        if self.current is None:
            raise InvalidRequest("this control plane is not restoring; a node re-sends its items "
                                 "only when register_node's reply asks for them")
        table, freed, counts = self.current.items(self.tables, node_id, f)
        self.reclaim.free(f["table"], freed)
        if table is not None:
            self.admission.touch(table)
        return counts

    def op_items_resent(self, peer: Peer, f: dict) -> dict:
        """A re-joined node has re-sent every item it holds: the restore ends
        as soon as every node it waits for has."""
        node_id = f["node_id"]
        if peer.state.get("node_id") != node_id:
            raise InvalidRequest(f"items_resent for node {node_id} from a connection that is "
                                 "not it")
        if self.current is not None:  # else it ended already (its grace ran out)
            self.current.sent(node_id)
            self.end_if_over(time.monotonic())
        return {}


__all__ = ["Restore", "Restoring"]
