"""TorchRL's slice samplers on distore buffers (distore_ucx/torchrl/slices.py):
a buffer built with `SliceSampler` / `PrioritizedSliceSampler` (TorchRL's
objects, or distore's stand-ins with the same arguments) stores frames as
steps of their trajectories and samples what TorchRL's samplers sample from
the same data: flat [num_slices * slice_len] batches of consecutive steps of
one trajectory, truncated on each slice's last step, done = done |
truncated, short trajectories kept whole with strict_length=False (padded
with a mask with pad_output=True), priorities per start step.

The scenarios are those TorchRL's own tests use (trajectories of 30, 25, 15
and 30 steps; a 2-step trajectory beside a 10-step one; five trajectories
of 5 to 25 steps, the shortest with a high priority), written here against
the store.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import sm_store

torch = pytest.importorskip("torch", reason="needs torch (pip install '.[examples]')")
pytest.importorskip("tensordict", reason="needs tensordict (pip install '.[examples]')")
pytest.importorskip("torchrl", reason="needs torchrl (pip install '.[examples]')")

from tensordict import TensorDict  # noqa: E402

_names = itertools.count()


@pytest.fixture(scope="module")
def store():
    """One LocalCluster for the module (one table a buffer)."""
    yield from sm_store()


@pytest.fixture
def buffers(store):
    """make(sampler=..., **options): a buffer on a fresh table; closed after."""
    from distore_ucx.torchrl import DistorePrioritizedReplayBuffer, DistoreReplayBuffer

    made = []

    def make(prioritized=False, **kwargs):
        kwargs.setdefault("capacity", 1000)
        name = f"slices-{next(_names)}"
        if prioritized:
            rb = DistorePrioritizedReplayBuffer(store.address, name, **kwargs)
        else:
            rb = DistoreReplayBuffer(store.address, name, **kwargs)
        made.append(rb)
        return rb

    yield make
    for rb in made:
        rb.close()


def four_trajectories(episode_key="episode", done_key=("next", "done")) -> TensorDict:
    """100 frames: trajectories 1-4 of 30, 25, 15 and 30 steps, in order."""
    lengths = [30, 25, 15, 30]
    episode = torch.cat([torch.full((n,), i + 1, dtype=torch.int32)
                         for i, n in enumerate(lengths)])
    steps = torch.cat([torch.arange(n) for n in lengths])
    done = torch.zeros(100, 1, dtype=torch.bool)
    done[torch.tensor(np.cumsum(lengths) - 1)] = True
    return TensorDict({episode_key: episode, "another_episode": episode.clone(),
                       "steps": steps, "count": torch.arange(100),
                       "obs": torch.arange(100).float()[:, None].expand(100, 3).clone(),
                       done_key: done}, [100])


def slices_of(sample: TensorDict, num_slices: int) -> TensorDict:
    return sample.reshape(num_slices, -1)


@pytest.mark.parametrize("batch_size, num_slices, slice_len, prioritized", [
    (100, 20, None, True), (100, 20, None, False), (120, 30, None, False),
    (100, None, 5, False), (120, None, 4, False)])
@pytest.mark.parametrize("episode_key", ["episode", ("some", "episode")])
@pytest.mark.parametrize("torchrl_object", [True, False])
def test_slices_are_consecutive_steps_of_one_trajectory(buffers, batch_size, num_slices,
                                                        slice_len, prioritized, episode_key,
                                                        torchrl_object):
    from distore_ucx.torchrl.slices import PrioritizedSliceSampler, SliceSampler

    if torchrl_object and not prioritized:  # TorchRL's PrioritizedSliceSampler does not load
        from torchrl.data.replay_buffers.samplers import SliceSampler  # noqa: F811
    kw = {"num_slices": num_slices, "slice_len": slice_len, "traj_key": episode_key}
    sampler = (PrioritizedSliceSampler(max_capacity=100, alpha=0.7, beta=0.9, **kw)
               if prioritized else SliceSampler(**kw))
    rb = buffers(sampler=sampler, batch_size=batch_size)
    index = rb.extend(four_trajectories(episode_key))
    if prioritized:
        rb.update_priority(index, 1.0)
    n = num_slices or batch_size // slice_len
    seen = set()
    for _ in range(200):
        sample = rb.sample()
        assert sample.batch_size == torch.Size([batch_size])
        s = slices_of(sample, n)
        assert (s["another_episode"] == s["another_episode"][:, :1]).all(), "mixed trajectories"
        assert (s["steps"][:, 1:] - 1 == s["steps"][:, :-1]).all(), "steps not consecutive"
        assert (s["obs"][..., 0] == s["count"].float()).all()  # the stored bytes, per step
        truncated = sample["next", "truncated"].reshape(n, -1)
        assert truncated[:, -1].all() and not truncated[:, :-1].any()
        assert sample["next", "done"].reshape(n, -1)[:, -1].all()
        assert not sample["next", "terminated"].any()
        assert torch.equal(sample["index"], index[sample["count"]])  # index: each step's key
        if prioritized:
            w = sample["priority_weight"].reshape(n, -1)
            assert (w == w[:, :1]).all()  # the slice's weight, over its steps
        seen.update(sample["count"].tolist())
        if len(seen) == 100:
            break
    assert len(seen) == 100, f"never sampled: {sorted(set(range(100)) - seen)}"
    assert len(rb) == 100 and rb.write_count == 100


def test_strict_length_false_keeps_short_trajectories_whole(buffers):
    """A 2-step trajectory beside a 10-step one, slices of 4: strict never
    samples the short one; strict_length=False returns it whole (a batch of
    6 rows, or 4, as TorchRL), or padded to 8 with the mask with pad_output."""
    from torchrl.data.replay_buffers.samplers import SliceSampler

    data = TensorDict({"traj": torch.cat([torch.ones(2, dtype=torch.int32),
                                          torch.zeros(10, dtype=torch.int32)]),
                       "x": torch.arange(12)}, [12])
    strict = buffers(sampler=SliceSampler(num_slices=2, traj_key="traj"), batch_size=8)
    strict.extend(data)
    # Without an end key, the store knows the 2-step trajectory ended when
    # the data says so: here, end it with done.
    loose = buffers(sampler=SliceSampler(num_slices=2, strict_length=False, traj_key="traj"),
                    batch_size=8)
    padded = buffers(sampler=SliceSampler(num_slices=2, strict_length=False, pad_output=True,
                                          traj_key="traj"), batch_size=8)
    done = torch.zeros(12, 1, dtype=torch.bool)
    done[[1, 11]] = True
    for rb in (loose, padded):
        rb.extend(data.clone().set(("next", "done"), done))
    shapes = set()
    for _ in range(50):
        s = strict.sample()
        assert s.shape == torch.Size([8]) and (s["traj"] == 0).all()
        s = loose.sample()
        shapes.add(s.shape[0])
        short = int((s["traj"] == 1).sum())  # 2 rows a slice of the short trajectory
        assert s.shape[0] == 8 - short and short in (0, 2, 4)
        assert torch.equal(s["x"][s["traj"] == 1], torch.tensor([0, 1] * (short // 2)))
        s = padded.sample()
        mask = s["collector", "mask"].reshape(2, 4)
        x = s["x"].reshape(2, 4)
        assert s.shape == torch.Size([8]) and mask[:, 0].all()
        for row, m in zip(x, mask):
            k = int(m.sum())
            assert k in (2, 4) and (row[k:] == row[k - 1]).all()  # padding repeats the last
        truncated = s["next", "truncated"].reshape(2, 4)
        assert (truncated.sum(1) == 1).all() and truncated[mask.sum(1) == 2, 1].all()
    assert {6, 8} <= shapes


@pytest.mark.parametrize("strict_length", [True, False])
def test_prioritized_slices_follow_priorities_and_short_trajectories_need_strict_false(
        buffers, strict_length):
    """Five trajectories of 5..25 steps, slices of 10, the 5-step one with
    priority 10: it is never sampled strict, and sampled whole otherwise."""
    from distore_ucx.torchrl.slices import PrioritizedSliceSampler

    parts = []
    for t in range(5):
        length = (t + 1) * 5
        done = torch.zeros(length, 1, dtype=torch.bool)
        done[-1] = True
        parts.append(TensorDict({"traj": torch.full((length,), t), "step_count":
                                 torch.arange(length), "done": done,
                                 "priority": torch.full((length,), 10 if t == 0 else 1)},
                                [length]))
    data = torch.cat(parts)
    rb = buffers(sampler=PrioritizedSliceSampler(max_capacity=75, alpha=1.0, beta=1.0,
                                                 end_key="done", slice_len=10, eps=1e-3,
                                                 reduction="mean",
                                                 strict_length=strict_length),
                 batch_size=50, capacity=None)
    assert (rb.eps, rb.reduction) == (1e-3, "mean")  # the sampler's, as TorchRL takes them
    index = rb.extend(data)
    rb.update_priority(index, data["priority"])
    samples = torch.cat([rb.sample() for _ in range(60)])
    if strict_length:
        assert (samples["traj"] != 0).all()
    else:
        assert (samples["traj"] == 0).any()
        sc = samples[samples["traj"] == 0]["step_count"]
        assert (sc == 0).sum() == (sc == 4).sum() > 0  # the short trajectory, whole each time
        # alpha 1: its one start (priority 10) against the others' 1 + 6 + 11
        # + 16 starts of priority 1 is drawn 10 / 44 of the time
        ends = samples["next", "truncated"].reshape(-1)
        share = float((samples["traj"][ends] == 0).float().mean())
        assert abs(share - 10 / 44) < 4 * np.sqrt(10 / 44 * 34 / 44 / ends.sum().item())


def test_collector_trajectories_stay_consecutive_when_envs_interleave(buffers):
    """Frames of 3 envs arrive interleaved, each env's trajectory continuing
    across extends (("collector", "traj_ids")): every slice is consecutive
    steps of one trajectory."""
    from distore_ucx.torchrl.slices import SliceSampler

    rb = buffers(sampler=SliceSampler(slice_len=6), batch_size=24)
    rng = np.random.default_rng(0)
    step = [0, 0, 0]
    traj = [0, 1, 2]
    next_traj = 3
    for _ in range(20):
        rows = []
        for _ in range(5):  # 5 time steps of 3 envs, env-interleaved
            for e in range(3):
                end = rng.random() < 0.08
                rows.append((traj[e], step[e], end))
                step[e] += 1
                if end:
                    traj[e], step[e], next_traj = next_traj, 0, next_traj + 1
        t, s, d = (torch.tensor(c) for c in zip(*rows))
        rb.extend(TensorDict({("collector", "traj_ids"): t, "step_count": s,
                              ("next", "done"): d[:, None]}, [len(rows)]))
    for _ in range(20):
        sample = rb.sample().reshape(4, 6)
        tr, sc = sample["collector", "traj_ids"], sample["step_count"]
        assert (tr == tr[:, :1]).all() and (sc[:, 1:] - sc[:, :-1] == 1).all()


def test_what_a_table_of_slices_cannot_do_is_refused(buffers):
    from torchrl.data.replay_buffers.samplers import SliceSampler, SliceSamplerWithoutReplacement

    import distore_ucx as ds

    with pytest.raises(ds.ConfigError, match="with replacement only"):
        buffers(sampler=SliceSamplerWithoutReplacement(num_slices=2), batch_size=8)
    with pytest.raises(ds.ConfigError, match="span"):
        buffers(sampler=SliceSampler(num_slices=2, span=(2, 2)), batch_size=8)
    with pytest.raises(ds.ConfigError, match="divisible by 3"):
        buffers(sampler=SliceSampler(num_slices=3), batch_size=8)
    rb = buffers(sampler=SliceSampler(slice_len=4), batch_size=8)
    rb.extend(four_trajectories())
    with pytest.raises(RuntimeError, match="divisible by the slice length"):
        rb.sample(6)
