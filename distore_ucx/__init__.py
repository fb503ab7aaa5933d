"""distore-ucx: a distributed replay store with a one-sided UCX sample path."""
