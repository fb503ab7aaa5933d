"""`distore demo`: a local cluster, a writer process and a verifying learner.

The writer inserts Atari-sized synthetic items (16 x 84 x 84 uint8 frames,
112,896 bytes, as a DQN transition with stacked frames) whose payload
embeds the item's key and a checksum of its frames. The learner samples as
fast as it can and verifies every item: the embedded key must equal the key
the control plane gave for it, and the checksum must match the frames. The
demo exits 0 only if nothing was wrong.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time

import numpy as np

from .progress import Progress

FRAMES = (16, 84, 84)
SPEC = {"obs": (FRAMES, "uint8"), "key": ((), "uint64"), "checksum": ((), "uint64")}
TABLE = "demo"
WRITE_BATCH = 32


def make_items(keys: np.ndarray, pattern: np.ndarray) -> dict:
    """Synthetic items for `keys`: frames derived from the key, key, checksum."""
    obs = pattern[None, :] + (keys % np.uint64(251)).astype(np.uint8)[:, None]
    obs = obs.reshape((len(keys),) + FRAMES)
    return {"obs": obs, "key": keys, "checksum": checksum(obs)}


def checksum(obs: np.ndarray) -> np.ndarray:
    """Per-item sum of the frames read as uint64 words (wrapping)."""
    flat = obs.reshape(len(obs), -1)
    return flat.view(np.uint64).sum(axis=1, dtype=np.uint64)


def _writer(address: str, rate: float, stop, counter, errors) -> None:
    import signal

    import distore_ucx as ds

    # A terminal's ^C reaches the whole process group: the parent stops this
    # process (`stop`, then SIGTERM), which must not print a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with ds.connect(address) as client:
            writer = client.writer(max_items=WRITE_BATCH)
            pattern = np.random.default_rng(0).integers(0, 255, np.prod(FRAMES), dtype=np.uint8)
            start = time.monotonic()
            sent = 0
            while not stop.is_set():
                if rate > 0:  # pace to `rate` items/s
                    ahead = sent / rate - (time.monotonic() - start)
                    if ahead > 0:
                        stop.wait(ahead)
                        continue
                # Keys are assigned by the writer at insert; embed the same ones.
                keys = writer.next_keys(WRITE_BATCH)
                got = writer.insert(TABLE, make_items(keys, pattern))
                if not np.array_equal(got, keys):
                    raise RuntimeError("writer key assignment changed under the demo")
                writer.flush()
                sent += WRITE_BATCH
                with counter.get_lock():
                    counter.value += WRITE_BATCH
            writer.close()
    except Exception as exc:  # reported by the parent
        errors.put(f"writer failed: {type(exc).__name__}: {exc}")


def min_arena(nodes: int, batch_size: int) -> int:
    """The smallest arena per node (bytes) the demo runs on: room for the
    items its learner may hold under lease (two requests of sampling ahead)
    and the writer's batch in flight, spread over the nodes."""
    from .client.learner.sample_stream import resolve_sample_ahead
    from .spec import TableSpec

    slot = TableSpec.parse(SPEC).slot_size
    # the demo learner's sample_ahead (its default, or DISTORE_SAMPLE_AHEAD)
    ahead = resolve_sample_ahead(None, max(1, batch_size), consuming=False, slot_bytes=slot)
    held = 2 * ahead * batch_size + WRITE_BATCH
    return -(-held // max(1, nodes)) * slot


def check_arena(arena: str | int, nodes: int, batch_size: int) -> int:
    """The arena per node in bytes, or ConfigError when it is below
    min_arena: a smaller one would end in StorageFull with every item on a
    node leased."""
    from .config import parse_size
    from .errors import ConfigError

    size = parse_size(arena)
    need = min_arena(nodes, batch_size)
    if size < need:
        mib = -(-need // (1 << 20))
        raise ConfigError(
            f"--arena {arena} is too small for the demo: each of its {nodes} storage nodes needs "
            f"{need} bytes for the items its learner holds under lease while it samples ahead "
            f"and its writer's batch in flight: give --arena {mib}MiB or more, or more --nodes")
    return size


def run_demo(args) -> int:
    """Run the demo described in the module docstring; returns the exit code."""
    import os

    import distore_ucx as ds
    from distore_ucx.storage.arena import page_size_label

    check_arena(args.arena, args.nodes, args.batch_size)

    # Everything runs on this host: keep UCX's TCP lanes on loopback.
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    # With --json, stdout holds the summary alone: live lines go to stderr.
    out = sys.stderr if args.json else sys.stdout
    print(f"distore demo: starting a control plane and {args.nodes} storage nodes "
          f"({args.arena} arena each) ...", file=out, flush=True)
    ctx = mp.get_context("spawn")
    # Arenas ask for 2 MiB pages as `distore node` does; the kernel grants
    # them where the admin allows (the start line says which page size).
    with ds.LocalCluster(nodes=args.nodes, arena_bytes=args.arena, log_level="WARNING",
                         hugepages=True) as cluster:
        client = ds.connect(cluster.address)
        client.create_table(TABLE, capacity=args.capacity, spec=SPEC)
        stop, counter, errors = ctx.Event(), ctx.Value("q", 0), ctx.Queue()
        writer = ctx.Process(
            target=_writer, args=(cluster.address, args.insert_rate, stop, counter, errors),
            daemon=True,
        )
        writer.start()
        learner = client.learner(TABLE, batch_size=args.batch_size)
        item_bytes = learner.spec.item_bytes
        read_paths = dict(learner.paths)
        node_paths = ", ".join(f"node {n}: {p}" for n, p in sorted(read_paths.items()))
        pages = ", ".join(sorted({page_size_label(d.get("page_kind", ""))
                                  for d in client.nodes()}))
        print(f"control plane {cluster.address}; writer pid {writer.pid}; learner path "
              f"{learner.path}; reads {node_paths}; arena pages {pages}; "
              f"UCX_TLS={client.runtime.transports}; {item_bytes}-byte items, batches of "
              f"{args.batch_size}", file=out, flush=True)
        learner.sample(timeout=60)  # first data
        latencies: list[float] = []
        tally = {"sampled": 0, "bad_keys": 0, "bad_checksums": 0, "sample_time": 0.0}
        t0 = time.monotonic()
        problems: list[str] = []
        # A bar on a terminal; plain lines when not on one, or with --json.
        progress = Progress("sampling", total=args.seconds, unit="s", stream=out,
                            plain=args.json)
        try:
            _sample(args, learner, writer, counter, progress, t0, item_bytes, latencies,
                    problems, tally)
        except KeyboardInterrupt:
            # ^C: the store's processes stopped with it. Report what was
            # measured so far, without asking them anything more.
            progress.close()
            stop.set()
            _stop_writer(writer, 2.0)
            summary = _summary(read_paths, pages, time.monotonic() - t0, latencies, tally,
                               counter.value, item_bytes, learner.resampled, None, problems)
            summary["interrupted"] = True
            _report(summary, args, out)
            _close_quietly(learner, client)  # in the except: no waiting for a store gone
            return 130
        progress.close()
        wall = time.monotonic() - t0
        stop.set()
        _stop_writer(writer, 30.0)
        while not errors.empty():
            problems.append(errors.get())
        info = client.table_info(TABLE)
        learner.close()
        client.close()
    summary = _summary(read_paths, pages, wall, latencies, tally, counter.value, item_bytes,
                       learner.resampled, info, problems)
    _report(summary, args, out)
    return 0 if summary["ok"] else 1


def _sample(args, learner, writer, counter, progress, t0: float, item_bytes: int,
            latencies: list, problems: list, tally: dict) -> None:
    """Sample and verify for `args.seconds`, printing a live line a second;
    counts go into `tally` as they come (a ^C leaves them as they are)."""
    last, last_sampled, last_inserted = t0, 0, counter.value
    while time.monotonic() - t0 < args.seconds:
        t = time.perf_counter()
        batch = learner.sample()
        dt = time.perf_counter() - t
        bad_key = int(np.count_nonzero(batch.data["key"] != batch.keys))
        bad_sum = int(np.count_nonzero(checksum(batch.data["obs"]) != batch.data["checksum"]))
        latencies.append(dt)
        tally["sample_time"] += dt
        tally["bad_keys"] += bad_key
        tally["bad_checksums"] += bad_sum
        tally["sampled"] += len(batch)
        now = time.monotonic()
        if now - last >= 1.0:
            span = now - last
            ins = counter.value
            rate = (tally["sampled"] - last_sampled) / span
            # Wall-clock rate, verification included: the summary's
            # "with verification" figure, not its sample-path one.
            line = (f"sampled {rate:8.0f} items/s "
                    f"{rate * item_bytes / 1e9:6.2f} GB/s with verification | inserted "
                    f"{(ins - last_inserted) / span:6.0f} items/s | bad "
                    f"{tally['bad_keys'] + tally['bad_checksums']}")
            progress.set(min(now - t0, args.seconds), note=line)
            last, last_sampled, last_inserted = now, tally["sampled"], ins
        if not writer.is_alive() and writer.exitcode not in (None, 0):
            problems.append(f"writer exited with code {writer.exitcode}")
            break


def _stop_writer(writer, seconds: float) -> None:
    """Wait for the writer process (told to stop) up to `seconds`, then end it."""
    writer.join(seconds)
    if writer.is_alive():  # stuck on a store that went away (^C)
        writer.terminate()
        writer.join(5)


def _close_quietly(*objs) -> None:
    """Close each of `objs`, ignoring failures (the store may be gone)."""
    for obj in objs:
        try:
            obj.close()
        except Exception:  # noqa: BLE001  stopping on ^C; nothing left to tell
            pass


def _summary(read_paths: dict, pages: str, wall: float, latencies: list, tally: dict,
             inserted: int, item_bytes: int, resampled: int, info: dict | None,
             problems: list) -> dict:
    """The demo's figures (`info`: the table's, None when it was not asked:
    after a ^C the store's processes are gone)."""
    lat = np.array(latencies or [float("nan")]) * 1e3
    sampled, wall = tally["sampled"], max(wall, 1e-9)
    summary = {
        "read_paths": {str(n): p for n, p in sorted(read_paths.items())},
        "arena_pages": pages,
        "seconds": round(wall, 2),
        "batches": len(latencies),
        "items_sampled": sampled,
        "items_inserted": int(inserted),
        "sample_items_per_s": round(sampled / wall, 1),
        "sample_gb_per_s": round(sampled * item_bytes / max(tally["sample_time"], 1e-9) / 1e9,
                                 3),
        "wall_gb_per_s": round(sampled * item_bytes / wall / 1e9, 3),
        "batch_ms_p50": round(float(np.percentile(lat, 50)), 3),
        "batch_ms_p99": round(float(np.percentile(lat, 99)), 3),
        "resampled": resampled,
        "bad_keys": tally["bad_keys"],
        "bad_checksums": tally["bad_checksums"],
        "table_size": None if info is None else info["size"],
        "evicted": None if info is None else info["deletes"],
        "problems": problems,
    }
    summary["ok"] = (not problems and tally["bad_keys"] == 0 and tally["bad_checksums"] == 0
                     and sampled > 0 and inserted > 0)
    return summary


def _report(summary: dict, args, out) -> None:
    """Print the summary: JSON on stdout with --json, else a paragraph on `out`."""
    if args.json:
        print(json.dumps(summary), file=sys.stdout, flush=True)
        return
    evicted = "" if summary["evicted"] is None else f", {summary['evicted']} evicted"
    problems = summary["problems"]
    print(f"\nsummary: {summary['items_sampled']} items in {summary['batches']} batches over "
          f"{summary['seconds']} s; {summary['wall_gb_per_s']} GB/s with verification "
          f"(the live lines' figure); the sample path alone (control round trip + "
          f"gather) {summary['sample_gb_per_s']} GB/s; batch latency p50 "
          f"{summary['batch_ms_p50']} ms, p99 "
          f"{summary['batch_ms_p99']} ms; {summary['items_inserted']} items inserted"
          f"{evicted}; wrong keys {summary['bad_keys']}, wrong checksums "
          f"{summary['bad_checksums']}"
          + ("" if not problems else "; problems: " + "; ".join(problems)), file=out)
    if summary.get("interrupted"):
        verdict = ("interrupted (^C): the figures so far; every item sampled until then "
                   "verified" if summary["ok"] else "interrupted (^C), and FAILED")
    else:
        verdict = "OK: every sampled item verified" if summary["ok"] else "FAILED"
    print(verdict, file=out, flush=True)
