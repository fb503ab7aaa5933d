"""The sample path end to end, through the public API: learner.sample() back to back.

For each workload (W1: 32 x 110 KB prioritized, W2: 8 x 3 MB uniform, W3: 4 x 10 MB
prioritized, as issue #12 states them) it starts a LocalCluster of ``--nodes`` storage
nodes on this host (write protection on, the default), fills a table of ``--fill-bytes``
with items whose every byte is known, and times ``learner.sample()`` called back to
back for ``--seconds`` with each read path:

mapped
    the default: same-host nodes' arenas mapped read-only, plain-load copies.
ucx
    ``local_map=False``: the same nodes read over UCX with the ``--tls`` in force.

Baseline, same run: a numpy gather of the same number of rows of the same size from an
in-process array of the same total size (``np.take(..., mode="clip")``, random rows):
the single-core memory-copy ceiling. With ``--cpprb``, a second baseline: cpprb's
shared-memory ring (``MPReplayBuffer``) of the same rows, filled by another process,
sampled here (``rb.sample``, one contiguous array per field, as a user gets it).

``--contiguous`` samples as a learner that needs one contiguous array per field (a torch
model input, most host-to-device copies): after each ``sample()`` it calls
``np.ascontiguousarray`` on every field and counts that time in the figure, and reports
its share (``contig_ms``: mean per batch) and how many batches it had to copy.

``--rounds R`` splits every measure (numpy, cpprb, each path) into R slices of
``--seconds / R`` run in turn, round after round, so that a load that comes and goes on
a shared machine falls on all of them alike; figures are then over all slices, and
``vs_numpy_median`` / ``vs_cpprb_median`` are the medians of the per-round ratios.

Sampled bytes per second are item bytes x items over wall time (GB/s = 10^9 B/s);
p50/p99 are per ``sample()`` call (with ``--contiguous``, the copy included). The first
and the last batch of each run are checked byte for byte (exit status 1 on a mismatch).

Output: one JSON line per (workload, path) on stdout, then a table; progress on stderr.

    cd /tmp && <venv>/bin/python <repo>/perf/sample_path.py --seconds 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import common
import numpy as np
from common import JsonLines, apply_ucx_env, fmt, log

MiB = 1 << 20
WORKLOADS = {
    "W1": (112_896, 32, "prioritized"),
    "W2": (3 * MiB, 8, "uniform"),
    "W3": (10 * MiB, 4, "prioritized"),
}


_PATTERN: dict[int, np.ndarray] = {}


def items(keys: np.ndarray, size: int) -> np.ndarray:
    """Rows whose bytes follow from their key (byte j of key k: (k + j) mod 251)."""
    pattern = _PATTERN.setdefault(size, (np.arange(size) % 251).astype(np.uint16))
    shift = (np.asarray(keys, np.uint64) % np.uint64(251)).astype(np.uint16)
    return ((pattern[None, :] + shift[:, None]) % 251).astype(np.uint8)


def check(batch, size: int) -> bool:
    """Every byte of every item as inserted (the key is stored in the first 8 bytes)."""
    data = batch.data
    key = data[:, :8].copy().view(np.uint64)[:, 0]
    expect = items(key, size)
    expect[:, :8] = data[:, :8]
    return bool(np.array_equal(data, expect))


class Timed:
    """Back-to-back calls of one measure, in slices: how many, their wall
    time and each call's latency."""

    def __init__(self, step, batch: int, size: int):
        self.step, self.batch, self.size = step, batch, size
        self.calls, self.wall, self.lat, self.rounds = 0, 0.0, [], []

    def run(self, seconds: float) -> float:
        """Call step() back to back for `seconds`; GB/s of this slice."""
        calls = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            t = time.perf_counter()
            self.step()
            self.lat.append(time.perf_counter() - t)
            calls += 1
        wall = time.perf_counter() - t0
        self.calls += calls
        self.wall += wall
        self.rounds.append(calls * self.batch * self.size / wall / 1e9)
        return self.rounds[-1]

    def result(self) -> dict:
        lat = np.array(self.lat)
        return {"gbps": self.calls * self.batch * self.size / self.wall / 1e9,
                "p50_ms": float(np.percentile(lat, 50)) * 1e3,
                "p99_ms": float(np.percentile(lat, 99)) * 1e3, "rounds": self.rounds}


