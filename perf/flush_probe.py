"""perf/fanin.py --probe: what an actor's slow flushes wait on, and the run's end.

Actor side, `Probe` wraps a few parts of one writer (that writer only) with
timers: connecting to a node, handing it a staging buffer, sending a batch,
waiting for an acknowledgement, and each control-plane request by name. A
flush of at least `slow` s is kept with its start and the seconds each part
took within it; every flush of the run's last two seconds is kept too.

Run side, `sample_cpu` reads every 0.1 s how busy the host, the control
plane and the nodes are, and `summary` puts it together: slow flushes per
second of the run; what those of its first second, its middle and its last
second spent their time on; the buffers and connections the writers used;
and a timeline of the run's last seconds (flushes begun, their p50 and
max, actors done and closed, cores busy) beside what each actor's close
and exit cost.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
from common import cpu_seconds
from soak import percentiles


class Probe:
    """One actor's timers (see the module docstring)."""

    def __init__(self, client, w, slow: float):
        self.slow, self.spent, self.kept = slow, {}, []
        self.flushes = 0
        self.connects = 0  # connections made after `client.writer()` returned
        self.all: list[tuple[float, float]] = []  # every flush: (start, seconds)
        self._pool, self._conns = w._pool, w._placement.connections
        self._wrap(self._conns, "_connect", "connect")
        self._wrap(w._sender, "_staging", "handoff")
        self._wrap(w._sender, "send", "send")
        self._wrap(w._flight, "complete_oldest", "ack")
        call = client.call

        def timed_call(op, **fields):
            t = time.perf_counter()
            try:
                return call(op, **fields)
            finally:
                self._add(f"cp:{op}", time.perf_counter() - t)

        client.call = timed_call

    def _add(self, what: str, dt: float) -> None:
        self.spent[what] = self.spent.get(what, 0.0) + dt

    def _wrap(self, obj, name: str, what: str) -> None:
        f = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self._add(what, time.perf_counter() - t)
                self.connects += what == "connect"

        setattr(obj, name, timed)

    def flush(self, w, t0: float) -> float:
        """w.flush(), timed; returns its seconds."""
        self.spent = {}
        start = time.monotonic()
        w.flush()
        took = time.monotonic() - start
        self.all.append((start, took))
        if took >= self.slow:
            self.kept.append({"t": start, "at": round(start - t0, 3), "s": round(took, 3),
                              "nth": self.flushes,
                              **{k: round(v, 3) for k, v in self.spent.items()}})
        self.flushes += 1
        return took

    def done(self, out: dict, t0: float, seconds: float) -> None:
        """After the actor's last flush: its figures into its result `out`."""
        out.update(slow_flushes=self.kept, buffers=len(self._pool.buffers),
                   connects=self.connects, connections=len(self._conns._conns),
                   tail=[f for f in self.all if f[0] - t0 >= seconds - 2.0],
                   t0=t0, t_end=time.monotonic(),  # monotonic: one clock per host
                   cpu_end=sum(os.times()[:2]))

    @staticmethod
    def closed(out: dict) -> None:
        """After the writer and client closed."""
        out["t_closed"] = time.monotonic()
        out["cpu_close_ms"] = round(1e3 * (sum(os.times()[:2]) - out.pop("cpu_end")), 1)

    @staticmethod
    def last(out: dict) -> None:
        """Just before the actor puts its result and exits."""
        out["cpu_total"] = sum(os.times()[:2])


