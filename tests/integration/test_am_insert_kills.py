"""Writers killed mid-batch never crash, wedge or leak a node taking inserts
as UCX active messages (native/am_insert.h, am_connections.h).

Over UCX_TLS=tcp, a receiver running the node's pieces (am_kill_peers.py:
the guarded runtime, an Arena, an AmInbox listening for writers, pull_am on
one pull thread) takes batches from 100 writers in turn, every other one
sending its items in runs (several to a message, received through a bounce
chunk) and the rest one a message, each SIGKILLed at
a random moment while the receiver pulls its batches (every tenth is
SIGSTOPped instead, a writer that hangs, and killed once its batches have
timed out). After each kill the batches' pulls all end; every item they
report received holds exactly its bytes; nothing is written into a failed
item's slot after its pull returned; and at the end no slot, message,
connection or receive is left, memory is flat, and the receiver closes
cleanly (UCX's cleanup included).
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from distore_ucx._native_loader import _native

PEERS = Path(__file__).with_name("am_kill_peers.py")
ITEM = 256 << 10  # bytes per item: runs of 4 fill a node's bounce chunk
RUN = _native.AmInbox.run_bytes  # what a node takes in one message
ITEMS = 8  # per batch (am_kill_peers.ITEMS)
BATCHES = 2  # per writer
# 60 in the suite (its 15-minute budget); DISTORE_AM_KILLS=1000 for a deeper run.
KILLS = int(os.environ.get("DISTORE_AM_KILLS", "60"))
RESET = _native.status_name(-25)  # UCS_ERR_CONNECTION_RESET: the writer died mid-receive


class Peer:
    """A peer process whose JSON lines are read with a deadline, by kind (the
    first key of each line)."""

    def __init__(self, role: str, cwd: Path, env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, str(PEERS), role, str(ITEM)], cwd=cwd,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.lines: dict[str, queue.Queue] = {}
        self.mu = threading.Lock()
        self.exited = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _queue(self, kind: str) -> queue.Queue:
        with self.mu:
            return self.lines.setdefault(kind, queue.Queue())

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            self._queue(next(iter(msg))).put(msg)
        self.exited.set()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self, kind: str, what: str, timeout: float = 60.0) -> dict:
        q = self._queue(kind)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                pass
            if self.exited.is_set() and q.empty():
                raise AssertionError(f"{what}: the process exited with {self.proc.wait()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout} s: the receiver is wedged")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def test_writers_killed_mid_batch_never_crash_wedge_or_leak_the_receiver(tmp_path):
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo", UCX_WARN_UNUSED_ENV_VARS="n",
               UCX_LOG_LEVEL="fatal")
    receiver = Peer("receiver", tmp_path, env)
    zygote = Peer("zygote", tmp_path, env)
    try:
        port = receiver.read("port", "the receiver's port")["port"]
        zygote.read("zygote", "the zygote")
        rng = random.Random(20261125)
        tally: Counter = Counter()
        mid, rss = Counter(), []

        def writer_batches(timeout: float, landed: int, run: int = 0) -> tuple[int, list[int]]:
            """Start a writer (items in runs of up to `run` bytes, or one a
            message), have its batches pulled, return once `landed` TCP puts
            of its items' bytes have landed (into slots, or bounce chunks)."""
            tokens = [rng.getrandbits(62) | 1 for _ in range(BATCHES)]
            zygote.send(f"spawn {port} waits {run} " + " ".join(map(str, tokens)))
            pid = zygote.read("sent", "a writer")["pid"]
            receiver.send("puts")
            puts = receiver.read("puts", "the put count")["puts"]
            for token in tokens:
                receiver.send(f"pull {token} 8 {timeout}")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                receiver.send("puts")
                if receiver.read("puts", "the put count")["puts"] >= puts + landed:
                    return pid, tokens
                time.sleep(0.001)
            raise AssertionError(f"{landed} items of a writer did not land within 60 s")

        def results(tokens: list[int], what: str) -> list[dict]:
            out = [receiver.read("pulled", f"the pull of {what}") for _ in tokens]
            assert [r["pulled"] for r in out] == tokens
            for r in out:
                assert r["bad"] == 0, f"{what}: an item reported received holds wrong bytes"
                tally.update(_native.status_name(s) for s in r["statuses"])
            return out

        # Writers left alone: every item lands whole, one a message or in runs.
        for run in (0, RUN):
            pid, tokens = writer_batches(30.0, 1, run)
            first = results(tokens, "an undisturbed writer")
            assert all(s == 0 for r in first for s in r["statuses"])
            os.kill(pid, signal.SIGKILL)

        # KILLS writers at least; more (up to twice as many) until kills in
        # both modes landed mid-rendezvous often enough: where a kill lands
        # is chance (between two messages, no receive is cut), and a fixed
        # count fell short of the coverage asked below about 1 run in 6.
        kills = 0
        while kills < KILLS or (kills < 2 * KILLS and min(mid["single"], mid["runs"]) < KILLS // 8):
            k = kills
            kills += 1
            hang = k % 10 == 9
            # Every other writer sends runs; of the hung ones (every tenth), too.
            run = RUN if (k + k // 10) % 2 else 0
            # Killed once some of its messages have started landing (a TCP put
            # each), not all.
            messages = BATCHES * (-(-ITEMS * ITEM // run) if run else ITEMS)
            pid, tokens = writer_batches(1.0 if hang else 30.0,
                                         rng.randint(1, messages - 1), run)
            if hang:
                # A writer that hangs mid-batch: its batches time out, their
                # receives end by a forced close of its connection.
                os.kill(pid, signal.SIGSTOP)
                out = results(tokens, f"hung writer {k}")
                os.kill(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
                time.sleep(rng.uniform(0, 0.05))
                for token in tokens:  # the node's watcher: the control connection closed
                    receiver.send(f"discard {token} 8")
                out = results(tokens, f"killed writer {k}")
            mid["runs" if run else "single"] += any(
                _native.status_name(s) == RESET for r in out for s in r["statuses"])
            if k % 10 == 9:
                receiver.send("stats")
                s = receiver.read("waiting", "stats")
                assert s["late_writes"] == 0, "bytes landed in a failed item's slot after its pull"
                assert s["used_bytes"] == 0 and s["waiting"] == 0, s
                assert s["connections"]["abandoned_receives"] == 0, s
                rss.append(s["rss_kb"])

        # Every dead writer's connection closed (the receiver notices on progress).
        deadline = time.monotonic() + 30
        while True:
            receiver.send("stats")
            s = receiver.read("waiting", "stats")
            if s["connections"]["open"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        c = s["connections"]
        assert c["open"] == 0 and c["accepted"] == kills + 2 and c["refused"] == 0, c
        assert c["failed"] + c["aborted"] == kills + 2, c
        assert c["abandoned_receives"] == 0, c
        assert s["waiting"] == 0 and s["used_bytes"] == 0 and s["late_writes"] == 0, s
        # The kills did land mid-rendezvous, and batches were received whole too.
        assert tally["UCS_OK"] > 0 and mid["single"] >= KILLS // 8, (tally, mid)
        assert mid["runs"] >= KILLS // 8, (tally, mid)
        if len(rss) >= 3:  # after warm-up, memory stays flat (the arena is touched at start)
            assert rss[-1] - rss[1] < 16 * 1024, rss
        # A writer still connected when the receiver closes: its connection
        # is force-closed with the rest, and UCX's cleanup is clean.
        pid, tokens = writer_batches(30.0, 1)
        results(tokens, "the last writer")
        receiver.send("quit")
        assert receiver.read("closed", "the receiver's close")["closed"]
        assert receiver.proc.wait(30) == 0
        os.kill(pid, signal.SIGKILL)
        print(json.dumps({"kills": kills, "mid_rendezvous": dict(mid), "statuses": dict(tally),
                          "connections": c, "rss_kb": rss}))
    finally:
        receiver.stop()
        zygote.stop()


def test_writers_whose_receiver_dies_mid_batch_close_cleanly(tmp_path):
    # The other side: a receiver killed while it pulls leaves writers with
    # sends under way; each sees its endpoint fail and closes its endpoint,
    # staging buffer and UCX context without crashing (no memory handle of
    # its own is passed on a send, see native/am_insert.h).
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo", UCX_WARN_UNUSED_ENV_VARS="n",
               UCX_LOG_LEVEL="fatal")
    zygote = Peer("zygote", tmp_path, env)
    rng = random.Random(7)
    try:
        zygote.read("zygote", "the zygote")
        for round_ in range(3):
            receiver = Peer("receiver", tmp_path, env)
            try:
                port = receiver.read("port", "the receiver's port")["port"]
                tokens = [rng.getrandbits(62) | 1 for _ in range(BATCHES)]
                run = RUN if round_ % 2 else 0
                zygote.send(f"spawn {port} closes {run} " + " ".join(map(str, tokens)))
                zygote.read("sent", "a writer")
                receiver.send("puts")
                puts = receiver.read("puts", "the put count")["puts"]
                for token in tokens:
                    receiver.send(f"pull {token} 8 30")
                deadline = time.monotonic() + 60
                while True:
                    receiver.send("puts")
                    if receiver.read("puts", "the put count")["puts"] > puts + round_:
                        break
                    assert time.monotonic() < deadline, "no byte of the writer's landed"
                    time.sleep(0.001)
            finally:
                receiver.stop()  # SIGKILL, mid-batch
            closed = zygote.read("writer_closed", "the writer's clean close", timeout=60)
            assert closed["status"] != "UCS_OK", closed
    finally:
        zygote.stop()
