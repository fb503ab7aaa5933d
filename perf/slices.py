"""Slices of episodes against items of the same bytes, same run (issue 47).

Starts a LocalCluster of ``--nodes`` storage nodes on this host and, for each read path
(``mapped``: same-host arenas mapped; ``ucx``: ``local_map=False`` over ``--tls``):

items
    W3: a table of 10 MB items (prioritized), ``learner.sample()`` of 4 back to back.
slices
    the R2D2 shape with the same bytes a batch: a table of slices of 80 steps, period
    40, of 128 KiB steps (prioritized), episodes of ``--episode`` steps appended by 8
    envs; ``learner.sample()`` of 4 slices (4 x 80 x 128 KiB = 40 MiB) back to back.

and reports GB/s and p50/p99 per batch for both, and the ratio slices / items. Then,
with ``--scale N1,N2`` (steps), the p50 of one slice sample (32 slices of 8 small steps)
at each table size, to show that drawing a slice does not grow with the table
(``--scale 10000,10000000``: about a minute and 1 GiB of arena at 10^7 steps).
``--torchrl`` adds TorchRL's in-process ``SliceSampler`` on a LazyTensorStorage of the
same steps and sizes, sampled the same way, for reference, and the same sampler on a
``DistoreReplayBuffer`` (``rb.sample()``: the flat TensorDict of 32 slices of 8).

Every slice sampled is checked: its steps are consecutive positions of one episode
(exit 1 otherwise). Arena bytes per stored step are printed for both shapes (a step
costs its bytes and a 16-byte header; R2D2 sequences stored as items cost 80 steps per
40 new ones: 2x).

    cd /tmp && <venv>/bin/python <repo>/perf/slices.py --seconds 4
"""

from __future__ import annotations

import argparse
import sys
import time

import common
import numpy as np
import psutil
from common import JsonLines, apply_ucx_env, fmt, log

from distore_ucx.config.values import parse_size

KiB, MiB = 1 << 10, 1 << 20
T, PERIOD, STEP = 80, 40, 128 * KiB
ITEM = 10 * MiB
SLICES, ITEMS = 4, 4  # a batch: 40 MiB either way


def step_spec(step_bytes: int) -> dict:
    return {"obs": ((step_bytes - 16,), "uint8"), "episode": ((), "int64"),
            "pos": ((), "int64")}


