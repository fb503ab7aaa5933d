"""Hostile clients, round 3: a storage node's active-message listeners
(the sample and insert ports) against a peer that found them by a port
scan and never talks to the control plane (tests/integration/am_attacker.py),
and against authenticated clients that ask for more than they were granted.

Each test reproduces one attack of the issue: before the listeners asked
for anything, one request read the whole arena, a flood of insert messages
held 1 GB of the node or starved writers, 4,000 idle connections crowded
out learners, and any client could heartbeat for a hung node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
from helpers import wait_for

import distore_ucx as ds

ATTACKER = os.path.join(os.path.dirname(__file__), "am_attacker.py")
SPEC = {"obs": ((20_000,), "uint8"), "step": ((), "int64")}
ARENA = 16 << 20


@pytest.fixture
def store(token_file, monkeypatch):
    """A one-node store over TCP with a token, 200 items in a table, and a
    client that has the token."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("DISTORE_LOCAL_MAP", "0")  # this host's clients go over UCX too
    cluster = ds.LocalCluster(nodes=1, arena_bytes=ARENA, token_file=token_file,
                              log_level="WARNING", env={"UCX_TLS": "tcp"})
    cluster.start()
    client = ds.connect(cluster.address, token_file=token_file)
    try:
        client.create_table("t", capacity=400, spec=SPEC)
        with client.writer() as w:
            w.insert("t", {"obs": np.full((200, 20_000), 7, np.uint8),
                           "step": np.arange(200)})
        node = client.nodes()[0]
        assert node.get("sample_port") and node.get("insert_port"), node
        yield cluster, client, node
    finally:
        client.close()
        cluster.stop()


def attack(*args, timeout: float = 120.0) -> list[dict]:
    """Run the attacker to its end; its JSON lines."""
    env = {**os.environ, "UCX_TLS": "tcp"}
    out = subprocess.run([sys.executable, ATTACKER, *map(str, args)], capture_output=True,
                         text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def host_of(node: dict) -> str:
    return node["address"].rpartition(":")[0]


def node_process(cluster) -> psutil.Process:
    return psutil.Process(cluster.nodes[0].pid)


def rss(proc: psutil.Process) -> int:
    return proc.memory_info().rss


def check_served(client, n: int = 3) -> None:
    """A legitimate writer and learner still store and read, by active message."""
    with client.writer() as w:
        w.insert("t", {"obs": np.full((32, 20_000), 9, np.uint8), "step": np.arange(32)})
    learner = client.learner("t", batch_size=16)
    try:
        assert all(p.startswith("ucx-am:") for p in learner.paths.values()), learner.paths
        for _ in range(n):
            batch = learner.sample(timeout=20)
            assert ((batch.data["obs"] == 7) | (batch.data["obs"] == 9)).all()
    finally:
        learner.close()


def test_no_byte_of_the_arena_without_the_capability_and_a_grant(store, token_file):
    cluster, client, node = store
    # No capability: the request is dropped unread, the connection closed.
    steps = attack("read", host_of(node), node["sample_port"], ARENA)
    read = [s for s in steps if s["step"] == "read"][0]
    assert read["bytes_read"] == 0 and read["status"] != 0, steps
    # A wrong capability: refused at once.
    steps = attack("read", host_of(node), node["sample_port"], ARENA, "--cap", "00" * 16)
    auth = [s for s in steps if s["step"] == "authenticate"][0]
    assert auth["name"] == "UCS_ERR_REJECTED", steps
    assert [s for s in steps if s["step"] == "read"][0]["bytes_read"] == 0, steps
    # The control plane's capability but no grant (an authenticated client
    # asking for a slot it was not given): refused, nothing sent.
    steps = attack("forge", cluster.address, node["node_id"], "--token-file", token_file)
    read = [s for s in steps if s["step"] == "read"][0]
    assert read["name"] == "UCS_ERR_REJECTED" and read["bytes_read"] == 0, steps
    check_served(client)


def test_a_silent_connection_is_closed_within_seconds(store):
    cluster, client, node = store
    holder = subprocess.Popen([sys.executable, ATTACKER, "hold", host_of(node),
                               str(node["sample_port"]), "--count", "1", "--linger", "6"],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "UCX_TLS": "tcp"})
    try:
        assert json.loads(holder.stdout.readline())["count"] == 1
        opened = time.monotonic()

        def closed():
            return "1 connection(s) closed without authenticating" in open(
                cluster.nodes[0].log_path).read()

        # The node closes it while the attacker holds on, saying nothing.
        wait_for(closed, 5, "the node to close the silent connection")
        assert time.monotonic() - opened < 3.0
        assert holder.poll() is None
    finally:
        holder.kill()  # its linger (6 s) only bounds the wait above
        holder.communicate(timeout=30)