def numpy_baseline(size: int, batch: int, n_rows: int) -> Timed:
    """np.take of `batch` random rows of an (n_rows, size) array, back to back."""
    arena = np.ones((n_rows, size), np.uint8)
    out = np.empty((batch, size), np.uint8)
    rng = np.random.default_rng(0)

    def step():
        np.take(arena, rng.integers(0, n_rows, batch), axis=0, out=out, mode="clip")

    for _ in range(5):
        step()
    return Timed(step, batch, size)


def _cpprb_fill(rb, size: int, n_rows: int) -> None:
    """The cpprb baseline's writer process: n_rows items, 8 at a time."""
    data = np.ones((8, size), np.uint8)
    for i in range(0, n_rows, 8):
        rb.add(obs=data[: min(8, n_rows - i)])


def cpprb_baseline(size: int, batch: int, n_rows: int) -> Timed:
    """cpprb's shared-memory ring: filled by another process, sampled here."""
    from cpprb import MPReplayBuffer

    ctx = mp.get_context("fork")  # the ring's shared memory goes with the child
    rb = MPReplayBuffer(n_rows, {"obs": {"shape": (size,), "dtype": np.uint8}}, ctx=ctx)
    filler = ctx.Process(target=_cpprb_fill, args=(rb, size, n_rows))
    filler.start()
    filler.join()
    if filler.exitcode != 0:
        raise RuntimeError(f"the cpprb writer process failed (exit code {filler.exitcode})")
    out = rb.sample(batch)["obs"]
    assert out.flags.c_contiguous and out.shape == (batch, size)
    for _ in range(5):
        rb.sample(batch)
    return Timed(lambda: rb.sample(batch), batch, size)


def contiguous(batch) -> tuple[float, int]:
    """np.ascontiguousarray of every field, as a user needing dense arrays does:
    (seconds it took, fields it had to copy)."""
    fields = batch.data.values() if isinstance(batch.data, dict) else [batch.data]
    t = time.perf_counter()
    dense = [np.ascontiguousarray(a) for a in fields]
    took = time.perf_counter() - t
    return took, sum(not np.shares_memory(d, a) for d, a in zip(dense, fields))


