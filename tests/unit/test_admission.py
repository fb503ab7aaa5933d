"""Admission: calls a table's rate limiter holds wait on the control plane's
event loop until the table's counts change, and time out with its counts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import distore_ucx as ds
from distore_ucx.control.admission import Admission
from distore_ucx.control.tables import Table
from distore_ucx.errors import ConfigError, NoData, RateLimiterTimeout
from distore_ucx.spec import TableSpec


def queue_table(size: int) -> Table:
    return Table.make("q", 100, TableSpec.parse(((8,), "uint8")), rate_limiter=ds.Queue(size),
                      seed=1)


def add(table: Table, keys) -> None:
    keys = np.asarray(keys, np.uint64)
    table.add(1, keys, keys * np.uint64(64), np.ones(len(keys), np.uint64),
              np.ones(len(keys), np.float64))


def test_a_held_insert_proceeds_once_a_sample_touches_the_table():
    table, admission = queue_table(2), Admission()
    add(table, [1, 2])  # the queue is full

    async def main():
        held = asyncio.create_task(admission.insert(table, 1, timeout=30.0))
        await asyncio.sleep(0)
        assert not held.done()
        assert table.stats.holds["insert"] == 1 and table.stats.waiting["insert"] == 1
        table.sample(1)
        admission.touch(table)
        await asyncio.wait_for(held, 5.0)

    asyncio.run(main())
    assert table.stats.waiting["insert"] == 0 and table.stats.timeouts["insert"] == 0


def test_a_call_that_may_proceed_is_not_counted_as_held():
    table, admission = queue_table(2), Admission()
    asyncio.run(admission.insert(table, 2, timeout=0.0))
    assert table.stats.holds["insert"] == 0


def test_a_held_insert_times_out_with_the_counts():
    table, admission = queue_table(2), Admission()
    add(table, [1, 2])
    with pytest.raises(RateLimiterTimeout, match=r"queue rate limiter held an insert of 1 "
                       r"items for 0.05 s \(size 2, inserts 2, samples 0"):
        asyncio.run(admission.insert(table, 1, timeout=0.05))
    assert table.stats.timeouts["insert"] == 1 and table.stats.waiting["insert"] == 0


def test_a_sample_of_an_empty_table_is_no_data():
    table, admission = queue_table(2), Admission()
    with pytest.raises(NoData, match="has no items to sample yet"):
        asyncio.run(admission.sample(table, 1, timeout=0.0))
    assert table.stats.holds["sample"] == 1 and table.stats.timeouts["sample"] == 1


def test_a_batch_the_limiter_can_never_admit_is_refused_at_once():
    table, admission = queue_table(2), Admission()
    with pytest.raises(ConfigError, match="can never admit a batch of 3 inserts"):
        asyncio.run(admission.insert(table, 3, timeout=30.0))
    assert table.stats.holds["insert"] == 0