@pytest.mark.parametrize("count,size", [(65_600, 8), (2_000, 512 << 10)],
                         ids=["many-small", "large"])
def test_unauthenticated_insert_floods_hold_no_memory_nor_stop_writers(store, count, size):
    cluster, client, node = store
    proc = node_process(cluster)
    before = rss(proc)
    flood = subprocess.Popen([sys.executable, ATTACKER, "flood", host_of(node),
                              str(node["insert_port"]), "--count", str(count), "--bytes",
                              str(size), "--linger", "6"], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "UCX_TLS": "tcp"})
    try:
        peak = before
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # while it floods and lingers
            peak = max(peak, rss(proc))
            time.sleep(0.1)
        check_served(client, 1)  # an insert while the attacker is still connected
        peak = max(peak, rss(proc))
    finally:
        flood.kill()  # nothing is measured after this point: its linger need not run out
        out, _ = flood.communicate(timeout=60)
    assert peak - before < 64 << 20, (before, peak, out)


def test_thousands_of_idle_connections_leave_learners_and_writers_their_path(store):
    cluster, client, node = store
    holders = [subprocess.Popen([sys.executable, ATTACKER, "hold", host_of(node), str(port),
                                 "--count", "2000", "--linger", "8"], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "UCX_TLS": "tcp"})
               for port in (node["sample_port"], node["insert_port"])]
    try:
        opened = [json.loads(h.stdout.readline()) for h in holders]
        opened_at = time.monotonic()
        assert all(o["count"] == 2000 for o in opened), opened
        # While the attacker holds 4,000 connections, a new learner and a
        # new writer connect, authenticate and are served by active message.
        check_served(client)
        # The node closes the idle connections itself, as it closes one
        # (test_a_silent_connection_is_closed_within_seconds), while the
        # attacker lingers (8 s, then it exits): polled until then.
        deadline = opened_at + 10.0
        while ("closed without authenticating" not in (log := open(
                cluster.nodes[0].log_path).read()) and time.monotonic() < deadline):
            time.sleep(0.1)
    finally:
        for h in holders:
            h.kill()  # after the node closed their connections: they hold nothing
        outs = [h.communicate(timeout=120)[0] for h in holders]
    assert "closed without authenticating" in log, outs


def test_a_spoofed_heartbeat_keeps_no_hung_node_live(store, token_file):
    cluster, client, node = store
    steps = attack("beat", cluster.address, node["node_id"], "--token-file", token_file)
    assert steps[0]["ok"] is False and "not it" in steps[0]["error"], steps
    pid = cluster.nodes[0].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        beater = subprocess.Popen(
            [sys.executable, "-c", "import subprocess, sys, time\n"
             "t = time.monotonic()\n"
             "while time.monotonic() - t < 6:\n"
             f"    subprocess.run([sys.executable, {ATTACKER!r}, 'beat', {cluster.address!r}, "
             f"'{node['node_id']}', '--token-file', {token_file!r}])\n"],
            start_new_session=True)  # its process group: it and the beat running now

        def state():
            return {n["node_id"]: n.get("state") for n in client.status()["nodes"]}

        try:
            wait_for(lambda: state()[node["node_id"]] != "live", 15,
                     "the stopped node to be marked unresponsive", state)
        finally:
            os.killpg(beater.pid, signal.SIGKILL)  # its 6 s only bound the wait above
            beater.wait(30)
    finally:
        os.kill(pid, signal.SIGCONT)
