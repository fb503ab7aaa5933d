"""`distore status`: a control plane's nodes, memory and tables, with rates.

Two looks at the status `--interval` s apart give each table's inserts,
samples and deletes per second; `--watch` repeats until ^C, reconnecting
to a control plane that restarts; `--json` prints the status as it came,
with the rates added. cli.py parses the command line and calls
`run_status`.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time


def format_size(n: int) -> str:
    """A byte count as people read it: "512 B", "1.5 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def with_rates(before: dict | None, after: dict, seconds: float) -> dict:
    """`after`, each table with inserts/s, samples/s and deletes/s since `before`."""
    old = {t["name"]: t for t in (before or {}).get("tables", [])}
    for t in after["tables"]:
        prev = old.get(t["name"])
        for counter in ("inserts", "samples", "deletes"):
            rate = None
            if prev is not None and seconds > 0:
                rate = max(0.0, (t[counter] - prev[counter]) / seconds)
            t[f"{counter}_per_s"] = rate
    after["rate_interval_s"] = seconds if before is not None else None
    return after


def format_status(address: str, st: dict) -> str:
    """The status `st` as the text `distore status` prints."""

    def rate(v):
        return "-" if v is None else f"{v:.1f}"

    def state(n):  # "live", "unresponsive" (routed around, items kept) or "gone"
        return n.get("state") or ("live" if n["alive"] else "gone")

    alive = sum(n["alive"] for n in st["nodes"])
    away = sum(state(n) == "unresponsive" for n in st["nodes"])
    out = [f"control plane {address}: {alive} of {len(st['nodes'])} nodes alive"
           + (f" ({away} unresponsive: routed around, items kept)" if away else "")
           + f", {len(st['tables'])} tables, {st['leases']} leases"]
    ck = st.get("checkpoint")
    if ck:
        out.append(f"last checkpoint: {ck['items']} items, {format_size(ck['bytes'])} to "
                   f"{ck['path']} {time.time() - ck['created']:.0f} s ago ({ck['why']})")
    if st.get("restoring_s") is not None:
        waiting = sum(t.get("awaiting_restore", 0) for t in st["tables"])
        out.append(f"restoring: {waiting} checkpointed items not yet re-sent by nodes; "
                   f"{st['restoring_s']:.0f} s left")
    out.append(f"{'node':>5} {'name':<28} {'address':<22} {'state':<12} {'used':>11} "
               f"{'arena':>11} {'used%':>6}")
    gone = [n for n in st["nodes"] if state(n) == "gone"]
    for n in st["nodes"]:
        if state(n) == "gone":
            continue  # listed apart below: its memory is nobody's any more
        pct = 100.0 * n["used_bytes"] / n["arena_size"] if n["arena_size"] else 0.0
        out.append(f"{n['node_id']:>5} {n['name'][:28]:<28} {n['address']:<22} "
                   f"{state(n):<12} {format_size(n['used_bytes']):>11} "
                   f"{format_size(n['arena_size']):>11} {pct:>5.1f}%")
    if gone:
        out.append("gone (their items left the tables; memory not counted): "
                   + ", ".join(f"node {n['node_id']} ({n['name']}, {n['address']})"
                               for n in gone))
    out.append(f"{'table':<20} {'size':>10} {'capacity':>10} {'inserts/s':>10} "
               f"{'samples/s':>10} {'inserts':>10} {'samples':>10} {'deletes':>10}")
    for t in st["tables"]:
        out.append(f"{t['name'][:20]:<20} {t['size']:>10} {t['capacity']:>10} "
                   f"{rate(t.get('inserts_per_s')):>10} {rate(t.get('samples_per_s')):>10} "
                   f"{t['inserts']:>10} {t['samples']:>10} {t['deletes']:>10}")
    out.extend(f"warning: {text}" for text in st.get("warnings") or ())
    return "\n".join(out)


def run_status(address: str, args, token_file: str | None = None) -> int:
    """`distore status`: print the status once, or every `args.interval` s
    with --watch until ^C or SIGTERM; the exit code."""
    import warnings

    from .client import connect
    from .errors import CapacityWarning, ConnectionFailed, Timeout

    # The status's warnings are printed with it, as lines of its own.
    warnings.simplefilter("ignore", CapacityWarning)
    stop = threading.Event()
    if args.watch:  # SIGTERM and ^C end the watch cleanly, at once
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    interval = max(0.0, args.interval)
    client = None
    before, t_before = None, 0.0
    try:
        while True:
            try:
                if client is None:
                    client = connect(address, timeout=10, token_file=token_file)
                st, now = client.status(), time.monotonic()
                if before is None and interval > 0 and not args.watch:
                    before, t_before = st, now  # a second look, for the rates
                    if stop.wait(interval):
                        return 0
                    st, now = client.status(), time.monotonic()
            except (ConnectionFailed, Timeout) as exc:
                if not args.watch:
                    raise
                if client is not None:
                    client.close()
                client, before = None, None
                print(f"{time.strftime('%H:%M:%S')} {exc}; retrying", flush=True)
                if stop.wait(max(interval, 1.0)):
                    return 0
                continue
            st = with_rates(before, st, now - t_before)
            before, t_before = st, now
            if args.json:
                print(json.dumps(st, default=str), flush=True)
            else:
                if args.watch and sys.stdout.isatty():
                    print("\033[H\033[J", end="")
                if args.watch:
                    print(time.strftime("%Y-%m-%d %H:%M:%S"))
                print(format_status(address, st), flush=True)
            if not args.watch or stop.wait(interval or 1.0):
                return 0
    finally:
        if client is not None:
            client.close()
