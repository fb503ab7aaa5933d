#!/usr/bin/env python3
"""Render the distore-ucx Kubernetes manifests with your parameters.

    python3 cluster/kubernetes/render.py \
        --set IMAGE=registry.example.com/distore-ucx:0.1.0 \
        --set RDMA_RESOURCE=rdma/hca_shared_devices_a \
        | kubectl apply -f -

Every `${NAME}` in the templates beside this file is a parameter; DEFAULTS
below lists them all with their defaults, `--list` prints them. Standard
library only, so it runs wherever kubectl does.
"""

from __future__ import annotations

import argparse
import os
import re
import string
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = ("namespace.yaml", "config.yaml", "control.yaml", "storage.yaml", "learner-job.yaml")

DEFAULTS = {
    "NAMESPACE": "distore",
    "IMAGE": "distore-ucx:0.1.0",  # an image with `pip install distore-ucx` (and your learner)
    "CONTROL_PORT": "7700",
    # Prometheus /metrics of the control plane and of each storage node (pods
    # carry prometheus.io/scrape annotations; see docs/operations.md, Metrics).
    "CONTROL_METRICS_PORT": "9770",
    "NODE_METRICS_PORT": "9771",
    # Storage nodes run on the nodes carrying this label (value "true").
    "STORAGE_LABEL": "distore.io/storage",
    "ARENA_GIB": "64",  # arena per storage node, in GiB, backed by 2 MiB hugepages
    "NODE_MEMORY_GIB": "4",  # ordinary memory for the node process besides its arena
    # The disk tier of each storage node: a file in DISK_HOST_DIR on the host's
    # NVMe, DISK_GIB large ("0": no disk tier).
    "DISK_GIB": "0",
    "DISK_HOST_DIR": "/mnt/nvme/distore",
    # The RDMA device plugin's extended resource, e.g. rdma/rdma_shared_device_a
    # (Mellanox k8s-rdma-shared-dev-plugin) or rdma/hca (SR-IOV); see the guide.
    "RDMA_RESOURCE": "rdma/rdma_shared_device_a",
    "RDMA_COUNT": "1",
    "UCX_TLS": "rc,sm,self",  # InfiniBand / RoCE; "tcp" on clusters without RDMA
    "UCX_NET_DEVICES": "mlx5_0:1",
    "HEARTBEAT_TIMEOUT": "2.0",
    "TOKEN_SECRET": "distore-token",  # Secret with key "token" (required: create it first)
    "LEARNER_GPUS": "1",
}

_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


def render(params: dict[str, str] | None = None, templates=TEMPLATES) -> str:
    """All manifests as one multi-document YAML string.

    Unknown parameter names and templates that name a parameter without a
    value are errors, never silently left as `${...}`.
    """
    values = dict(DEFAULTS)
    for key, value in (params or {}).items():
        if key not in DEFAULTS:
            raise KeyError(f"unknown parameter {key!r}; known: {', '.join(sorted(DEFAULTS))}")
        values[key] = str(value)
    # Derived: the tier file inside the pod ("" = no disk tier).
    values["DISK_FILE"] = ("" if values["DISK_GIB"] in ("", "0")
                           else "/var/lib/distore/node.tier")
    docs = []
    for name in templates:
        with open(os.path.join(HERE, name), encoding="utf-8") as fh:
            text = fh.read()
        try:
            docs.append(string.Template(text).substitute(values).strip() + "\n")
        except KeyError as exc:
            raise KeyError(f"{name} uses ${{{exc.args[0]}}}, which has no value") from None
    return "---\n".join(docs)


def main(argv: list[str] | None = None) -> int:
    """Command line: --set NAME=VALUE (repeatable), --list."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a parameter (repeatable)")
    p.add_argument("--list", action="store_true", help="print the parameters and defaults")
    args = p.parse_args(argv)
    if args.list:
        for key, value in DEFAULTS.items():
            print(f"{key}={value}")
        return 0
    params = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not _NAME.match(key):
            p.error(f"--set {item!r}: expected NAME=VALUE")
        params[key] = value
    try:
        sys.stdout.write(render(params))
    except KeyError as exc:
        p.error(str(exc.args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
