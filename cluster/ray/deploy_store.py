#!/usr/bin/env python3
"""Start (or stop) a distore-ucx store on a running Ray cluster.

    python3 cluster/ray/deploy_store.py --arena 64GiB --token-file /shared/token   # every Ray node
    python3 cluster/ray/deploy_store.py --nodes 4 --token-file /shared/token \
        --env UCX_TLS=rc,sm,self
    python3 cluster/ray/deploy_store.py --shutdown

Prints the control plane address (give it to writers and learners as
DISTORE_CONTROL). The actors are detached: the store outlives this script
until --shutdown. Needs `pip install 'distore-ucx[ray]'` on every Ray node.
"""

from __future__ import annotations

import argparse
import sys

import ray

import distore_ucx.ray as dray


def main(argv: list[str] | None = None) -> int:
    """Command line of this script."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    p.add_argument("--name", default=dray.DEFAULT_NAME, help="store name (actor name prefix)")
    p.add_argument("--namespace", default="distore", help="Ray namespace of the actors")
    p.add_argument("--nodes", default=None,
                   help="how many Ray nodes get a storage node, or a comma-separated list of "
                        "Ray node ids (default: all)")
    p.add_argument("--control-node", default=None, help="Ray node id for the control plane")
    p.add_argument("--arena", default="4GiB", help="arena per storage node")
    p.add_argument("--disk", default=None,
                   help="disk tier file of each storage node, on its Ray node's NVMe")
    p.add_argument("--disk-size", default=None, help="size of each disk tier, e.g. 1TiB")
    p.add_argument("--port", type=int, default=7700, help="control plane port (0 = any)")
    p.add_argument("--config", default=None, help="a distore.toml present on every Ray node")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment for every process, e.g. UCX_TLS=rc,sm,self (repeatable)")
    p.add_argument("--no-hugepages", action="store_true", help="never use 2 MiB pages")
    p.add_argument("--token-file", default=None,
                   help="the shared secret, a file at that path on every Ray node (required "
                        "unless --insecure; clients pass it too)")
    p.add_argument("--insecure", action="store_true",
                   help="run without a token (trusted, isolated networks only)")
    p.add_argument("--metrics-port", default=None,
                   help="control plane's Prometheus /metrics port (default 9770; 0 = none)")
    p.add_argument("--node-metrics-port", default=None,
                   help="each storage node's Prometheus /metrics port (default 9771; 0 = none)")
    p.add_argument("--shutdown", action="store_true", help="stop the store named --name")
    args = p.parse_args(argv)

    ray.init(address=args.address, namespace=args.namespace, log_to_driver=False)
    if args.shutdown:
        dray.shutdown(args.name, namespace=args.namespace)
        print(f"store {args.name!r} stopped")
        return 0
    nodes = None
    if args.nodes:
        nodes = int(args.nodes) if args.nodes.isdigit() else args.nodes.split(",")
    env = dict(item.split("=", 1) for item in args.env)
    address = dray.deploy(nodes, arena=args.arena, name=args.name, namespace=args.namespace,
                          control_node=args.control_node, port=args.port,
                          config_file=args.config, env=env, hugepages=not args.no_hugepages,
                          token_file=args.token_file, insecure=args.insecure,
                          metrics_port=args.metrics_port,
                          node_metrics_port=args.node_metrics_port,
                          disk=args.disk, disk_size=args.disk_size)
    for node in dray.storage_nodes(args.name, namespace=args.namespace):
        print(f"storage node {node['node_id']} at {node['address']} on Ray node "
              f"{node['ray_node_id']}", file=sys.stderr)
    targets = dray.metrics_targets(args.name, namespace=args.namespace)
    if targets:
        print(f"Prometheus targets: {', '.join(targets)}", file=sys.stderr)
    print(address)
    return 0


if __name__ == "__main__":
    sys.exit(main())