def append_episodes(client, table: str, steps_total: int, step_bytes: int,
                    episode_len: int, envs: int = 8) -> None:
    """Episodes of `episode_len` steps, `envs` at a time, each step's position
    and episode in its bytes."""
    obs = np.zeros((envs, step_bytes - 16), np.uint8)
    with client.writer() as w:
        for t in range(steps_total // envs):
            pos = t % episode_len
            episode = (t // episode_len) * envs + np.arange(envs)
            obs[:, :8] = pos % 251
            w.append(table, {"obs": obs, "episode": episode, "pos": np.full(envs, pos)},
                     env=np.arange(envs), done=np.full(envs, pos == episode_len - 1))


def check_slices(batch) -> bool:
    pos, ep = batch.data["pos"], batch.data["episode"]
    return bool((np.diff(pos, axis=1) == 1).all() and (ep == ep[:, :1]).all())


def time_samples(learner, seconds: float, check) -> tuple[np.ndarray, bool]:
    for _ in range(3):  # warm up
        learner.sample()
    lat, ok = [], True
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        b = learner.sample()
        lat.append(time.perf_counter() - t0)
        if check is not None:
            ok &= check(b)
    return np.array(lat), ok


def row(kind: str, path: str, lat: np.ndarray, nbytes: int, ok: bool) -> dict:
    return {"kind": kind, "path": path, "GB/s": nbytes * len(lat) / lat.sum() / 1e9,
            "p50_ms": 1e3 * float(np.median(lat)), "p99_ms": 1e3 * float(np.quantile(lat, 0.99)),
            "batches": len(lat), "ok": ok}


def run_paths(args, ds, out: JsonLines) -> list[dict]:
    rows = []
    env = apply_ucx_env(args.tls)
    arena = max(256 * MiB, 2 * args.fill_bytes // args.nodes + 64 * MiB)  # both tables
    with ds.LocalCluster(nodes=args.nodes, arena_bytes=arena, env=env,
                         log_level="WARNING") as cluster, ds.connect(cluster.address) as client:
        client.create_table("items", capacity=args.fill_bytes // ITEM,
                            spec={"obs": ((ITEM,), "uint8")}, sampler=ds.Prioritized(0.6))
        with client.writer() as w:
            for _ in range(args.fill_bytes // ITEM // 4):
                w.insert("items", {"obs": np.zeros((4, ITEM), np.uint8)})
        steps = args.fill_bytes // STEP
        client.create_table("slices", capacity=steps, spec=step_spec(STEP), slice_len=T,
                            slice_period=PERIOD, sampler=ds.Prioritized(0.6))
        log(f"appending {steps} steps of {STEP} B (episodes of {args.episode})")
        append_episodes(client, "slices", steps, STEP, args.episode)
        for path in args.paths:
            local = path == "mapped"
            for kind, table, batch, nbytes, check in (
                    ("items W3", "items", ITEMS, ITEMS * ITEM, None),
                    ("slices 80/40", "slices", SLICES, SLICES * T * STEP, check_slices)):
                learner = client.learner(table, batch_size=batch, local_map=local)
                lat, ok = time_samples(learner, args.seconds, check)
                reads = getattr(learner.stats, "ucx_reads", None)  # None: a build before runs
                learner.close()
                r = row(kind, path, lat, nbytes, ok)
                r["ucx_reads_a_batch"] = None if reads is None else int(reads[0]) / (len(lat) + 3)
                out.write(r)
                rows.append(r)
                log(f"{kind} {path}: {r['GB/s']:.2f} GB/s p50 {r['p50_ms']:.1f} ms, "
                    f"UCX reads a batch {r['ucx_reads_a_batch']}")
    return rows


def run_scale(args, ds, out: JsonLines) -> list[dict]:
    rows = []
    env = apply_ucx_env(args.tls)
    for n in args.scale:
        step = 64  # bytes a step, header included
        arena = max(64 * MiB, n * step // args.nodes * 2 + 32 * MiB)
        with ds.LocalCluster(nodes=args.nodes, arena_bytes=arena, env=env,
                             log_level="WARNING") as cluster, \
                ds.connect(cluster.address) as client:
            client.create_table("s", capacity=n, spec=step_spec(step), slice_len=8)
            control = psutil.Process(cluster.control.pid)
            before = control.memory_info().rss
            t0 = time.monotonic()
            append_episodes(client, "s", n, step, episode_len=100, envs=256)
            log(f"{n} steps appended in {time.monotonic() - t0:.1f} s")
            per_step = (control.memory_info().rss - before) / n  # the control plane's RSS
            learner = client.learner("s", batch_size=32, pipeline=False)
            lat, ok = time_samples(learner, args.seconds, check_slices)
            learner.close()
            info = client.table_info("s")
            r = {"kind": "scale", "steps": n, "valid_starts": info["valid_starts"],
                 "control_bytes_per_step": per_step,
                 "p50_ms": 1e3 * float(np.median(lat)),
                 "p99_ms": 1e3 * float(np.quantile(lat, 0.99)), "ok": ok}
            if args.torchrl:
                r["torchrl_p50_ms"] = torchrl_p50(n, args.seconds)
                r["distore_torchrl_p50_ms"] = distore_torchrl_p50(cluster, n, args.seconds)
            out.write(r)
            rows.append(r)
    return rows


def torchrl_p50(n: int, seconds: float) -> float | None:
    """TorchRL's in-process SliceSampler over n steps in episodes of 100: p50 of
    sampling 32 slices of 8."""
    try:
        from torchrl.data import LazyTensorStorage, ReplayBuffer
        from torchrl.data.replay_buffers import SliceSampler
    except ImportError as exc:
        log(f"torchrl: not installed ({exc}); pip install '.[torchrl]'")
        return None
    rb = ReplayBuffer(storage=LazyTensorStorage(n), sampler=SliceSampler(slice_len=8,
                      traj_key="episode"), batch_size=32 * 8)
    rb.extend(torchrl_steps(n))
    return p50_ms(rb.sample, seconds)


def p50_ms(sample, seconds: float) -> float:
    """p50 in ms of `sample()` called back to back for `seconds` (after 3
    calls to warm up)."""
    for _ in range(3):
        sample()
    lat = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        sample()
        lat.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(lat))


def torchrl_steps(n: int):
    """n frames of TorchRL data in episodes of 100 (obs [4], episode, done)."""
    import torch
    from tensordict import TensorDict

    episode = torch.arange(n) // 100
    done = (torch.arange(n) % 100 == 99)[:, None]
    return TensorDict({"episode": episode, "obs": torch.zeros(n, 4), ("next", "done"): done},
                      batch_size=[n])


def distore_torchrl_p50(cluster, n: int, seconds: float) -> float | None:
    """A DistoreReplayBuffer with TorchRL's SliceSampler over n steps in
    episodes of 100 (the same data as torchrl_p50's): p50 of rb.sample() of
    32 slices of 8, flat TensorDict included."""
    try:
        from torchrl.data.replay_buffers import SliceSampler

        from distore_ucx.torchrl import DistoreReplayBuffer
    except ImportError as exc:
        log(f"torchrl: not installed ({exc}); pip install '.[torchrl]'")
        return None
    with DistoreReplayBuffer(cluster.address, "torchrl", capacity=n, batch_size=32 * 8,
                             sampler=SliceSampler(slice_len=8, traj_key="episode"),
                             flush=False) as rb:
        data = torchrl_steps(n)
        for lo in range(0, n, 100_000):
            rb.extend(data[lo:lo + 100_000])
        rb.flush()
        return p50_ms(rb.sample, seconds)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tls", default="tcp,sm,self")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--fill-bytes", type=parse_size, default=640 * MiB,
                   help="bytes of each table (e.g. 640MiB)")
    p.add_argument("--episode", type=int, default=400, help="steps an episode (slices shape)")
    p.add_argument("--paths", default="mapped,ucx", type=lambda s: s.split(","))
    p.add_argument("--scale", default="", type=lambda s: [int(float(x)) for x in s.split(",") if x],
                   help="table sizes (steps) for the p50-against-size run, e.g. 10000,10000000")
    p.add_argument("--torchrl", action="store_true", help="TorchRL's SliceSampler for reference")
    p.add_argument("--no-paths", action="store_true", help="only the --scale run")
    p.add_argument("--json", default=None, help="also write the JSON lines here")
    args = p.parse_args(argv)
    import distore_ucx as ds

    out = JsonLines(args.json)
    ok = True
    if not args.no_paths:
        rows = run_paths(args, ds, out)
        by = {(r["kind"], r["path"]): r for r in rows}
        lines = []
        for path in args.paths:
            items, slices = by[("items W3", path)], by[("slices 80/40", path)]
            ok &= slices["ok"]
            lines.append([path, fmt(items["GB/s"], ".2f"), fmt(slices["GB/s"], ".2f"),
                          fmt(slices["GB/s"] / items["GB/s"], ".2f"),
                          fmt(items["p50_ms"], ".1f"), fmt(slices["p50_ms"], ".1f")])
        common.print_table(["path", "items GB/s", "slices GB/s", "slices/items", "items p50 ms",
                            "slices p50 ms"], lines)
        print(f"arena bytes a stored step: {STEP} + 16 header; R2D2 sequences as items: "
              f"{T / PERIOD:.1f}x the steps' bytes")
    if args.scale:
        rows = run_scale(args, ds, out)
        ok &= all(r["ok"] for r in rows)
        common.print_table(["steps", "valid starts", "control B/step", "p50 ms", "p99 ms",
                            "TorchRL SliceSampler p50 ms", "same on a distore buffer p50 ms"],
                           [[str(r["steps"]), str(r["valid_starts"]),
                             fmt(r["control_bytes_per_step"], ".0f"), fmt(r["p50_ms"], ".2f"),
                             fmt(r["p99_ms"], ".2f"), fmt(r.get("torchrl_p50_ms"), ".2f"),
                             fmt(r.get("distore_torchrl_p50_ms"), ".2f")]
                            for r in rows])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
