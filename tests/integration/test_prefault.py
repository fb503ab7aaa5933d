"""A storage node makes its arena's pages at start (node.prefault).

`distore node` populates its arena before it serves, so that no insert pays
a first-touch fault (the kernel allocating and zeroing the page an item
first lands on: a quarter of a node's CPU while its arena fills) and a host
without the memory fails at start, with a message saying what to do,
instead of killing the node once the arena fills. `--no-prefault` (and a
LocalCluster, unless asked) takes pages as items arrive. Populating changes
no byte: items inserted afterwards are read back whole.
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

import distore_ucx as ds
from distore_ucx.config import NodeConfig
from distore_ucx.errors import ConfigError
from distore_ucx.storage.node import StorageNode

ARENA = 48 << 20
ITEM = 4096


def shmem_bytes(pid: int) -> int:
    """Shared-memory pages the process maps (its memfd arena), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/PID/status")


def test_a_node_makes_its_arenas_pages_at_start_only_when_asked(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    with ds.LocalCluster(nodes=1, arena_bytes=ARENA, prefault=True, log_level="WARNING") as made, \
            ds.LocalCluster(nodes=1, arena_bytes=ARENA, log_level="WARNING") as lazy:
        assert shmem_bytes(made.nodes[0].pid) >= ARENA
        assert shmem_bytes(lazy.nodes[0].pid) < ARENA // 4
        # The populated arena holds what is inserted after, byte for byte,
        # without making a page more.
        before = shmem_bytes(made.nodes[0].pid)
        with ds.connect(made.address) as client:
            client.create_table("t", capacity=4096, spec=((ITEM,), "uint8"))
            rows = (np.arange(2000, dtype=np.uint64)[:, None] * 7 + np.arange(ITEM // 8)) \
                .astype(np.uint64).view(np.uint8)
            with client.writer() as writer:
                keys = writer.insert("t", rows)
            with client.learner("t", batch_size=256) as learner:
                batch = learner.sample()
            index = np.searchsorted(keys, batch.keys)
            assert np.array_equal(batch.data, rows[index])
        assert shmem_bytes(made.nodes[0].pid) - before < ARENA // 8


def _memory_cgroup(limit: int) -> str | None:
    """A new memory cgroup (v1 or v2) limited to `limit` bytes, or None where
    this process cannot make one (not root, no memory controller)."""
    name = f"distore-test-{uuid.uuid4().hex[:8]}"
    for base, limit_file in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
                             ("/sys/fs/cgroup", "memory.max")):
        if not os.path.exists(os.path.join(base, limit_file if base.endswith("memory")
                                           else "cgroup.controllers")):
            continue
        path = os.path.join(base, name)
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            with open(os.path.join(path, limit_file), "w") as f:
                f.write(str(limit))
            return path
        except OSError:
            os.rmdir(path)
    return None


def test_a_node_whose_host_cannot_back_the_arena_stops_at_start_saying_why(tmp_path):
    # The kernel's OOM killer would stop it without a word once populating
    # went past the limit: the node checks what it may make resident first.
    cgroup = _memory_cgroup(96 << 20)
    if cgroup is None:
        pytest.skip("needs root and a memory cgroup controller to limit the node's memory")
    try:
        node = subprocess.run(
            [sys.executable, "-m", "distore_ucx", "node", "--control", "127.0.0.1:1",
             "--host", "127.0.0.1", "--arena", "256MiB", "--no-hugepages",
             "--metrics-port", "0", "--reconnect-timeout", "2"],
            env={**os.environ, "UCX_TLS": "tcp"}, capture_output=True, text=True, timeout=60,
            cwd=tmp_path, preexec_fn=lambda: _join(cgroup))
    finally:
        os.rmdir(cgroup)
    assert node.returncode == 2, node.stderr[-2000:]
    assert "the host cannot back a 256.0 MiB arena" in node.stderr
    assert "memory cgroup" in node.stderr and "--no-prefault" in node.stderr


def _join(cgroup: str) -> None:
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


class _Unbacked:
    """The arena's region as a host without the memory answers: the first
    GiB is made, then the kernel refuses (what MADV_POPULATE_WRITE returns
    when the pages cannot be had)."""

    def populate(self, offset: int, length: int) -> int:
        return errno.ENOMEM if offset > 0 else 0


class _Arena:
    size = 3 << 30
    page_kind = "4k"
    region = _Unbacked()


def test_a_host_that_cannot_back_the_arena_fails_the_start_saying_what_to_do():
    node = StorageNode(NodeConfig(control="127.0.0.1:1", arena_bytes=_Arena.size))
    node.state.arena = _Arena()
    with pytest.raises(ConfigError) as failed:
        asyncio.run(node._populate_arena())
    message = str(failed.value)
    assert "cannot back a 3.0 GiB arena" in message and "after 1.0 GiB of 4k pages" in message
    assert "--arena" in message and "--no-prefault" in message
    assert "Cannot allocate memory" in message
