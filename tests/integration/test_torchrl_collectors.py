"""TorchRL buffers in other processes: a buffer pickles to a handle that
connects where it lands (spawn, fork, torch.multiprocessing queues, with
the token file its client used), and TorchRL's multi-process collectors
write into one distore buffer from every worker, each frame stored once.
state_dict / dumps keep the buffer's own state, not the items."""

from __future__ import annotations

import functools
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install '.[examples]')")
pytest.importorskip("torchrl", reason="needs torchrl (pip install '.[examples]')")

import torchrl_children as kids  # noqa: E402  (needs torchrl: after the skip)

pytestmark = pytest.mark.parametrize("tls", ["sm"], indirect=True)


@pytest.fixture
def cluster(module_clusters, tls, request):
    """One storage node (enough here), shared by the module's tests: each
    writes tables of its own name (conftest's module_clusters). A heartbeat
    late on a busy 2-core machine, with a dozen collector processes, must
    not drop it."""
    return module_clusters(request.node.callspec.params["tls"], nodes=1,
                           heartbeat_timeout=30.0)


@pytest.fixture
def start_method(request):
    """The multiprocessing start method TorchRL's collectors use (they take
    the global one), restored after the test. Fork starts a worker in a
    fraction of a second, spawn (TorchRL's default) in seconds on 2 busy
    cores: the frame-heavy tests fork, one test spawns."""
    import multiprocessing as mp

    before = mp.get_start_method(allow_none=True)
    mp.set_start_method(request.param, force=True)
    yield request.param
    mp.set_start_method(before, force=True)


def drain(rb) -> dict:
    """Every item of rb's table (a Fifo table whose items leave at their
    first sample), as numpy arrays by key; the table is empty after."""
    n = len(rb)
    td = rb.sample(n)
    assert len(rb) == 0, "each item sampled once leaves: nothing may be left"
    return {key: td[key].numpy() for key in td.keys(include_nested=True, leaves_only=True)}


def check_frames(got: dict, *, whole_episodes: bool = False) -> dict:
    """What collectors wrote from CountingEnv lanes: each frame once, its
    content intact, and each lane's frames its first ones in order, with
    nothing missing in between (episodes only whole ones when
    `whole_episodes`). Returns {uid: frames} per lane."""
    obs, nxt = got["obs"], got[("next", "obs")]
    done = got[("next", "done")].reshape(-1)
    assert (nxt[:, :2] == obs[:, :2]).all() and (nxt[:, 2] == obs[:, 2] + 1).all()
    assert (done == (nxt[:, 2] >= kids.episode_length(obs[:, 0], obs[:, 1]))).all()
    s = obs[np.lexsort((obs[:, 2], obs[:, 1], obs[:, 0]))]
    first = np.ones(len(s), dtype=bool)
    first[1:] = s[1:, 0] != s[:-1, 0]
    assert (s[first, 1:] == 0).all(), "a lane's first stored frame is not its first frame"
    # Each next frame of a lane follows the one before: (e, t + 1), or (e + 1, 0)
    # after an episode's last step. A duplicate or a frame lost breaks it.
    prev, cur = s[:-1][~first[1:]], s[1:][~first[1:]]
    ended = prev[:, 2] + 1 >= kids.episode_length(prev[:, 0], prev[:, 1])
    want_e = np.where(ended, prev[:, 1] + 1, prev[:, 1])
    want_t = np.where(ended, 0, prev[:, 2] + 1)
    bad = (cur[:, 1] != want_e) | (cur[:, 2] != want_t)
    assert not bad.any(), (f"{bad.sum()} frames out of sequence, e.g. {prev[bad][:2]} -> "
                           f"{cur[bad][:2]}")
    if whole_episodes:
        last = np.ones(len(s), dtype=bool)
        last[:-1] = first[1:]
        assert (s[last, 2] + 1 == kids.episode_length(s[last, 0], s[last, 1])).all()
    # The collector's trajectory ids: one per lane episode, across all workers.
    traj = got[("collector", "traj_ids")].reshape(-1)
    pairs = np.unique(np.stack([obs[:, 0], obs[:, 1], traj], 1), axis=0)
    assert len(np.unique(pairs[:, :2], axis=0)) == len(pairs) == len(np.unique(pairs[:, 2]))
    uids, counts = np.unique(s[:, 0], return_counts=True)
    return dict(zip(uids.tolist(), counts.tolist()))


