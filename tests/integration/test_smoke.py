"""The fast lane's end-to-end test (`pytest -m "not slow"`): real processes
over UCX tcp and sm, one pass through every role. The rest of
tests/integration is the slow lane (tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_keyed, keyed_items, keyed_spec

pytestmark = [pytest.mark.smoke,
              pytest.mark.parametrize("tls", ["tcp", "sm"], indirect=True)]

WIDTH = 4096


def test_insert_sample_update_and_status_end_to_end(client, tls):
    import distore_ucx as ds

    client.create_table("smoke", capacity=1_000, spec=keyed_spec(WIDTH),
                        sampler=ds.Prioritized(alpha=1.0))
    with client.writer(max_items=100) as writer:
        keys = writer.insert("smoke", keyed_items(0, 500, WIDTH), priority=1.0)
    assert len(np.unique(keys)) == 500
    assert client.table_info("smoke")["size"] == 500

    with client.learner("smoke", batch_size=32, sample_ahead=1) as learner:
        batch = learner.sample(timeout=30)
        check_keyed(batch, WIDTH)  # every byte of every item
        assert set(batch.keys.tolist()) <= set(keys.tolist())
        # One item gets almost all the priority mass: the next batches follow it.
        favourite = batch.keys[0]
        prios = np.full(len(batch.keys), 1e-6)
        prios[batch.keys == favourite] = 1e6
        assert learner.update_priorities(batch.keys, prios) is None  # not waited for
        later = learner.sample(timeout=30)
        later = learner.sample(timeout=30)  # past any batch asked for before the update
        check_keyed(later, WIDTH)
        assert np.mean(later.keys == favourite) > 0.9
        assert learner.flush_priorities() == {"updated": len(batch.keys), "missing": 0}

    status = client.status()
    alive = [n for n in status["nodes"] if n["alive"]]
    assert len(alive) == 2 and all(n["used_bytes"] > 0 for n in alive)
