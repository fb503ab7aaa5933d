"""The storage node's arena: one registered region carved into slots.

Each table gets slots of its own fixed size, recycled through its
SlotTable (storage/slots.py), which also keeps what each acknowledged slot
holds; a slot is freed only when the control plane says so, which it does
only once no lease covers it.

Space is shared between tables: new slots come first from free extents
(space another table gave back), then from a bump pointer. When every slot
of a table is free again, the table gives all its space back as extents
(merged with their neighbours; an extent that reaches the bump pointer
lowers it), so any table, of any slot size, can use it. A table's slots
stay in ascending offset order (SlotTable's lookup relies on it): a table
that holds slots takes only extents above its highest one; an empty table
takes any.
Thread safety: one asyncio thread uses an Arena.
"""

from __future__ import annotations

import os
import secrets

import numpy as np

from .._native_loader import _native
from ..errors import SpecMismatch, StorageFull
from ..status import format_size
from .slots import SlotTable


class Arena:
    """Slots in one UCX-registered region, remote READ only."""

    def __init__(self, runtime, size: int, hugepages: bool = True, node_name: str = "node",
                 write_protect: bool = True, reserve: int = 0):
        """`reserve`: bytes at the bottom of the arena kept out of the slots
        (the disk tier's staging area, storage/tier.py)."""
        if write_protect:
            # Peers read through a read-only mapping: UCX's software
            # transports ignore registration access flags, so only this turns
            # a remote write into a fault instead of changed data.
            # The memfd behind it is sealed against writable mappings, so it
            # can also be handed to same-host learners (transport/local_map.py).
            self.region = _native.MemoryRegion.write_protected(runtime.region_owner, size,
                                                               hugepages)
        else:
            self.region = runtime.map_region(size, remote_read=True, hugepages=hugepages)
        # Names this arena (not the node): a learner that mapped an arena of a
        # node that restarted never takes the new one for the old.
        self.arena_id = secrets.randbits(63) | 1
        self.size = size
        self.node_name = node_name
        self.reserved = reserve
        self._bump = reserve  # no slot is carved below the reserved bytes
        # Free extents below the bump pointer, sorted by start, never adjacent.
        self._ext_start = np.empty(0, np.int64)
        self._ext_len = np.empty(0, np.int64)
        self._tables: dict[str, SlotTable] = {}
        self._generation = 0
        self.used_bytes = 0
        self._region_owner = runtime.region_owner  # what its regions hold: transport/runtime.py
        self._local = None  # the writable alias, registered for local access (pulls)
        self._words = None  # the writable alias as uint64 words (mark_retired)

    @property
    def share_fd(self) -> int:
        """The sealed memfd same-host learners may map read-only, or -1."""
        return self.region.share_fd if self.region.is_write_protected else -1

    @property
    def page_kind(self) -> str:
        """'hugetlb', 'thp' or '4k': what backs the arena (see page_advice())."""
        return self.region.page_kind

    @property
    def high_water(self) -> int:
        """Bytes of the arena carved so far, from offset 0: every slot lies below."""
        return self._bump

    @property
    def base(self) -> int:
        """Virtual address of the region (what remote reads are relative to)."""
        return self.region.address

    def allocate(self, table: str, slot_size: int, k: int) -> np.ndarray:
        """Offsets of k free slots of `slot_size` bytes for `table`; all or nothing."""
        slots = self._tables.get(table)
        if slots is None:
            slots = self._tables[table] = SlotTable(slot_size)
        if slots.slot_size != slot_size:
            raise SpecMismatch(
                f"table {table!r} changed its slot size ({slots.slot_size} -> {slot_size}) on "
                f"node {self.node_name}: recreate it under a new name"
            )
        rest = k - min(k, slots.free_slots)
        if rest == 0:  # the common case once a table is full: reuse only
            self.used_bytes += k * slot_size
            return slots.reuse(k)
        if rest > self._room(slot_size, slots.end):
            held = sorted(((t.n * t.slot_size, name) for name, t in self._tables.items()
                           if t.n), reverse=True)  # carved slots stay with their table
            holders = ", ".join(f"table {name!r} ({b} bytes)" for b, name in held)
            top = held[0][1] if held else table
            raise StorageFull(
                f"node {self.node_name}: arena full ({self.used_bytes} of {self.size} bytes "
                f"used) while inserting {k} items of {slot_size} bytes into table {table!r}; "
                f"the space is held by {holders or 'no table yet'}. "
                + (f"One item of table {table!r} is larger than this whole arena: make "
                   "items smaller, or " if slot_size > self.size else
                   f"Lower table {table!r}'s capacity, or " if top == table else
                   f"Table {top!r} holds the most: give it a smaller capacity, or ")
                + "start more storage nodes or give nodes a larger --arena"
            )
        reused = slots.reuse(k) if slots.free_slots else None
        fresh = self._carve(slot_size, rest, slots.end)
        slots.carve(fresh)
        self.used_bytes += k * slot_size
        return fresh if reused is None else np.concatenate([reused, fresh])

    def shortfall(self, table: str, slot_size: int, k: int) -> int:
        """How many of k slots for `table` the arena cannot give now (0: allocate succeeds)."""
        slots = self._tables.get(table)
        free = slots.free_slots if slots is not None else 0
        room = self._room(slot_size, slots.end if slots is not None else 0)
        return max(0, k - free - room)

    @property
    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, bytes) of space given back below the bump pointer."""
        return list(zip(self._ext_start.tolist(), self._ext_len.tolist()))

    @property
    def bump(self) -> int:
        """Offset of the first byte never carved (or given back at the top)."""
        return self._bump

    def _eligible(self, floor: int) -> np.ndarray:
        # An extent never straddles a table's slot, so it lies wholly above
        # `floor` (the end of the table's highest slot) or wholly below.
        return np.flatnonzero(self._ext_start >= floor)

    def _room(self, slot_size: int, floor: int) -> int:
        """How many new slots of `slot_size` a table whose slots end at
        `floor` could get: from extents above it, then the bump region."""
        idx = self._eligible(floor) if len(self._ext_start) else ()
        if not len(idx):  # an arena filling up (or no extent above): the bump region
            return (self.size - self._bump) // slot_size
        return int((self._ext_len[idx] // slot_size).sum()) + (self.size - self._bump) // slot_size

    def _carve(self, slot_size: int, m: int, floor: int) -> np.ndarray:
        """Offsets of m new slots (ascending, all above `floor`): from free
        extents first, then the bump pointer. The caller checked _room."""
        idx = self._eligible(floor) if len(self._ext_start) else ()
        if not len(idx):  # an arena filling up (or no extent above): the bump pointer
            fresh = np.arange(self._bump, self._bump + m * slot_size, slot_size, dtype=np.uint64)
            self._bump += m * slot_size
            return fresh
        fit = self._ext_len[idx] // slot_size
        before = np.cumsum(fit) - fit
        take = np.clip(m - before, 0, fit)
        used, take = idx[take > 0], take[take > 0]
        got = int(take.sum())
        within = np.arange(got, dtype=np.int64) - np.repeat(np.cumsum(take) - take, take)
        from_ext = np.repeat(self._ext_start[used], take) + within * slot_size
        self._ext_start[used] += take * slot_size
        self._ext_len[used] -= take * slot_size
        keep = self._ext_len > 0
        self._ext_start, self._ext_len = self._ext_start[keep], self._ext_len[keep]
        from_bump = self._bump + np.arange(m - got, dtype=np.int64) * slot_size
        self._bump += (m - got) * slot_size
        return np.concatenate([from_ext, from_bump]).astype(np.uint64)

    def _give_back(self, offsets: np.ndarray, slot_size: int) -> None:
        """Return slots (ascending offsets) to the free extents, merged."""
        offsets = offsets.astype(np.int64)
        first = np.ones(len(offsets), bool)
        first[1:] = np.diff(offsets) != slot_size  # where a run of adjacent slots starts
        starts = np.flatnonzero(first)
        lens = np.diff(np.append(starts, len(offsets))) * slot_size
        st = np.concatenate([self._ext_start, offsets[starts]])
        ln = np.concatenate([self._ext_len, lens])
        order = np.argsort(st, kind="stable")
        st, end = st[order], st[order] + ln[order]
        head = np.ones(len(st), bool)
        head[1:] = st[1:] != end[:-1]  # not touching the previous extent
        heads = np.flatnonzero(head)
        st, end = st[heads], np.maximum.reduceat(end, heads)
        if len(st) and end[-1] == self._bump:
            self._bump = int(st[-1])
            st, end = st[:-1], end[:-1]
        self._ext_start, self._ext_len = st, end - st

    def commit(self, table: str, offsets: np.ndarray, keys, generations, priorities,
               steps: tuple | None = None) -> None:
        """The control plane acknowledged these slots' items: remember what they
        hold (`steps`: steps of episodes' (episodes, positions, flags))."""
        self._tables[table].commit(offsets, keys, generations, priorities, steps)

    def free(self, table: str, offsets: np.ndarray, live_only: bool = False) -> None:
        """Return slots to the table's free list (the control plane released
        them: `live_only`, so that a late or repeated free never takes a slot
        an insert in flight holds; or an insert failed)."""
        slots = self._tables.get(table)
        if slots is None or len(offsets) == 0:
            return
        try:
            freed = slots.release(offsets, live_only)
        except ValueError:
            raise ValueError(f"node {self.node_name}: free of slots never allocated in table "
                             f"{table!r}") from None
        self.used_bytes -= freed * slots.slot_size
        if slots.free_slots == slots.n:
            # Every slot of the table is free: its space goes back to all tables.
            self._give_back(slots.cols["offset"][: slots.n], slots.slot_size)
            del self._tables[table]

    def mark_retired(self, offsets: np.ndarray, generations: np.ndarray) -> int:
        """Zero the header generation of slots that still hold these
        generations (items evicted while a learner holds a lease on them):
        every read's header check then fails, while the slot stays allocated
        until the control plane frees it. Returns how many were marked."""
        if self._words is None:
            self._words = self.region.view().view(np.uint64)  # the writable alias
        offsets = np.asarray(offsets, np.uint64)
        gens = np.asarray(generations, np.uint64)
        ok = offsets + np.uint64(16) <= np.uint64(self.size)  # a confused peer: ignore
        idx = (offsets[ok] // np.uint64(8) + np.uint64(1)).astype(np.int64)  # generation word
        same = idx[self._words[idx] == gens[ok]]
        self._words[same] = 0
        return len(same)

    def tables(self) -> dict[str, SlotTable]:
        """Every table that has slots here, by name."""
        return dict(self._tables)

    def next_generations(self, k: int) -> np.ndarray:
        """k fresh generations; a generation is never handed out twice."""
        gens = np.arange(self._generation + 1, self._generation + 1 + k, dtype=np.uint64)
        self._generation += k
        return gens

    @property
    def local_region(self):
        """The arena as a destination of this process's own UCX reads: its
        writable alias registered for LOCAL access only. No remote key is
        ever packed from it (peers get the read-only registration's key)."""
        if self._local is None:
            if not self.region.is_write_protected:
                self._local = self.region
            else:
                view = self.region.view()  # keeps the region (and its pages) alive
                self._local = _native.MemoryRegion.register(
                    self._region_owner, view.ctypes.data, self.size, view, 0)
        return self._local

    def pull(self, source, offsets: np.ndarray, keys: np.ndarray, generations: np.ndarray,
             src_addresses: np.ndarray, lengths: np.ndarray, timeout: float) -> np.ndarray:
        """Read a writer's staged items one-sided into allocated slots (one
        native call, GIL released: run it off the event loop); returns the
        per-item ucs_status_t. `source` is a storage.pulls.Source. A slot
        whose read failed keeps an invalid header (key 0, generation 0)."""
        return _native.pull(
            self.region, self.local_region if source.rkey is not None else None,
            source.worker, source.rkey, source.pid, source.base, source.size,
            offsets, src_addresses, lengths, keys, generations, timeout)

    def pull_am(self, inbox, token: int, offsets: np.ndarray, keys: np.ndarray,
                generations: np.ndarray, lengths: np.ndarray, timeout: float) -> np.ndarray:
        """Receive batch `token`'s items, sent by the writer as UCX active
        messages (storage/pulls.py), each straight into its allocated slot, in
        one native call with the GIL released (run it on the thread that
        progresses the inbox's worker); returns the per-item statuses."""
        return _native.pull_am(self.region, self.local_region, inbox, token, offsets, lengths,
                               keys, generations, timeout)

    def pull_mapped(self, source, offsets: np.ndarray, keys: np.ndarray,
                    generations: np.ndarray, src_offsets: np.ndarray, lengths: np.ndarray,
                    pool=None) -> np.ndarray:
        """Copy a same-host writer's staged items (at `src_offsets` in its
        mapped staging buffer, `source.mapping`) into allocated slots,
        seqlock style, in one native call with the GIL released unless the
        batch is small (over `pool` for large batches); returns the per-item
        statuses (all 0)."""
        # Offsets are addresses in a buffer based at 0 (the native call's src_base).
        return _native.pull_mapped(self.region, source.mapping, 0, offsets, src_offsets, lengths,
                                   keys, generations, pool, PARALLEL_COPY_BYTES)


PARALLEL_COPY_BYTES = 1 << 20  # same-host insert batches this large use the copy pool


def page_advice(page_kind: str) -> str:
    """What an admin can set to give arenas larger pages; "" when they have them.

    Larger pages make one-sided reads (fewer pages to pin and translate) and
    same-host copies (fewer TLB misses, fewer first-touch faults) faster.
    """
    if page_kind == "hugetlb":
        return ""
    shmem = _sysfs("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    if page_kind == "thp" and shmem in ("always", "within_size", "advise", "force"):
        return ""
    return ("arena on 4 KiB pages; for 2 MiB pages reserve hugepages "
            "(sysctl vm.nr_hugepages=N, N x 2 MiB >= the arena) or allow shared-memory "
            "transparent hugepages (echo advise > "
            "/sys/kernel/mm/transparent_hugepage/shmem_enabled)"
            + (f"; shmem_enabled is {shmem!r} now" if shmem else ""))


def granted_page_kind(page_kind: str) -> str:
    """'hugetlb', 'thp' or '4k' as the kernel grants them: transparent
    hugepages asked for where shared-memory ones are off are 4 KiB pages (what
    the node reports to the control plane, as its log says)."""
    return "4k" if page_kind == "thp" and page_advice(page_kind) else page_kind


def page_size_label(page_kind: str) -> str:
    """'2 MiB (reserved)', '2 MiB (transparent)' or '4 KiB', as the kernel grants."""
    if page_kind == "hugetlb":
        return "2 MiB (reserved hugepages)"
    if page_kind == "thp" and not page_advice(page_kind):
        return "2 MiB (transparent hugepages)"
    return "4 KiB"


def memory_available() -> tuple[int, str]:
    """Bytes this process may still make resident, and what bounds them: the
    host's MemAvailable, or this process's memory cgroup (v1 or v2) limit
    less its usage where that is lower. A node that would populate more
    than this is stopped by the kernel's OOM killer, without a word."""
    best = (_meminfo_bytes("MemAvailable"), "MemAvailable in /proc/meminfo")
    for limit, usage, where in _cgroup_memory():
        if limit - usage < best[0]:
            best = (max(0, limit - usage),
                    f"memory cgroup {where}: limit {format_size(limit)}, "
                    f"{format_size(usage)} in use")
    return best


def _meminfo_bytes(field: str) -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62  # unknown: no bound


def _cgroup_memory() -> list[tuple[int, int, str]]:
    """(limit, usage, cgroup path) of this process's memory cgroups that
    set a limit (v1 `memory` controller, v2 unified)."""
    found = []
    try:
        with open("/proc/self/cgroup") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            files = (f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes",
                     f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes")
        elif controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            files = (f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current")
        else:
            continue
        try:
            with open(files[0]) as a, open(files[1]) as b:
                limit, usage = a.read().strip(), b.read().strip()
            if limit != "max" and int(limit) < 1 << 60:
                found.append((int(limit), int(usage), path))
        except (OSError, ValueError):
            continue
    return found


def _sysfs(path: str) -> str:
    """The selected value of a sysfs setting like 'always [advise] never'."""
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError:
        return ""
    if "[" in text:
        return text.split("[", 1)[1].split("]", 1)[0]
    return text.strip()
