"""Fault stress: learners read flat out, checking every byte, while storage
nodes are killed and hung and a hostile client releases leases it does not own.

    python perf/stress_faults.py --seconds 600 --tls tcp
    python perf/stress_faults.py --seconds 600 --tls sm --mapped    # same-host mapping

A LocalCluster of `--nodes` storage nodes holds one table whose capacity is
far below what the writer inserts, so slots are evicted and reused all the
time. Running together, on threads of this process:

- `--learners` learners sample batches flat out; every item's payload is a
  function of its key and is checked (a wrong item is one whose bytes differ);
- a writer inserts flat out (its errors are counted, not fatal: a batch in
  flight on a killed node may fail);
- an attacker (its own connection) samples one item at a time and releases
  lease ids around its own and every id the learners were given;
- a chaos loop, every `--interval` s on average, either SIGKILLs a random
  node and starts a replacement, or SIGSTOPs one for 0.5-6 s (longer than
  the 2 s heartbeat timeout about half the time: the control plane drops it,
  and on SIGCONT it discards its items and re-joins) and SIGCONTs it. One
  node at a time is faulted.

Prints progress lines and, at the end, one JSON line of totals. Exits 1 when
any item was wrong or a learner or the writer stopped on an error, 0 otherwise. Runs on
127.0.0.1 only (UCX_NET_DEVICES=lo).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import threading
import time

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCX_LOG_LEVEL", "error")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import numpy as np

SPEC = {"payload": ((1000,), "uint8"), "key": ((), "uint64")}


def make(keys: np.ndarray) -> dict:
    """Items whose payload is a function of their key."""
    keys = np.asarray(keys, np.uint64)
    payload = ((keys[:, None] * np.uint64(2654435761)) >> np.uint64(7)).astype(
        np.uint8
    ) + np.arange(1000, dtype=np.uint8)
    return {"payload": payload, "key": keys}


def wrong(batch) -> int:
    """Items of a batch whose bytes are not what was inserted under their key."""
    d = batch.data
    bad = d["key"] != batch.keys
    bad |= (make(batch.keys)["payload"] != d["payload"]).any(axis=1)
    return int(bad.sum())


class Totals:
    """Counters shared by the threads (each key written by one thread)."""

    def __init__(self):
        self.c = collections.Counter()
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def add(self, **kw) -> None:
        with self.lock:
            self.c.update(kw)

    def error(self, who: str, exc: BaseException) -> None:
        print(f"{who}: {exc!r}"[:400], flush=True)
        with self.lock:
            self.c[f"{who}_errors"] += 1
            if len(self.errors) < 20:
                self.errors.append(f"{who}: {exc!r}"[:300])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--tls", default="tcp", help="UCX_TLS for every process (tcp, sm)")
    ap.add_argument(
        "--mapped",
        action="store_true",
        help="same-host learners map the arenas (default: off, UCX/CMA reads)",
    )
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--learners", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--interval", type=float, default=4.0, help="mean s between faults")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument(
        "--faults",
        default="kill,hang,release",
        help="comma-separated subset of kill, hang, release",
    )
    args = ap.parse_args(argv)
    os.environ["UCX_TLS"] = args.tls
    os.environ["DISTORE_LOCAL_MAP"] = "1" if args.mapped else "0"
    import distore_ucx as ds

    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)
    totals = Totals()
    stop = threading.Event()
    seen: collections.deque = collections.deque(maxlen=256)  # lease ids learners got
    cluster = ds.LocalCluster(
        nodes=args.nodes, arena_bytes=32 << 20, env={"UCX_TLS": args.tls}, log_level="WARNING"
    )
    t_start = time.monotonic()
    with cluster, ds.connect(cluster.address) as admin:
        admin.create_table("t", capacity=4000, spec=SPEC)
        with admin.writer(max_items=100) as w:
            for _ in range(40):
                w.insert("t", make(w.next_keys(100)))

        def writer():
            try:
                with ds.connect(cluster.address) as c, c.writer(max_items=50) as w:
                    while not stop.is_set():
                        keys = w.next_keys(50)
                        try:
                            w.insert("t", make(keys))
                            w.flush()
                            totals.add(inserted=50)
                        except ds.DistoreError as exc:
                            totals.error("writer", exc)
                            time.sleep(0.1)
            except Exception as exc:  # noqa: BLE001 - reported in the totals
                totals.error("writer_fatal", exc)

        def learner(index: int):
            try:
                with ds.connect(cluster.address) as c:
                    lrn = c.learner("t", batch_size=args.batch)
                    _record_leases(lrn, seen)
                    while not stop.is_set():
                        try:
                            batch = lrn.sample(timeout=30)
                        except ds.DistoreError as exc:
                            totals.error("learner", exc)
                            continue
                        nbad = wrong(batch)
                        totals.add(sampled=len(batch), wrong=nbad)
                        if nbad and os.environ.get("STRESS_DEBUG"):
                            d = batch.data
                            bad = (d["key"] != batch.keys) | (
                                make(batch.keys)["payload"] != d["payload"]
                            ).any(axis=1)
                            own = (make(d["key"])["payload"] == d["payload"]).all(axis=1)
                            print(
                                "WRONG asked",
                                batch.keys[bad][:4],
                                "slot key",
                                d["key"][bad][:4],
                                "payload matches slot key",
                                own[bad][:4],
                                flush=True,
                            )
                    totals.add(resampled=lrn.resampled, torn=lrn.torn)
                    lrn.close()
            except Exception as exc:  # noqa: BLE001 - reported in the totals
                totals.error("learner_fatal", exc)

        def attacker():
            try:
                with ds.connect(cluster.address) as c:
                    conn = c.connection()
                    while not stop.is_set():
                        try:
                            own = conn.call("sample", table="t", n=1, timeout=5.0)
                        except ds.DistoreError:
                            time.sleep(0.05)
                            continue
                        lid = own["lease"]
                        guesses = [lid + d for d in range(-32, 33) if d] + list(seen)
                        reply = conn.call("release", leases=guesses)
                        totals.add(foreign_releases=len(guesses), refused=reply["refused"])
                        conn.call("release", leases=[lid])
                        time.sleep(0.01)
                    conn.close()
            except Exception as exc:  # noqa: BLE001 - reported in the totals
                totals.error("attacker", exc)

        faults = set(args.faults.split(","))
        threads = [threading.Thread(target=writer)]
        if "release" in faults:
            threads.append(threading.Thread(target=attacker))
        threads += [threading.Thread(target=learner, args=(i,)) for i in range(args.learners)]
        for th in threads:
            th.start()
        deadline = t_start + args.seconds
        next_report = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                time.sleep(
                    min(rng.expovariate(1.0 / args.interval), max(0.0, deadline - time.monotonic()))
                )
                if time.monotonic() >= deadline:
                    break
                _fault(cluster, rng, totals, faults)
                if time.monotonic() > next_report:
                    next_report += 30
                    print(_line(totals, t_start), flush=True)
        finally:
            stop.set()
            for th in threads:
                th.join(90)
    result = dict(totals.c)
    result.update(
        seconds=round(time.monotonic() - t_start, 1),
        tls=args.tls,
        mapped=args.mapped,
        seed=seed,
        errors=totals.errors,
    )
    print(json.dumps(result), flush=True)
    bad = result.get("wrong", 0) > 0 or any(
        result.get(k, 0) for k in ("learner_fatal_errors", "writer_fatal_errors")
    )
    return 1 if bad else 0


def _fault(cluster, rng: random.Random, totals: Totals, faults: set[str]) -> None:
    """Kill or hang one random live node (and undo it)."""
    live = [i for i, p in enumerate(cluster.nodes) if p is not None and p.alive()]
    if len(live) < 2:
        cluster.add_node()
        return
    if not faults & {"kill", "hang"}:
        return
    index = rng.choice(live)
    if "kill" in faults and ("hang" not in faults or rng.random() < 0.4):
        cluster.kill_node(index)
        totals.add(kills=1)
        cluster.add_node()
    else:
        pid = cluster.nodes[index].pid
        hang = rng.uniform(0.5, 6.0)
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(hang)
        finally:
            os.kill(pid, signal.SIGCONT)
        totals.add(hangs=1, hangs_past_drop=int(hang > 2.5))


def _record_leases(learner, seen: collections.deque) -> None:
    """Note every lease id the learner's connection is given (what the
    attacker tries to release)."""
    conn = learner._rpc
    for name in ("call", "receive"):
        orig = getattr(conn, name)

        def wrapped(*args, _orig=orig, **kwargs):
            reply = _orig(*args, **kwargs)
            if isinstance(reply, dict) and "lease" in reply:
                seen.append(reply["lease"])
            return reply

        setattr(conn, name, wrapped)


def _line(totals: Totals, t0: float) -> str:
    c = totals.c
    return (
        f"{time.monotonic() - t0:6.0f} s: sampled {c['sampled']} wrong {c['wrong']} "
        f"inserted {c['inserted']} kills {c['kills']} hangs {c['hangs']} "
        f"foreign releases {c['foreign_releases']} (refused {c['refused']}) "
        f"learner errors {c['learner_errors']} writer errors {c['writer_errors']}"
    )


if __name__ == "__main__":
    sys.exit(main())
