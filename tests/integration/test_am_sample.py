"""Samples by active message between two processes over UCX tcp on
127.0.0.1 (native/am_sample.h; both ends are perf/am_sample_peer.py): every
byte of dense batches of the workloads' sizes, and a learner SIGKILLed
mid-batch while the node serves on. tests/unit/test_am_sample.py covers the
API in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_for

PEER = Path(__file__).resolve().parents[2] / "perf" / "am_sample_peer.py"
MiB = 1 << 20


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update({"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_LOG_LEVEL": "error",
              "UCX_WARN_UNUSED_ENV_VARS": "n"})
    return e


class NodeProcess:
    """perf/am_sample_peer.py's node role; stats and exit through its stdin."""

    def __init__(self, tmp_path, item_bytes: int, slots: int, *extra: str):
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), "node", "--item-bytes", str(item_bytes), "--fields", "3",
             "--slots", str(slots), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env(), cwd=tmp_path)
        self.hello = self.proc.stdout.readline()
        if not self.hello:
            raise AssertionError(f"the node did not start: {self.proc.stderr.read()[-2000:]}")

    def stats(self) -> dict:
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> dict:
        """Exit; returns its last line ({"closed": bool})."""
        if self.proc.poll() is not None:
            return {}
        self.proc.stdin.write("exit\n")
        self.proc.stdin.flush()
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise
        return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def start_node(tmp_path):
    nodes = []

    def start(item_bytes: int, slots: int, *extra: str) -> NodeProcess:
        nodes.append(NodeProcess(tmp_path, item_bytes, slots, *extra))
        return nodes[-1]

    yield start
    for n in nodes:
        if n.proc.poll() is None:
            n.proc.kill()
            n.proc.wait()


def learner(tmp_path, node: NodeProcess, item_bytes: int, batch: int, *extra: str,
            timeout: float = 120.0) -> dict:
    r = subprocess.run(
        [sys.executable, str(PEER), "learner", node.hello, "--item-bytes", str(item_bytes),
         "--fields", "3", "--batch", str(batch), *extra],
        capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("item_bytes,batch", [(112_896, 32), (3 * MiB, 8), (10 * MiB, 4)],
                         ids=["110KBx32", "3MBx8", "10MBx4"])
@pytest.mark.parametrize("error_handling", [False, True], ids=["plain", "peer-failure"])
def test_every_byte_of_dense_batches_lands(tmp_path, start_node, item_bytes, batch,
                                           error_handling):
    node = start_node(item_bytes, 2 * batch)
    extra = ["--error-handling"] if error_handling else []
    got = learner(tmp_path, node, item_bytes, batch, "--batches", "4", *extra)
    # Every byte of every field of every row, the headers beside, the
    # fields C-contiguous (asserted by the peer).
    assert got["bad"] == 0 and got["statuses"] == [0], got
    assert got["client"]["late"] == 0 and got["client"]["malformed"] == 0
    wait_for(lambda: node.stats()["batches_done"] == 4, 30.0, "the node's sends to end",
             node.stats)
    stats = node.stats()
    assert stats["batches_failed"] == 0 and stats["refused"] == 0
    assert stats["guard"]["tcp_puts"] == 0  # the node's guard ended no connection
    assert node.stop() == {"closed": True}


def test_a_learner_killed_mid_batch_leaves_the_node_serving(tmp_path, start_node):
    item, batch = 10 * MiB, 4
    node = start_node(item, 2 * batch, "--stall", "2")
    for kill in range(3):
        want = node.stats()["requests"] + 1 + kill % 2  # killed in its first or second batch
        proc = subprocess.Popen(
            [sys.executable, str(PEER), "learner", node.hello, "--item-bytes", str(item),
             "--fields", "3", "--batch", str(batch), "--check", "0"],  # batches until killed
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env(), cwd=tmp_path)
        try:
            # Mid-batch: the node has the learner's request and is sending.
            wait_for(lambda: node.stats()["requests"] >= want, 60.0,  # noqa: B023
                     "the learner's batches to be under way", node.stats)
        finally:
            proc.kill()
            proc.wait()
        assert node.proc.poll() is None, "the node died with its learner"
        # The batch ends (its sends fail) or is abandoned after the stall:
        # either way it stops holding the node's capacity.
        wait_for(lambda: node.stats()["in_flight"] == 0, 30.0, "the dead learner's batch to end",
                 node.stats)
        # The next learner gets whole batches.
        got = learner(tmp_path, node, item, batch, "--batches", "2")
        assert got["bad"] == 0 and got["statuses"] == [0], got
    stats = node.stats()
    assert stats["batches_failed"] + stats["abandoned"] >= 1, stats
    assert node.proc.poll() is None
    # A batch UCX never failed may keep its sends (and the arena) at exit.
    assert "closed" in node.stop()
