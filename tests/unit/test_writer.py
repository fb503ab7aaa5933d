"""Writer.insert's staging, in one process: no control plane, no nodes.

A fake client hands out writer ids and the table's spec; sending a batch is
replaced by recording it and handing its buffer back, so that these tests
see exactly what insert staged (client/writer/writer.py, client/writer/staging.py,
client/writer/keys.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from distore_ucx.client.writer import Writer
from distore_ucx.client.writer.failures import Failed, waiting_for_samples
from distore_ucx.client.writer.staging import OneItemLayout
from distore_ucx.errors import ConfigError, RateLimiterTimeout
from distore_ucx.spec import TableSpec
from distore_ucx.transport import UcxRuntime

# No padding between fields: one item of it can take the one-item path.
SPEC = TableSpec.parse({"obs": ((48,), np.uint8), "action": ((), np.int64),
                        "reward": ((), np.float64)})


@pytest.fixture(scope="module")
def runtime():
    with UcxRuntime() as rt:
        yield rt


class FakeClient:
    """What a Writer asks of its client, and nothing more."""

    token = None

    def __init__(self, runtime, key_bits: int = 24):
        self.runtime = runtime
        self.key_bits = key_bits
        self.registered = []  # the `previous` of each register_writer call

    def call(self, op: str, **fields) -> dict:
        assert op == "register_writer"
        self.registered.append(fields.get("previous"))
        return {"writer_id": len(self.registered), "key_bits": self.key_bits}

    def spec(self, table: str) -> TableSpec:
        return SPEC

    def slice_len(self, table: str) -> int:
        return 0  # a table of items

    def nodes(self) -> list:
        return []  # a new writer connects to the nodes listed: none here


def recording(writer: Writer) -> list:
    """Replace the writer's sends: each batch is recorded (keys, priorities,
    staged bytes) and its buffer handed back at once."""
    sent = []

    def send(batch, exclude, full=None):
        ib = batch.spec.item_bytes
        sent.append((batch.keys[: batch.n].copy(), batch.priorities[: batch.n].copy(),
                     bytes(batch.buffer.view[: batch.n * ib])))
        writer._pool.release(batch.buffer)

    writer._flight.send = send
    return sent


def item(i: int) -> dict:
    return {"obs": np.full(48, i, np.uint8), "action": np.array(i, np.int64),
            "reward": np.array(i / 2, np.float64)}


def staged(sent: list) -> tuple:
    keys = np.concatenate([s[0] for s in sent])
    return keys, np.concatenate([s[1] for s in sent]), b"".join(s[2] for s in sent)


def test_one_item_calls_stage_what_the_general_path_stages(runtime):
    # One item of the spec's shapes with a float priority takes the one-item
    # path; a numpy priority, or the same items as one batch, the general one.
    assert OneItemLayout(SPEC).parts(item(0), 1.0) is not None
    assert OneItemLayout(SPEC).parts(item(0), np.float64(1.0)) is None
    runs = []
    for how in ("one", "numpy priority", "batch"):
        w = Writer(FakeClient(runtime), max_items=4, max_delay=None)
        sent = recording(w)
        if how == "batch":
            items = [item(i) for i in range(10)]
            batch = {k: np.stack([it[k] for it in items]) for k in items[0]}
            keys = w.insert("t", batch, priority=[float(i) for i in range(10)])
        else:
            keys = np.concatenate([
                w.insert("t", item(i), float(i) if how == "one" else np.float64(i))
                for i in range(10)])
        w.flush()
        run = staged(sent)
        assert (keys == run[0]).all()  # the keys returned are the keys staged
        runs.append(run)
        w.close()
    for keys, prios, data in runs[1:]:
        assert (keys == runs[0][0]).all() and (prios == runs[0][1]).all()
        assert data == runs[0][2]
    assert (runs[0][0] == (1 << 24) + np.arange(10)).all()
    assert runs[0][0].dtype == np.uint64 and runs[0][1].tolist() == list(range(10))


def test_keys_run_on_under_a_new_writer_id_when_one_is_used_up(runtime):
    client = FakeClient(runtime, key_bits=2)  # 4 keys per writer id
    w = Writer(client, max_delay=None)
    recording(w)
    assert (w.next_keys(3) == np.array([4, 5, 6], np.uint64)).all()
    one = [int(w.insert("t", item(i))[0]) for i in range(3)]
    many = w.insert("t", {k: np.stack([item(i)[k] for i in range(3)]) for k in item(0)})
    assert one == [4, 5, 6]
    assert many.tolist() == [8, 9, 10]  # 3 more do not fit under id 1: id 2 starts at 8
    assert client.registered == [None, 1] and w.writer_id == 2
    with pytest.raises(ValueError, match="at most 4 items in one call"):
        w.insert("t", {k: np.stack([item(i)[k] for i in range(5)]) for k in item(0)})
    w.close()


def test_a_one_item_insert_that_fails_before_staging_names_its_key_unstored(runtime):
    # Waiting for a staging buffer, another batch's failure settles the
    # writer: the item never staged is reported as not stored, as on the
    # general path.
    w = Writer(FakeClient(runtime), max_delay=None)
    recording(w)
    key = int(w.next_keys(1)[0])

    def settled(table, spec):
        raise Failed(RateLimiterTimeout("table 't' is full"), [], [], "")

    w._flight.open_batch = settled
    with pytest.raises(RateLimiterTimeout) as info:
        w.insert("t", item(0))
    assert info.value.unstored_keys.tolist() == [key] and info.value.not_stored == 1
    assert "1 items not stored" in str(info.value)
    w._closed = True  # nothing to flush: it was never staged


def test_priorities_and_options_are_checked_before_anything_is_staged(runtime):
    with pytest.raises(ConfigError, match="max_delay"):
        Writer(FakeClient(runtime), max_delay=-1)
    w = Writer(FakeClient(runtime))
    sent = recording(w)
    for bad in (float("nan"), -1.0, [1.0, 2.0]):
        with pytest.raises(ValueError, match="priorit"):
            w.insert("t", item(0), bad)
    w.flush()
    assert sent == [] and w.next_keys(1)[0] == 1 << 24  # no key was given
    w.close()


class _Tables:
    """A client whose table_info returns `info` (or raises it)."""

    def __init__(self, info):
        self.info = info

    def table_info(self, table):
        if isinstance(self.info, Exception):
            raise self.info
        return self.info


def _limited(size, diff, **state):
    return {"size": size, "samples": 3, "rate_limiter_state": {
        "min_size_to_sample": 10, "samples_per_insert": 1.0, "max_diff": 100.0, "diff": diff,
        **state}}


def test_a_writer_says_its_batch_waits_for_samples_only_when_the_limiter_holds_it():
    held = _limited(size=500, diff=95.0)
    assert waiting_for_samples(_Tables(held), "t", 10) is held  # 95 + 10 > 100
    assert waiting_for_samples(_Tables(_limited(size=500, diff=80.0)), "t", 10) is None
    assert waiting_for_samples(_Tables(_limited(size=0, diff=95.0)), "t", 10) is None  # below min
    # Anything the control plane cannot tell, or tells oddly, is no reason:
    # the notice is a courtesy and never fails the writer.
    assert waiting_for_samples(_Tables({"size": 5}), "t", 10) is None  # no rate limiter
    assert waiting_for_samples(_Tables(_limited(size=500, diff=95.0, max_diff=None)), "t",
                               10) is None
    assert waiting_for_samples(_Tables(ConnectionError("gone")), "t", 10) is None


class SliceClient(FakeClient):
    """A FakeClient whose table holds steps of episodes."""

    def slice_len(self, table: str) -> int:
        return 4


def test_a_batch_groups_each_episodes_steps_in_order_before_it_goes(runtime):
    # Three envs appending one step each a call (interleaved): the batch
    # sent holds each episode's steps together, in order, with their keys,
    # priorities, positions and bytes moved with them (the node stores a
    # batch in slots that follow each other: a slice is then one read).
    w = Writer(SliceClient(runtime), max_items=64, max_delay=None)
    sent = []

    def send(batch, exclude, full=None):
        batch.group_episodes()  # what InFlight.send does first
        ib = batch.spec.item_bytes
        rows = np.frombuffer(bytes(batch.buffer.view[: batch.n * ib]), np.uint8)
        sent.append((batch.keys[: batch.n].copy(), batch.priorities[: batch.n].copy(),
                     batch.episodes[: batch.n].copy(), batch.positions[: batch.n].copy(),
                     rows.reshape(batch.n, ib)))
        w._pool.release(batch.buffer)

    w._flight.send = send
    keys = []
    for t in range(5):
        k = w.append("t", {name: np.stack([item(10 * e + t)[name] for e in range(3)])
                           for name in ("obs", "action", "reward")},
                     env=np.arange(3), priority=[float(10 * e + t) for e in range(3)])
        keys.append(k)
    w.flush()
    w.close()
    (got_keys, prios, episodes, positions, rows), = sent
    assert sorted(got_keys.tolist()) == sorted(np.concatenate(keys).tolist())
    by_env = np.stack(keys, axis=1)  # [env, t]: the keys append returned
    assert got_keys.tolist() == by_env.ravel().tolist()  # env 0's 5 steps, then env 1's, ...
    assert episodes.tolist() == np.repeat(by_env[:, 0], 5).tolist()  # an episode: its 1st key
    assert positions.tolist() == [0, 1, 2, 3, 4] * 3
    assert prios.tolist() == [float(10 * e + t) for e in range(3) for t in range(5)]
    assert rows[:, 0].tolist() == [10 * e + t for e in range(3) for t in range(5)]  # obs bytes
    # A batch grouped already (one env) is sent as it was staged.
    w = Writer(SliceClient(runtime), max_items=64, max_delay=None)
    sent.clear()
    w._flight.send = send
    one = w.append("t", {name: np.stack([item(t)[name] for t in range(6)])
                         for name in ("obs", "action", "reward")}, env=7)
    w.flush()
    w.close()
    assert sent[0][0].tolist() == one.tolist() and sent[0][4][:, 0].tolist() == list(range(6))


# A field of 256 KiB and more is staged by the native copy (non-temporal
# stores). BIG's padding after `flag` sends its items down the general path
# (which zeroes the gaps); DENSE's single items take the one-item path.
BIG = TableSpec.parse({"frame": ((300, 1024), np.uint8), "flag": ((), np.bool_),
                       "step": ((), np.int64)})
DENSE = TableSpec.parse({"frame": ((300, 1024), np.uint8), "step": ((), np.int64)})


class SpecClient(FakeClient):
    def __init__(self, runtime, spec):
        super().__init__(runtime)
        self._spec = spec

    def spec(self, table: str) -> TableSpec:
        return self._spec


def test_large_fields_stage_natively_the_bytes_numpy_stages(runtime, monkeypatch):
    from distore_ucx.client.writer import staging

    assert BIG.fields[0].nbytes >= staging.STREAM_FIELD_BYTES
    native_copies = []

    class Native:  # the native module, its row copies counted
        def __getattr__(self, name):
            return getattr(real, name)

        def copy_rows(self, dst, src):
            native_copies.append(dst.shape)
            real.copy_rows(dst, src)

    real = staging._native
    monkeypatch.setattr(staging, "_native", Native())
    rng = np.random.default_rng(3)
    # (5, 300, 1024) frames lying apart in a larger array: rows with a
    # stride, each contiguous (the native copy takes them as they are).
    frames = rng.integers(0, 256, (5, 301, 1024), dtype=np.uint8)[:, :300, :]
    assert not frames.flags.c_contiguous
    steps = np.arange(5, dtype=np.int64)
    for spec, data in ((BIG, {"frame": frames, "flag": steps % 2 == 0, "step": steps}),
                       (DENSE, {"frame": frames, "step": steps})):
        n, arrays = spec.arrays(data)
        expected = np.empty((n, spec.item_bytes), np.uint8)
        spec.pack_into(expected, arrays, 0, n)  # numpy's assignments
        items = [{k: np.array(v[i]) for k, v in data.items()} for i in range(n)]
        if spec is DENSE:
            assert OneItemLayout(spec).parts(items[0], 1.0) is not None
        for how in ("batch", "one"):
            w = Writer(SpecClient(runtime, spec), max_items=8, max_delay=None)
            sent = recording(w)
            if how == "batch":
                w.insert("t", data, priority=[1.0] * n)
            else:
                for one in items:
                    w.insert("t", one, 1.0)
            w.flush()
            assert staged(sent)[2] == expected.tobytes(), (spec, how)
            # the frames went through the native copy, the small fields not
            assert native_copies and {r for _, r in native_copies} == {300 * 1024}
            native_copies.clear()
            w.close()


def test_copy_rows_refuses_mismatched_or_scattered_rows():
    from distore_ucx._native_loader import _native

    dst = np.zeros((2, 8), np.uint8)
    with pytest.raises(Exception, match="source is 3 x 8 bytes"):
        _native.copy_rows(dst, np.ones((3, 8), np.uint8))
    with pytest.raises(Exception, match="contiguous"):
        _native.copy_rows(dst, np.ones((2, 16), np.uint8)[:, ::2])
    assert not dst.any()  # nothing copied
    _native.copy_rows(dst, np.arange(16, dtype=np.uint8).reshape(2, 8))
    assert dst.ravel().tolist() == list(range(16))
    # A read-only source (np.frombuffer, a tensor's .numpy()) is copied too.
    ro = np.frombuffer(bytes(range(16, 32)), np.uint8).reshape(2, 8)
    _native.copy_rows(dst, ro)
    assert dst.ravel().tolist() == list(range(16, 32))


def test_default_batches_hold_eight_large_items_within_32_mib():
    from distore_ucx.client.writer.writer import default_batch_bytes

    mb = 1 << 20
    assert default_batch_bytes(3 * 1024) == 8 * mb  # small items: 8 MiB
    assert default_batch_bytes(3 * mb) == 24 * mb  # W2: 8 items, not 2
    assert default_batch_bytes(5 * mb) == 30 * mb  # 6 fit 32 MiB
    assert default_batch_bytes(10 * mb) == 30 * mb  # W3: 3 items
    assert default_batch_bytes(40 * mb) == 40 * mb  # larger than 32 MiB: one