@pytest.mark.parametrize("start_method", ["fork"], indirect=True)
@pytest.mark.parametrize("kind", ["items", "slices"])
def test_four_workers_over_parallel_envs_store_every_frame_once(cluster, start_method, kind):
    """The issue's case: MultiSyncCollector, 4 workers, each over
    ParallelEnv(2) (of 10-lane envs: frames are cheap, the processes are
    the same), 20,000 frames into one buffer the workers extend themselves
    (forked: each worker's copy of the buffer turns into a handle). Items:
    every frame once, drained and checked. Slices (a SliceSampler buffer,
    trajectories by the collector's traj_ids): every slice is consecutive
    steps of one lane's episode, also across the workers' batch seams."""
    from torchrl.collectors import MultiSyncCollector
    from torchrl.envs import ParallelEnv

    import distore_ucx as ds
    from distore_ucx.torchrl import DistoreReplayBuffer, SliceSampler

    # Each worker's rollout is [2 envs, 10 lanes, 50 steps]: ndim=3 stores frames.
    make_env = functools.partial(ParallelEnv, 2, functools.partial(kids.CountingEnv, 10),
                                 mp_start_method="fork")
    if kind == "items":
        options = {"ndim": 3, "sampler": ds.Fifo(), "max_times_sampled": 1}
    else:
        options = {"sampler": SliceSampler(slice_len=8), "batch_size": 8 * 64}
    with DistoreReplayBuffer(cluster.address, kind, capacity=25_000, **options) as rb:
        collector = MultiSyncCollector([make_env] * 4, None, frames_per_batch=4000,
                                       total_frames=20_000, replay_buffer=rb)
        try:
            batches = sum(1 for _ in collector)
        finally:
            collector.shutdown()
        assert batches == 5 and rb.shared  # the collector shared it
        # The workers' inserts, counted in the parent, which inserted none.
        assert rb.write_count == 20_000 and len(rb) == 20_000
        if kind == "items":
            lanes = check_frames(drain(rb))
            assert len(lanes) == 80 and set(lanes.values()) == {250}  # 8 envs x 10 lanes
            return
        for _ in range(4):
            td = rb.sample().reshape(64, 8)
            obs, nxt = td["obs"], td["next", "obs"]
            assert (obs[:, :, :2] == obs[:, :1, :2]).all(), "a slice mixes episodes"
            assert (obs[:, 1:, 2] == obs[:, :-1, 2] + 1).all(), "a slice skips steps"
            assert (nxt[..., 2] == obs[..., 2] + 1).all() and (nxt[..., :2] == obs[..., :2]).all()
            truncated = td["next", "truncated"].squeeze(-1)
            assert truncated[:, -1].all() and not truncated[:, :-1].any()
            # The collector's trajectory id is the episode's, in every step.
            assert (td["collector", "traj_ids"] == td["collector", "traj_ids"][:, :1]).all()


@pytest.mark.parametrize("start_method", ["spawn"], indirect=True)
def test_async_collector_in_spawned_workers(cluster, start_method):
    """MultiAsyncCollector with TorchRL's default start (each worker unpickles
    the buffer): workers run on until shut down, so at least total_frames
    (a batch cut at shutdown is TorchRL's to drop, never half stored)."""
    from torchrl.collectors import MultiAsyncCollector

    import distore_ucx as ds
    from distore_ucx.torchrl import DistoreReplayBuffer

    with DistoreReplayBuffer(cluster.address, "async", capacity=10_000, ndim=2,
                             sampler=ds.Fifo(), max_times_sampled=1) as rb:
        collector = MultiAsyncCollector([functools.partial(kids.CountingEnv, 8)] * 2, None,
                                        frames_per_batch=400, total_frames=2000,
                                        replay_buffer=rb)
        try:
            for _ in collector:
                pass
        finally:
            collector.shutdown()
        stored = rb.write_count
        assert stored >= 2000 and len(rb) == stored
        lanes = check_frames(drain(rb))
        assert len(lanes) == 16 and sum(lanes.values()) == stored


@pytest.mark.parametrize("start_method", ["fork"], indirect=True)
def test_trajs_per_batch_stores_whole_episodes(cluster, start_method):
    """trajs_per_batch: each worker writes whole episodes, flat [steps]
    (ndim=1: every step one item), one extend an episode."""
    from torchrl.collectors import MultiSyncCollector

    import distore_ucx as ds
    from distore_ucx.torchrl import DistoreReplayBuffer

    with DistoreReplayBuffer(cluster.address, "trajs", capacity=10_000,
                             sampler=ds.Fifo(), max_times_sampled=1) as rb:
        collector = MultiSyncCollector([functools.partial(kids.CountingEnv, 8)] * 2, None,
                                       frames_per_batch=400, total_frames=2000,
                                       trajs_per_batch=4, replay_buffer=rb)
        try:
            for _ in collector:
                pass
        finally:
            collector.shutdown()
        stored = rb.write_count
        assert stored > 1000 and len(rb) == stored
        got = drain(rb)
        check_frames(got, whole_episodes=True)
        # One episode is one extend: its steps got consecutive keys, in order.
        order = np.lexsort((got["obs"][:, 2], got["obs"][:, 1], got["obs"][:, 0]))
        keys, obs = got["index"][order], got["obs"][order]
        same = (obs[1:, :2] == obs[:-1, :2]).all(1)
        assert (np.diff(keys)[same] == 1).all()


