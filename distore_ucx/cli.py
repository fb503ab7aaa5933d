"""The `distore` command. The command line and DISTORE_* variables are read
here, and only here, and passed down as typed configuration.

    distore control --port 7700
    distore node --control HOST:7700 --arena 4GiB
    distore status --control HOST:7700
    distore demo --seconds 20
    distore doctor
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from .config import ControlConfig, NodeConfig, parse_size
from .errors import DistoreError


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get("DISTORE_" + name, default)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = argparse.ArgumentParser(prog="distore", description="distore-ucx replay store")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"),
                   help="DEBUG, INFO, WARNING, ERROR (env DISTORE_LOG_LEVEL)")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("control", help="run the control plane")
    c.add_argument("--host", default=_env("HOST", "0.0.0.0"), help="address to listen on")
    c.add_argument("--port", type=int, default=int(_env("PORT", "7700")),
                   help="port (0 = any free port; env DISTORE_PORT)")
    c.add_argument("--heartbeat-timeout", type=float, default=2.0,
                   help="drop a storage node silent this long (s)")
    c.add_argument("--lease-timeout", type=float, default=30.0,
                   help="a sampled slot is protected this long at most (s)")
    c.add_argument("--seed", type=int, default=None, help="seed the samplers (tests)")
    c.add_argument("--ready-file", help=argparse.SUPPRESS)

    n = sub.add_parser("node", help="run a storage node")
    n.add_argument("--control", default=_env("CONTROL"), required=_env("CONTROL") is None,
                   help="control plane HOST:PORT (env DISTORE_CONTROL)")
    n.add_argument("--arena", default=_env("ARENA", "4GiB"),
                   help="arena size, e.g. 4GiB (env DISTORE_ARENA)")
    n.add_argument("--host", default=_env("NODE_HOST", ""),
                   help="address writers and learners reach this node at "
                        "(default: the one that routes to the control plane)")
    n.add_argument("--port", type=int, default=0, help="insert port (0 = any free)")
    n.add_argument("--name", default="", help="node name in status output")
    n.add_argument("--no-hugepages", action="store_true", help="never use 2 MiB pages")
    n.add_argument("--ready-file", help=argparse.SUPPRESS)

    s = sub.add_parser("status", help="show nodes and tables of a running store")
    s.add_argument("--control", default=_env("CONTROL", "127.0.0.1:7700"),
                   help="control plane HOST:PORT (env DISTORE_CONTROL)")
    s.add_argument("--json", action="store_true", help="print JSON")

    d = sub.add_parser("demo", help="run a local cluster with a writer and a verifying learner")
    d.add_argument("--seconds", type=float, default=20.0, help="how long to sample (default 20)")
    d.add_argument("--nodes", type=int, default=2, help="storage nodes (default 2)")
    d.add_argument("--arena", default="1GiB", help="arena per node (default 1GiB)")
    d.add_argument("--batch-size", type=int, default=32, help="items per batch (default 32)")
    d.add_argument("--capacity", type=int, default=8000, help="table capacity (default 8000)")
    d.add_argument("--insert-rate", type=float, default=400.0,
                   help="writer items/s (default 400, DQN on Atari's rate; 0 = flat out)")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")

    b = sub.add_parser("bench", help="run the perf suite (needs a source checkout's perf/)")
    b.add_argument("--out", help="results folder (default ./bench-results/<timestamp>)")
    b.add_argument("--quick", action="store_true", help="short runs of every script")
    b.add_argument("--only", help="comma-separated subset of replay,bandwidth,latency")
    b.add_argument("--perf-dir", help="the perf/ folder (default: beside the package)")

    doc = sub.add_parser("doctor", help="check UCX, GPUs, NICs and hugepages for the sample path")
    doc.add_argument("--json", action="store_true", help="print JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `distore` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
    try:
        if args.command == "control":
            from .control.server import main as control_main

            cfg = ControlConfig(host=args.host, port=args.port,
                                heartbeat_timeout=args.heartbeat_timeout,
                                heartbeat_interval=min(0.5, args.heartbeat_timeout / 4),
                                lease_timeout=args.lease_timeout, seed=args.seed)
            return control_main(cfg, args.ready_file)
        if args.command == "node":
            from .storage.node import main as node_main

            cfg = NodeConfig(control=args.control, arena_bytes=parse_size(args.arena),
                             host=args.host, port=args.port, name=args.name,
                             hugepages=not args.no_hugepages)
            return node_main(cfg, args.ready_file)
        if args.command == "status":
            return _status(args)
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(args)
        if args.command == "doctor":
            return _doctor(args)
        if args.command == "bench":
            from .bench import run_bench

            return run_bench(args)
    except DistoreError as exc:
        print(f"distore {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


def _doctor(args) -> int:
    from .doctor import diagnose, format_report

    report = diagnose()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print("\n".join(format_report(report)))
    return 0


def _status(args) -> int:
    from .client import connect

    with connect(args.control, timeout=10) as client:
        st = client.status()
    if args.json:
        print(json.dumps(st, indent=2, default=str))
        return 0
    print(f"control plane {args.control}: {len(st['tables'])} tables, {st['leases']} leases")
    print(f"{'node':>5} {'name':<28} {'address':<22} {'alive':<6} {'used':>12} {'arena':>12}")
    for n in st["nodes"]:
        print(f"{n['node_id']:>5} {n['name'][:28]:<28} {n['address']:<22} {str(n['alive']):<6} "
              f"{n['used_bytes']:>12} {n['arena_size']:>12}")
    print(f"{'table':<20} {'size':>10} {'capacity':>10} {'inserts':>10} {'samples':>10} "
          f"{'deletes':>10}")
    for t in st["tables"]:
        print(f"{t['name'][:20]:<20} {t['size']:>10} {t['capacity']:>10} {t['inserts']:>10} "
              f"{t['samples']:>10} {t['deletes']:>10}")
    return 0