def run_workload(args, name: str) -> list[dict]:
    import distore_ucx as ds
    from distore_ucx.storage.arena import page_size_label

    size, batch, sampler = WORKLOADS[name]
    n = max(4 * batch, args.fill_bytes // size)
    arena = n * (size + 64) // args.nodes + 64 * MiB
    log(f"[{name}] {n} items of {size} B over {args.nodes} nodes, batch {batch}")
    rows = []
    with ds.LocalCluster(nodes=args.nodes, arena_bytes=arena, hugepages=args.hugepages,
                         env={"UCX_TLS": args.tls}) as cluster, \
            ds.connect(cluster.address) as client:
        pages = sorted({page_size_label(d.get("page_kind", "")) for d in client.nodes()})
        log(f"[{name}] arena pages: {', '.join(pages)}")
        client.create_table(
            "t", capacity=n, spec=((size,), "uint8"),
            sampler=ds.Prioritized(alpha=0.6) if sampler == "prioritized" else ds.Uniform())
        with client.writer(max_items=max(1, (4 * MiB) // size)) as writer:
            for i in range(0, n, 8):
                keys = np.arange(i, min(n, i + 8), dtype=np.uint64)
                data = items(keys, size)
                data[:, :8] = keys[:, None].view(np.uint8)
                writer.insert("t", data, priority=np.random.default_rng(i).random(len(keys)) + 0.1)
        base = numpy_baseline(size, batch, n)
        ring = cpprb_baseline(size, batch, n) if args.cpprb else None
        measures = [base] + ([ring] if ring is not None else [])
        learners, timed, contig, oks = {}, {}, {}, {}
        try:
            for path in args.paths:
                learner = client.learner("t", batch_size=batch, local_map=path == "mapped",
                                         copy_threads=args.copy_threads)
                learners[path] = learner
                oks[path] = check(learner.sample(), size)
                for _ in range(10):
                    learner.sample()
                contig[path] = [0.0, 0]  # seconds in np.ascontiguousarray, batches it copied

                def step(learner=learner, c=contig[path]):
                    b = learner.sample()
                    if args.contiguous:
                        took, k = contiguous(b)
                        c[0] += took
                        c[1] += k > 0

                timed[path] = Timed(step, batch, size)
                measures.append(timed[path])
            slice_s = args.seconds / args.rounds
            for _ in range(args.rounds):  # in turn: a passing load falls on all alike
                for m in measures:
                    m.run(slice_s)
            base_r = base.result()
            ring_r = ring.result() if ring is not None else None
            if ring_r is not None:
                log(f"[{name}] cpprb shared-memory ring: {ring_r['gbps']:.2f} GB/s")
            for path, learner in learners.items():
                ok = oks[path] and check(learner.sample(), size)
                r = timed[path].result()
                gbps, calls = r["gbps"], timed[path].calls
                contig_s, copied = contig[path]
                per_np = np.array(r["rounds"]) / np.array(base_r["rounds"])
                per_rb = (np.array(r["rounds"]) / np.array(ring_r["rounds"])
                          if ring_r is not None else None)
                rows.append({
                    "workload": name, "item_bytes": size, "batch": batch, "sampler": sampler,
                    "path": path, "paths": sorted(set(learner.paths.values())),
                    "tls": args.tls, "gbps": gbps, "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
                    "numpy_gbps": base_r["gbps"], "vs_numpy": gbps / base_r["gbps"],
                    "vs_numpy_median": float(np.median(per_np)), "rounds": args.rounds,
                    "contiguous": args.contiguous,
                    "contig_ms": contig_s / calls * 1e3, "contig_copied_batches": copied,
                    "cpprb_gbps": ring_r and ring_r["gbps"],
                    "vs_cpprb": ring_r and gbps / ring_r["gbps"],
                    "vs_cpprb_median": None if per_rb is None else float(np.median(per_rb)),
                    "resampled": learner.resampled, "verified": ok, "arena_pages": pages,
                })
                log(f"[{name}] {path}: {gbps:.2f} GB/s (numpy {base_r['gbps']:.2f}"
                    + (f", contiguity {1e3 * contig_s / calls:.3f} ms/batch, "
                       f"{copied} of {calls} batches copied" if args.contiguous else "")
                    + ")")
        finally:
            for learner in learners.values():
                learner.close()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="W1,W2,W3")
    p.add_argument("--paths", default="mapped,ucx", help="mapped and/or ucx")
    p.add_argument("--tls", default="sm", help="UCX_TLS for the cluster and the ucx path")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--fill-bytes", type=int, default=768 * MiB,
                   help="bytes stored in the table (default 768 MiB, beyond any cache)")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure each of numpy, cpprb and every path in this many slices, "
                        "in turn (on a shared machine, so that load falls on all alike)")
    p.add_argument("--copy-threads", type=int, default=None)
    p.add_argument("--hugepages", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for 2 MiB arena pages, as `distore node` does (default); "
                        "granted only where the admin allows (see `distore doctor`)")
    p.add_argument("--contiguous", action="store_true",
                   help="sample as a learner needing dense arrays: np.ascontiguousarray of "
                        "every field after each sample(), its time counted")
    p.add_argument("--cpprb", action="store_true",
                   help="also measure cpprb's shared-memory ring (MPReplayBuffer) filled by "
                        "another process (pip install cpprb)")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    args.paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    apply_ucx_env(args.tls)
    rows = []
    with JsonLines(args.json_out) as out:
        for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
            for row in run_workload(args, name):
                out.write(row)
                rows.append(row)
    head = ["work", "item_B", "batch", "path", "GB/s", "p50_ms", "p99_ms", "contig_ms",
            "numpy_GB/s", "vs_np", "cpprb_GB/s", "vs_cpprb", "rounds", "np_med", "rb_med", "ok",
            "arena_pages"]
    common.print_table(head, [[r["workload"], str(r["item_bytes"]), str(r["batch"]),
                               r["path"], fmt(r["gbps"], ".3g"), fmt(r["p50_ms"], ".3f"),
                               fmt(r["p99_ms"], ".3f"),
                               fmt(r["contig_ms"], ".3f") if r["contiguous"] else "-",
                               fmt(r["numpy_gbps"], ".3g"), fmt(r["vs_numpy"], ".2f"),
                               fmt(r["cpprb_gbps"], ".3g"), fmt(r["vs_cpprb"], ".2f"),
                               str(r["rounds"]), fmt(r["vs_numpy_median"], ".2f"),
                               fmt(r["vs_cpprb_median"], ".2f"),
                               "yes" if r["verified"] else "NO", "/".join(r["arena_pages"])]
                              for r in rows])
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