@pytest.mark.parametrize("method, via", [("spawn", "args"), ("fork", "args"),
                                         ("fork", "queue")])
def test_a_pickled_buffer_connects_in_the_child(cluster, method, via):
    """Handed to a child as a Process argument (pickled under spawn, copied
    by fork) or through a torch.multiprocessing queue, a buffer connects
    there at its first use, with a client of its own, and writes into the
    same table; the parent's buffer keeps working."""
    import torch.multiprocessing as tmp

    from distore_ucx.torchrl import DistoreReplayBuffer

    ctx = tmp.get_context(method)
    out = ctx.Queue()
    with DistoreReplayBuffer(cluster.address, f"pickled-{method}-{via}", capacity=100,
                             batch_size=4) as rb:
        mine = rb.extend(kids.numbered(5, 0))
        rb.share()
        if via == "args":
            child = ctx.Process(target=kids.extend_in_child, args=(rb, 100, out))
            child.start()
        else:
            inbox = ctx.Queue()
            child = ctx.Process(target=kids.extend_from_queue, args=(inbox, 100, out))
            child.start()
            inbox.put(rb)
        reply = out.get(timeout=120)
        child.join(timeout=60)
        assert child.exitcode == 0, reply
        lazy, keys, count, size = reply
        assert lazy, "the child's buffer connected before its first use"
        assert count == 15 and size == 15  # shared: the parent's 5 and the child's 10
        assert rb.write_count == 15 and len(rb) == 15
        assert not set(keys) & set(mine.tolist())
        td = rb.sample(64)  # the parent still samples, and sees the child's items
        by_key = dict(zip(td["index"].tolist(), td["x"].tolist()))
        assert {by_key[k] for k in keys if k in by_key} <= set(range(100, 110))
        assert rb.extend(kids.numbered(1, 7)).numel() == 1


def test_a_pickled_buffer_carries_the_token_file(make_cluster, token_file):
    """A store that requires a token: the child's buffer connects with the
    token file the parent's client read."""
    import multiprocessing as mp

    import distore_ucx as ds
    from distore_ucx.torchrl import DistoreReplayBuffer

    cluster = make_cluster(nodes=1, token_file=token_file)
    ctx = mp.get_context("fork")  # the cheap start: what travels is the handle
    out, inbox = ctx.Queue(), ctx.Queue()
    with ds.connect(cluster.address, token_file=token_file) as client:
        with DistoreReplayBuffer(client, "secret", capacity=100) as rb:
            child = ctx.Process(target=kids.extend_from_queue, args=(inbox, 0, out))
            child.start()
            inbox.put(rb)
            reply = out.get(timeout=60)
            child.join(timeout=60)
            assert child.exitcode == 0, reply
            assert len(rb) == 10
        assert not client._closed, "a buffer closes only the client it made"


def test_state_dict_dumps_and_loads(cluster, tmp_path):
    import distore_ucx as ds
    from distore_ucx.torchrl import DistorePrioritizedReplayBuffer, DistoreReplayBuffer

    def make():
        return DistorePrioritizedReplayBuffer(cluster.address, "state", alpha=0.7, beta=0.4,
                                              capacity=100, batch_size=4)

    with make() as rb:
        rb.extend(kids.numbered(8, 0).set("td_error", torch.arange(8.0)))
        rb.beta = 0.9
        state = rb.state_dict()
        assert state == {"table": "state", "write_count": 8, "max_priority": pytest.approx(7.0),
                         "beta": 0.9, "options": {"alpha": 0.7, "beta": 0.4, "capacity": 100,
                                                  "batch_size": 4}}
        rb.dumps(tmp_path / "rb")
        copy = pickle.loads(pickle.dumps(rb))  # the same state, in a buffer of its own
        assert (copy.write_count, copy.beta, copy.alpha) == (8, 0.9, 0.7)
        copy.close()
    with make() as other:  # a new buffer of the table: its own counters, until loaded
        assert (other.write_count, other.beta) == (0, 0.4)
        other.load_state_dict(state)
        assert (other.write_count, other.beta) == (8, 0.9)
        assert other._fill_priority() == pytest.approx(7.0)  # new items' default priority
    with make() as other:
        other.loads(tmp_path / "rb")
        assert (other.write_count, other.beta) == (8, 0.9)
        with pytest.raises(ds.ConfigError, match="dumps"):
            other.loads(tmp_path / "nothing")
    with DistoreReplayBuffer(cluster.address, "elsewhere", capacity=10) as rb:
        with pytest.raises(ds.ConfigError, match="'state'.*'elsewhere'"):
            rb.load_state_dict(state)
        rb.close()
        with pytest.raises(ds.Closed, match="closed"):
            pickle.dumps(rb)