def busy_seconds() -> float:
    """CPU seconds all cores of this host spent busy so far (/proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def sample_cpu(servers: list[int], stop: threading.Event, samples: list) -> None:
    """Every 0.1 s until `stop`: (time, host busy s, control s, nodes s) into `samples`."""
    while not stop.wait(0.1):
        cpu = [cpu_seconds(p) or 0.0 for p in servers]
        samples.append((time.monotonic(), busy_seconds(), cpu[0], sum(cpu[1:])))


def summary(got: list[dict], seconds: float, cpu_samples: list, children_cpu: float) -> dict:
    """The run's probe figures (see the module docstring); `children_cpu`:
    the CPU seconds the actors used, exits included (RUSAGE_CHILDREN)."""
    slow = [dict(f, actor=r["actor"]) for r in got for f in r.get("slow_flushes", ())]
    groups = {"first_s": lambda at: at < 1.0, "middle": lambda at: 1.0 <= at < seconds - 1.0,
              "last_s": lambda at: at >= seconds - 1.0}
    out: dict = {"slow_flushes": len(slow),
                 "first_flushes": sum(f["nth"] == 0 for f in slow),
                 "per_second": [sum(int(f["at"]) == i for f in slow)
                                for i in range(int(seconds) + 1)]}
    for group, within in groups.items():
        these = [f for f in slow if within(f["at"])]
        parts: dict[str, float] = {}
        for f in these:
            for k, v in f.items():
                if k not in ("t", "at", "s", "nth", "actor"):
                    parts[k] = parts.get(k, 0.0) + v
        out[group] = {"n": len(these), "s": round(sum(f["s"] for f in these), 2),
                      **{k: round(v, 2) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}}
    finished = [r for r in got if "t_end" in r]
    if finished:
        t0s = sorted(r["t0"] for r in finished)
        ends = [r["t_end"] for r in finished]
        closed = [r["t_closed"] for r in finished if "t_closed" in r]
        for k in ("buffers", "connections", "connects"):
            v = [r[k] for r in finished]
            out[k] = {"mean": round(float(np.mean(v)), 2), "max": max(v)}
        out["start_spread_s"] = round(t0s[-1] - t0s[0], 3)
        out["close_s"] = percentiles([r["t_closed"] - r["t_end"] for r in finished
                                      if "t_closed" in r])
        out["close_cpu_ms_mean"] = round(float(np.mean(
            [r["cpu_close_ms"] for r in finished if "cpu_close_ms" in r] or [0.0])), 1)
        own = sum(r.get("cpu_total", 0.0) for r in got)
        out["exit_cpu_ms_per_actor"] = round(1e3 * (children_cpu - own) / len(got), 1)
        last = [f for f in slow if f["at"] >= seconds - 1.0]
        if last:  # how many actors had finished when they began, and closed when they ended
            done = [sum(e <= f["t"] for e in ends) for f in last]
            gone = [sum(c <= f["t"] + f["s"] for c in closed) for f in last]
            out["last_s"]["actors_done_at_start"] = [min(done), max(done)]
            out["last_s"]["actors_closed_at_end"] = [min(gone), max(gone)]
        out["tail"] = tail_timeline(got, t0s[len(t0s) // 2] + seconds - 2.0, ends, closed,
                                    cpu_samples)
    for f in slow:
        f.pop("t", None)
    out["slowest"] = sorted(slow, key=lambda f: -f["s"])[:5]
    return out


def tail_timeline(got: list[dict], since: float, ends: list, closed: list,
                  cpu: list) -> list:
    """The run's last seconds in steps of 0.2 s from `since`, a row each:
    [s from since, flushes begun, their p50 s, max s, actors done, actors
    closed, cores busy: host, control plane, nodes]."""
    flushes = [f for r in got for f in r.get("tail", ())]
    rows = []

    def at(t):  # the cpu sample nearest t
        return min(cpu, key=lambda c: abs(c[0] - t)) if cpu else None

    for i in range(20):
        lo, hi = since + 0.2 * i, since + 0.2 * (i + 1)
        took = [s for t, s in flushes if lo <= t < hi]
        if not took and all(e < lo for e in ends) and all(c < lo for c in closed):
            break
        a, b = at(lo), at(hi)
        cores = ([round((b[k] - a[k]) / (b[0] - a[0]), 2) for k in (1, 2, 3)]
                 if a and b and b[0] > a[0] else [None] * 3)
        rows.append([round(lo - since, 1), len(took),
                     round(float(np.median(took)), 3) if took else None,
                     round(max(took), 3) if took else None,
                     sum(e < hi for e in ends), sum(c < hi for c in closed), *cores])
    return rows
