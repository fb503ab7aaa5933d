"""The control plane's tables by name: creating them (and checking they fit
the storage nodes' arenas), finding them, describing them, and setting
their items' priorities. A table whose capacity stops fitting the live
nodes (a node was lost) is warned about once, in the log and in the
`table_info` and `status` replies (`refit`).

What one table holds and decides is in tables.py; this module is the
requests about the set of them (`create_table`, `table_info`,
`list_tables`, `update_priorities`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from ..errors import ConfigError, InvalidRequest, TableExists, TableNotFound
from ..table_definition import TableDefinition
from ..transport.rpc import Peer
from .admission import Admission
from .membership import Membership
from .room import fits, room_alone
from .tables import Table
from .tiers import cold_items

log = logging.getLogger(__name__)


class Catalog:
    """The tables, by name; one per control plane."""

    def __init__(self, members: Membership, admission: Admission,
                 seeds: Iterator[int] | None = None):
        """`seeds`: each new table's sampler seed (None: random)."""
        self.tables: dict[str, Table] = {}
        self.members = members
        self.admission = admission
        self.seeds = seeds
        # Tables whose capacity the live nodes cannot hold now: the warning.
        self.short: dict[str, str] = {}

    def table(self, name: str) -> Table:
        """The table called `name`; TableNotFound if there is none."""
        table = self.tables.get(name)
        if table is None:
            raise TableNotFound(
                f"no table {name!r} on this control plane (tables: {sorted(self.tables)}); "
                "create it with client.create_table"
            )
        return table

    def create(self, definition: TableDefinition) -> dict:
        """Create a table (or return the existing one of the same definition)."""
        name = definition.name
        existing = self.tables.get(name)
        if existing is not None:
            if existing.definition != definition:
                differ = "; ".join(existing.definition.differences(definition))
                raise TableExists(
                    f"table {name!r} exists with another definition ({differ}): create it "
                    "with the same definition to reuse it, or use another name"
                )
            return existing.info()
        seed = next(self.seeds) if self.seeds is not None else None
        table = Table(definition, seed)
        spec = table.spec
        warnings = self._check_fit(name, spec.slot_size, table.capacity)
        self.tables[name] = table
        log.info("table %r created: capacity %d, %d-byte items, sampler %s, remover %s, %s",
                 name, table.capacity, spec.item_bytes, table.sampler.kind, table.remover.kind,
                 table.rate_limiter.kind)
        for text in warnings:
            log.warning("%s", text)
        return {**table.info(), "warnings": warnings}

    def _check_fit(self, name: str, slot_size: int, capacity: int) -> list[str]:
        """Refuse a table whose items fit no live node's arena; warnings when
        its capacity cannot fit in the live nodes' arenas (nodes may join later);
        one that does not fit alone is recorded as short (see `refit`)."""
        nodes = self.members.alive()
        if not nodes:
            return []
        if slot_size > max(n.arena_size for n in nodes):
            arenas = [n.arena_size for n in nodes]
            raise ConfigError(
                f"table {name!r}: one item takes {slot_size} bytes in an arena (header and "
                f"padding included) but the largest storage node's arena is {max(arenas)} "
                "bytes: no item could ever be stored. Start storage nodes with a larger "
                "--arena, or make the items smaller"
            )
        short = _shortfall(name, slot_size, capacity, nodes)
        if short:
            self.short[name] = short
            return [short]
        arenas, where = room_alone(slot_size, nodes)[1:]
        need = capacity * slot_size
        others = {t.name: t.capacity * t.spec.slot_size for t in self.tables.values()}
        # Only the table that tips the sum over is warned about (once was enough
        # for tables that did not fit alone).
        if need + sum(others.values()) > arenas >= sum(others.values()):
            return [(f"table {name!r}: capacity {capacity} x {slot_size}-byte slots = {need} "
                     f"bytes fits the live nodes' {where} ({arenas} bytes) alone, but not "
                     f"together with the other tables' capacities "
                     f"({', '.join(f'{k}: {v} bytes' for k, v in others.items())}): tables "
                     "share arenas first come, first served; a table with no room evicts its "
                     "own items, and one that holds none on a full node gets StorageFull")]
        return []

    def refit(self, why: str) -> None:
        """The live nodes changed (`why`: "node 2 (a) was dropped"): warn
        once, in the log and to clients (table_info, status), about each
        table whose capacity they can no longer hold (its inserts evict its
        own items from then on, quietly otherwise); forget the warning of a
        table that fits again (a replacement joined)."""
        nodes = self.members.alive()
        if not nodes:
            return  # nothing is stored until nodes join; inserts say so
        for name, table in self.tables.items():
            short = _shortfall(name, table.spec.slot_size, table.capacity, nodes, why)
            if short and name not in self.short:
                self.short[name] = short
                log.warning("%s", short)
            elif not short and name in self.short:
                del self.short[name]
                log.info("table %r: its capacity fits the live nodes again (%s)", name, why)

    def warnings(self, name: str | None = None) -> list[str]:
        """The capacity warnings that hold now: of table `name`, or of all."""
        if name is not None:
            return [self.short[name]] if name in self.short else []
        return [self.short[n] for n in self.tables if n in self.short]

    # -- requests --------------------------------------------------------
    def op_create_table(self, peer: Peer, f: dict) -> dict:
        """Create a table from its wire definition (client.create_table)."""
        return self.create(TableDefinition.from_wire(f))

    def op_table_info(self, peer: Peer, f: dict) -> dict:
        """One table's state, with its cold items and how many items fit."""
        table = self.table(f["name"])
        warned = self.warnings(table.name)
        return {**table.info(), "cold": cold_items(table),
                "fits": fits(table, list(self.tables.values()), self.members.alive()),
                **({"warnings": warned} if warned else {})}

    def op_list_tables(self, peer: Peer, f: dict) -> dict:
        """Every table's state."""
        return {"tables": [t.info() for t in self.tables.values()]}

    def op_update_priorities(self, peer: Peer, f: dict) -> dict:
        """Set items' priorities by key; keys no longer in the table are counted."""
        if (f["priorities"] < 0).any():
            raise InvalidRequest("priorities must be >= 0")
        table = self.table(f["table"])
        updated = table.update_priorities(f["keys"], f["priorities"])
        self.admission.touch(table)
        return {"updated": updated, "missing": len(f["keys"]) - updated}


def _shortfall(name: str, slot_size: int, capacity: int, nodes, after: str = "") -> str | None:
    """Why table `name`'s capacity cannot fit the live `nodes` even were it
    alone there (None: it can); `after` says what changed ("node 2 (a) was
    dropped")."""
    room, space, where = room_alone(slot_size, nodes)
    if capacity <= room:
        return None
    return (f"table {name!r}: capacity {capacity} x {slot_size}-byte slots = "
            f"{capacity * slot_size} bytes, but {f'after {after} ' if after else ''}the "
            f"{where} of the {len(nodes)} live storage node(s) hold at most {room} such items "
            f"({space} bytes): once they are full, an insert evicts the table's own items by "
            f"its remover, so it holds about {room} items (table_info's 'fits'). Lower the "
            "capacity, or start more storage nodes, larger arenas or disk tiers (--disk)")
