"""Tables of slices end to end (docs/semantics.md, "Slices"): writers append
steps of episodes, each stored once; a learner samples slices of T
consecutive steps of one episode, the start chosen at sample time.

Every step's bytes say which episode and position it is, so a slice that
mixed episodes, skipped or repeated a step, crossed an episode's end, or
held an evicted step's slot reused by another is seen.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import wait_for

import distore_ucx as ds
from distore_ucx.protocol import parse_reply
from distore_ucx.transport import rpc

T = 8
SPEC = {"episode": ((), "int64"), "pos": ((), "int64"), "obs": ((200,), "uint8")}


def steps(episode: np.ndarray, pos: np.ndarray) -> dict:
    """Steps whose every byte follows from (episode, position)."""
    episode, pos = np.asarray(episode, np.int64), np.asarray(pos, np.int64)
    obs = ((episode[:, None] * 31 + pos[:, None] * 7 + np.arange(200)) % 251).astype(np.uint8)
    return {"episode": episode, "pos": pos, "obs": obs}


def check(batch, batch_size: int, lengths: dict | None = None) -> None:
    """Every slice: T consecutive steps of one episode, in order, the right bytes."""
    d = batch.data
    assert d["obs"].shape == (batch_size, T, 200) and d["obs"].flags.c_contiguous
    ep, pos = d["episode"], d["pos"]
    assert (ep == ep[:, :1]).all(), "a slice mixes episodes"
    assert (np.diff(pos, axis=1) == 1).all(), "a slice's steps are not consecutive"
    assert np.array_equal(d["obs"], steps(ep.ravel(), pos.ravel())["obs"].reshape(d["obs"].shape))
    assert np.array_equal(batch.positions, pos)
    assert np.array_equal(batch.is_first, pos == 0)
    assert batch.keys.shape == (batch_size,) and np.array_equal(batch.keys, batch.step_keys[:, 0])
    if lengths is not None:  # ends as the writers said (done on each episode's last step)
        last = np.array([[lengths.get(e, 0) - 1 for e in row] for row in ep])
        assert np.array_equal(batch.is_last, pos == last)
        finished = last[:, 0] >= 0
        assert (pos[finished, -1] <= last[finished, 0]).all(), "a slice crosses an episode end"


def write_episodes(client, table: str, writers: int, envs: int, rng, total: int,
                   first_episode: int = 0) -> dict:
    """`writers` writers, each with `envs` environments appending interleaved
    steps of episodes of random lengths (3 to 40: some shorter than a
    slice), one step per env per call; returns episode -> length of the
    finished ones (episodes numbered from `first_episode`)."""
    lengths: dict[int, int] = {}
    ws = [client.writer(max_delay=None) for _ in range(writers)]
    next_episode = [first_episode + w * 1_000_000 for w in range(writers)]
    state = [[None] * envs for _ in range(writers)]  # (episode, position, length)
    written = 0
    while written < total:
        for w, writer in enumerate(ws):
            ep, pos, done = [], [], []
            for e in range(envs):
                if state[w][e] is None:
                    next_episode[w] += 1
                    state[w][e] = (next_episode[w], 0, int(rng.integers(3, 41)))
                episode, p, length = state[w][e]
                ep.append(episode)
                pos.append(p)
                done.append(p == length - 1)
                state[w][e] = None if p == length - 1 else (episode, p + 1, length)
                if p == length - 1:
                    lengths[episode] = length
            writer.append(table, steps(ep, pos), env=np.arange(envs), done=np.array(done))
            written += envs
    for writer in ws:
        writer.close()
    return lengths


@pytest.mark.parametrize("tls", ["tcp", "sm", "mapped"], indirect=True)
def test_slices_are_consecutive_steps_of_one_episode_while_writers_append(make_cluster, tls):
    rng = np.random.default_rng(5)
    cluster = make_cluster(nodes=2)
    with ds.connect(cluster.address) as client:
        client.create_table("s", capacity=1500, spec=SPEC, slice_len=T)
        lengths = write_episodes(client, "s", writers=3, envs=4, rng=rng, total=600)
        learner = client.learner("s", batch_size=16)
        for _ in range(10):
            check(learner.sample(), 16, lengths)
        # More steps than the capacity: FIFO evicts the oldest steps; no slice
        # ever holds one (its slot is reused: the bytes would not match).
        more = write_episodes(client, "s", writers=3, envs=4, rng=rng, total=2400)
        lengths.update(more)
        info = client.table_info("s")
        assert info["size"] == 1500 and info["slice_len"] == T and info["valid_starts"] > 0
        it = iter(learner)
        for _ in range(20):
            check(next(it), 16, lengths)
        learner.close()


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_vectorized_actors_slice_is_one_read(make_cluster, tls, monkeypatch):
    # One call of a vectorized actor: 4 envs' steps interleaved (env 0, 1,
    # 2, 3, 0, 1, ...). The writer groups each episode's steps in its batch,
    # the node stores the batch in slots that follow each other, and the
    # learner reads each slice with one get (gets, not active messages).
    monkeypatch.setenv("DISTORE_AM_SAMPLES", "0")
    cluster = make_cluster(nodes=1)
    envs, length = 4, 16
    with ds.connect(cluster.address) as client:
        client.create_table("s", capacity=1000, spec=SPEC, slice_len=T)
        pos = np.repeat(np.arange(length), envs)
        env = np.tile(np.arange(envs), length)
        with client.writer() as w:
            keys = w.append("s", steps(env + 1, pos), env=env, done=pos == length - 1)
        assert len(np.unique(keys)) == envs * length
        learner = client.learner("s", batch_size=8)
        for _ in range(5):
            check(learner.sample(), 8, {e + 1: length for e in range(envs)})
        slices = learner.stats.fetched_items["ucx"] / T  # read ahead too, perhaps
        assert slices >= 5 * 8
        # One get a slice, or one for two slices next to each other in the arena.
        assert 0 < int(learner.stats.ucx_reads[0]) <= slices, "a slice took more than one read"
        learner.close()


@pytest.fixture
def one_node(module_clusters, tls, request):
    """A one-node cluster of this read path, shared by the module's tests
    that take it: each uses tables of its own name and looks at nothing
    store-wide (conftest's module_clusters)."""
    return module_clusters(request.node.callspec.params["tls"], nodes=1)


def test_starts_are_drawn_uniformly_over_valid_starts(one_node, tls):
    # Episodes of known lengths, nothing evicted: each episode of L steps
    # has L - T + 1 valid starts (none if shorter than T), each as likely.
    cluster = one_node
    with ds.connect(cluster.address) as client:
        client.create_table("uniform", capacity=10_000, spec=SPEC, slice_len=T)
        lengths = {1: 5, 2: 8, 3: 12, 4: 20, 5: 9}  # 0 + 1 + 5 + 13 + 2 = 21 starts
        with client.writer() as w:
            for episode, length in lengths.items():
                pos = np.arange(length)
                w.append("uniform", steps(np.full(length, episode), pos), env=episode,
                         done=pos == length - 1)
        assert client.table_info("uniform")["valid_starts"] == 21
        learner = client.learner("uniform", batch_size=64)
        counts: dict[tuple[int, int], int] = {}
        for _ in range(60):
            b = learner.sample()
            check(b, 64, lengths)
            for e, p in zip(b.data["episode"][:, 0].tolist(), b.data["pos"][:, 0].tolist()):
                counts[(e, p)] = counts.get((e, p), 0) + 1
            assert np.allclose(b.probabilities, 1 / 21)
        valid = {(e, p) for e, n in lengths.items() for p in range(n - T + 1)}
        assert set(counts) == valid, "a start that is not valid, or a valid one never drawn"
        got = np.array([counts[s] for s in sorted(valid)], float)
        exp = got.sum() / len(valid)
        chi2 = float(((got - exp) ** 2 / exp).sum())
        df = len(valid) - 1
        assert chi2 < df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
        learner.close()


def test_prioritized_slices_follow_their_start_steps_priorities(one_node, tls):
    cluster = one_node
    with ds.connect(cluster.address) as client:
        client.create_table("prio", capacity=1000, spec=SPEC, slice_len=4, slice_period=2,
                            sampler=ds.Prioritized(1.0))
        length = 12  # starts at 0, 2, 4, 6, 8 (period 2, T 4)
        pos = np.arange(length)
        with client.writer() as w:
            w.append("prio", {**steps(np.full(length, 7), pos)}, env=0, done=pos == length - 1,
                     priority=pos + 1.0)
        learner = client.learner("prio", batch_size=50, beta=1.0)
        b = learner.sample()
        starts = b.data["pos"][:, 0]
        assert set(starts.tolist()) <= {0, 2, 4, 6, 8}
        # R2D2: a slice's priority is set through its key (its start step's).
        learner.update_priorities(b.keys, np.where(starts == 8, 1000.0, 1e-6))
        counts = np.zeros(length, int)
        for _ in range(10):
            b = learner.sample()
            np.add.at(counts, b.data["pos"][:, 0], 1)
        assert counts[8] > 0.9 * counts.sum(), counts
        assert b.weights.shape == (50,) and np.isfinite(b.weights).all()
        learner.close()


@pytest.mark.parametrize("pad", ["end", "short_episodes"])
def test_short_slices_are_padded_with_a_mask(one_node, tls, pad):
    """slice_pad: a slice that reaches its episode's end early ("end": from
    any start; "short_episodes": an episode shorter than T, whole) has its
    real steps first, then rows that repeat its last step with mask False,
    is_first and is_last False; every valid start is drawn, uniformly."""
    cluster, table = one_node, f"padded_{pad}"
    with ds.connect(cluster.address) as client:
        client.create_table(table, capacity=10_000, spec=SPEC, slice_len=T, slice_pad=pad)
        lengths = {1: 5, 2: 8, 3: 12, 4: 3}
        with client.writer() as w:
            for episode, length in lengths.items():
                pos = np.arange(length)
                w.append(table, steps(np.full(length, episode), pos), env=episode,
                         done=pos == length - 1)
            w.append(table, steps(np.full(3, 9), np.arange(3)), env=9)  # not ended: no start
        if pad == "end":  # every step of an ended episode starts a slice
            valid = {(e, p) for e, n in lengths.items() for p in range(n)}
        else:  # full slices, and the short episodes (5 and 3 steps) whole
            valid = {(e, p) for e, n in lengths.items() for p in range(max(1, n - T + 1))}
        assert client.table_info(table)["valid_starts"] == len(valid)
        assert client.table_info(table)["slice_pad"] == pad
        learner = client.learner(table, batch_size=64)
        counts: dict[tuple[int, int], int] = {}
        for _ in range(40):
            b = learner.sample()
            ep, pos, mask = b.data["episode"], b.data["pos"], b.mask
            n = mask.sum(axis=1)
            assert mask[:, 0].all() and (np.diff(mask.astype(int), axis=1) <= 0).all()
            for i in range(64):
                k, e = n[i], ep[i, 0]
                assert (ep[i] == e).all() and (np.diff(pos[i, :k]) == 1).all()
                assert (pos[i, k:] == pos[i, k - 1]).all(), "padding repeats the last step"
                assert k == T or pos[i, k - 1] == lengths[e] - 1, "short before the end"
                counts[(int(e), int(pos[i, 0]))] = counts.get((int(e), int(pos[i, 0])), 0) + 1
            assert np.array_equal(b.is_last, (pos == np.vectorize(lengths.get)(ep) - 1) & mask)
            assert np.array_equal(b.is_first, (pos == 0) & mask)
            assert np.array_equal(b.data["obs"],
                                  steps(ep.ravel(), pos.ravel())["obs"].reshape(64, T, 200))
        assert set(counts) == valid, "a start that is not valid, or a valid one never drawn"
        got = np.array([counts[s] for s in sorted(valid)], float)
        exp = got.sum() / len(valid)
        df = len(valid) - 1
        assert float(((got - exp) ** 2 / exp).sum()) < df * (
            1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
        learner.close()


def test_items_and_steps_do_not_mix(one_node, tls):
    cluster = one_node
    with ds.connect(cluster.address) as client:
        client.create_table("mix_steps", capacity=100, spec=SPEC, slice_len=T)
        client.create_table("mix_items", capacity=100, spec=SPEC)
        with client.writer() as w:
            with pytest.raises(ds.ConfigError, match="writer.append"):
                w.insert("mix_steps", steps([1], [0]))
            with pytest.raises(ds.ConfigError, match="writer.insert"):
                w.append("mix_items", steps([1], [0]))
        with pytest.raises(ds.ConfigError, match="Uniform.*Prioritized"):
            client.create_table("mix_f", capacity=100, spec=SPEC, slice_len=T, sampler=ds.Fifo())


def test_a_restored_control_plane_samples_the_same_slices(make_cluster, tmp_path, tls):
    cluster = make_cluster(nodes=2, checkpoint=str(tmp_path / "c.ckpt"), checkpoint_interval=0,
                           restore_grace=30)
    client = ds.connect(cluster.address)
    client.create_table("s", capacity=2000, spec=SPEC, slice_len=T)
    lengths = write_episodes(client, "s", writers=2, envs=3, rng=np.random.default_rng(9),
                             total=300)
    assert client.checkpoint()["items"] == client.table_info("s")["size"]
    # Steps inserted after the checkpoint: their nodes kept each one's
    # episode and position, and re-send them with it.
    lengths.update(write_episodes(client, "s", writers=2, envs=3, rng=np.random.default_rng(4),
                                  total=120, first_episode=500_000))
    before = client.table_info("s")
    assert before["size"] == 420
    cluster.kill_control()
    cluster.start_control(restore=True)
    wait_for(lambda: client.table_info("s")["awaiting_restore"] == 0
             and client.table_info("s")["size"] == before["size"], 20, "every step back")
    assert client.table_info("s")["valid_starts"] == before["valid_starts"]
    learner = client.learner("s", batch_size=16)
    for _ in range(5):
        check(learner.sample(timeout=10), 16, lengths)
    learner.close()
    client.close()


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_cold_slices_steps_are_read_from_the_disk_tier_with_one_read(make_cluster, tmp_path,
                                                                        tls):
    # Episodes of 16 steps from one env, 5120 steps of 256 B: the arena keeps
    # the newest 4096 (1.5 MiB less 512 KiB of staging), the oldest go to disk
    # in order, one slot after another. A sample's cold slice is one run of
    # the tier file, read with one read (two slices that follow each other
    # on disk and in the batch, one read too).
    cluster = make_cluster(nodes=1, arena_bytes="1536KiB", disk_bytes="16MiB",
                           disk_staging="512KiB", disk_dir=str(tmp_path))
    episodes, length = 320, 16
    with ds.connect(cluster.address) as client:
        client.create_table("s", capacity=10_000, spec=SPEC, slice_len=T)
        pos = np.tile(np.arange(length), episodes)
        with client.writer(max_items=64, max_in_flight=1) as w:
            keys = w.append("s", steps(np.repeat(np.arange(episodes), length), pos),
                            env=np.zeros(len(pos), np.int64), done=pos == length - 1)
        cold = client.table_info("s")["cold"]
        assert 0 < cold < len(keys)
        learner = client.learner("s", batch_size=4)
        for _ in range(5):  # cold and hot steps alike, byte for byte
            check(learner.sample(), 4, {e: length for e in range(episodes)})
        learner.close()
        order = {int(k): i for i, k in enumerate(keys)}  # the oldest `cold` are on disk
        node = client.nodes()[0]
        with rpc.RpcClient(node["address"], token=client.token) as to_node, \
                client.connection() as conn:
            expected = read = staged = 0
            for _ in range(10):
                before = to_node.call("node_info")["disk_reads"]
                reply = parse_reply("sample", conn.call("sample", table="s", n=8 * T))
                read += to_node.call("node_info")["disk_reads"] - before
                conn.call("release", leases=[reply.lease])
                at = np.array([order[int(k)] for k in reply.items["key"]])
                at = at[at < cold]  # disk slots in write order, in the batch's order
                expected += len(at) and 1 + int(np.count_nonzero(np.diff(at) != 1))
                assert reply.staged == len(at)
                staged += reply.staged
        # One read a step was staged reads (about 8 a run).
        assert expected >= 5 and read == expected and staged > 4 * read, (expected, read, staged)
