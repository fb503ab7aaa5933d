"""TorchRL's own slice-sampler tests, run against distore's TorchRL buffers.

Taken from pytorch/rl at the torchrl 0.14 release (commit 6e18e35b2, "Bump
0.14.0"; see tests/integration/test_torchrl_upstream.py for why that commit):
the SliceSampler and PrioritizedSliceSampler tests of test/rb/test_samplers.py.
Copyright (c) Meta Platforms, Inc. and affiliates, MIT license.

Only construction is adapted: where a test builds a TorchRL buffer, the
`rbs` fixture builds a distore buffer with the same sampler (storage size ->
table capacity in steps, else the PrioritizedSliceSampler's max_capacity,
else ListStorage's default 1000), on one LocalCluster for the whole module,
one table a buffer. TorchRL's SliceSampler objects are handed to the buffer
as they are; TorchRL's PrioritizedSliceSampler cannot be constructed here
(its compiled segment trees do not load with torch 2.13.0+cpu), so
`PrioritizedSliceSampler` is distore's stand-in with the same arguments.
Where a test drives a sampler without a buffer (`sampler.sample(storage,
batch_size)` over a filled `LazyMemmapStorage`, `sampler.update_priority`),
`rbs.LazyMemmapStorage` / `rbs.SliceSampler` / `rbs.PrioritizedSliceSampler`
do it through a buffer: the storage's data is extended into a buffer with
that sampler at the first `sample`, which returns positions into the sample
and the sample as info (`storage._storage` is that sample, so that
`storage._storage[index]` reads the sampled steps); `sampler.update_priority`
takes storage positions (the order the steps were extended in). Test bodies
and assertions are TorchRL's as written; a part that cannot apply is cut
and listed below.

Parametrizations: `ndim` (storage layout: [T] or [2, T] storages) and
`device` (only "cpu" here) change nothing in a table of slices, which keeps
flat steps: ndim=1 runs, ndim=2 does not. span [False, False] is span=False
and runs once.

Left out or cut, and why:

- SliceSamplerWithoutReplacement (test_slice_sampler_without_replacement,
  test_slice_sampler_at_capacity's second case, the load/dumps tests, the
  replacement=False tests): a table samples with replacement only; the buffer
  refuses it (tests/integration/test_torchrl_slices.py checks the message).
- span other than (False, True): test_slice_sampler_left_right(_ndim), and
  span=3 and [False, 3] of test_slice_sampler_prioritized_span: a table cuts
  slices at an episode's end but never starts one before its start.
- test_slice_sampler's case [101, None, 101, False]: a table refuses a
  slice_len above its capacity (101 > 100 steps).
- test_slice_sampler_errors' ListStorage part ("Could not get a tensordict out
  of the storage"): there is no ListStorage in a store; its first part (an
  end key of more than one value a step) runs.
- The assertions on `rb.sampler` internals (`traj_key`, `_fetch_traj`,
  `_traj_key_auto`, `_cache`): a distore buffer resolves the trajectory key
  at each extend and keeps no cache (nothing to invalidate); where nothing else
  was asserted the test is left out: test_slice_sampler_auto_traj_key_episode,
  _fallback_to_done and test_slice_sampler_explicit_traj_key_no_auto.
- test_slice_sampler_mask_all_long_trajs_no_mask: TorchRL leaves the mask out
  when no trajectory in its storage is shorter than slice_len; finding that
  out scans the storage, so a distore sample with pad_output=True always
  carries ("collector", "mask") (all True when nothing is padded).
- test_prioritized_slice_sampler_doc_example: it asserts nothing upstream.
- Sampler state dicts, dumps/loads, `_sum_tree` and `_max_priority` tests
  (test_prioritized_slice_sampler_load_state_dict_*, test_prb_*), RNG
  (TestRNG.test_slice_rng: `generator=`), find_start_stop_traj
  (TestFindStartStopTraj) and the other samplers' tests (TestSamplers'
  without-replacement and prioritized-item tests, StalenessAwareSampler,
  PromptGroupSampler, the parameter schedulers): TorchRL objects and state a
  table of slices does not have, or not slices.

- Trajectory ends: TorchRL ends a trajectory where its id changes in the
  storage; a store learns that a trajectory ended from the end key only
  (collectors interleave trajectories, and a trajectory continues across
  extends), and an unfinished trajectory's last slice_len - 1 steps start
  no slice yet (docs/semantics.md, "Slices"). The tests whose short
  trajectories carry only an id (test_slice_sampler_strictlength's second
  buffer, the mask and is_init tests) give their data ("next", "done") on
  each trajectory's last step (`_ends_marked`, marked "adapted" where used):
  the same trajectories for TorchRL, ended for the store.

With strict_length=False, what is left of a trajectory whose first steps
were overwritten, when shorter than slice_len, is one short slice, as
TorchRL samples it (slice_pad "short_episodes" starts a short slice at an
episode's first present step: docs/semantics.md, "Short slices").
test_slice_sampler_prioritized_span's circ runs are cut for the suite's
time (1001 samples each, the same eviction as
test_slice_sampler_prioritized's circ runs, which are kept).

Differences by design, assertions kept: starts are drawn uniformly over the
valid starts (TorchRL draws a trajectory, then a start in it); no kept
assertion depends on which, except how soon test_slice_sampler sees every
step: it tries 400 samples, not 50 (marked "adapted").
"""

from __future__ import annotations

import itertools
import warnings

import pytest
from helpers import closing_builders, sm_store

torch = pytest.importorskip("torch", reason="needs torch (pip install '.[examples]')")
pytest.importorskip("tensordict", reason="needs tensordict (pip install '.[examples]')")
pytest.importorskip("torchrl", reason="needs torchrl (pip install '.[examples]')")

from tensordict import TensorDict  # noqa: E402
from torchrl._utils import _replace_last  # noqa: E402
from torchrl.data.replay_buffers.samplers import SliceSampler  # noqa: E402
from torchrl.data.replay_buffers.storages import (  # noqa: E402
    LazyMemmapStorage,
    LazyTensorStorage,
)
from torchrl.modules import GRUModule, set_recurrent_mode  # noqa: E402
from torchrl.testing import get_default_devices  # noqa: E402

from distore_ucx.torchrl import slices as _slices  # noqa: E402

PrioritizedSliceSampler = _slices.PrioritizedSliceSampler  # TorchRL's does not load here
LISTSTORAGE_DEFAULT = 1000  # TorchRL's buffers default to ListStorage(max_size=1000)


@pytest.fixture(scope="module")
def store():
    """One LocalCluster for the module (one table a buffer)."""
    yield from sm_store()


def _ends_marked(data, traj_key="traj"):
    """`data` with ("next", "done") set on each trajectory's last frame
    (see the module docstring: a store learns an end from the end key)."""
    traj = data[traj_key]
    done = torch.ones(traj.shape[0], 1, dtype=torch.bool)
    done[:-1, 0] = traj[1:] != traj[:-1]
    return data.set(("next", "done"), done)


class _StepBuffer:
    """Mixin of the buffers built here: remembers the keys of the steps it
    extended, in order, so that storage positions map to keys."""

    def extend(self, data, **kwargs):
        keys = super().extend(data, **kwargs)
        self.positions = torch.cat([getattr(self, "positions", keys.new_zeros(0)),
                                    keys.reshape(-1)])
        return keys


class _OnStore:
    """Mixin of the samplers that a test drives itself: their calls go to
    the buffer that holds their steps (see the module docstring)."""

    def _init_on_store(self, builders):
        self._builders, self._rb, self._pending = builders, None, []

    def extend(self, index):
        """TorchRL registers storage positions; a buffer's extend did."""

    def update_priority(self, index, priority):
        if self._rb is None:  # before the first sample: the data is not stored yet
            self._pending.append((index, priority))
            return
        index = torch.as_tensor(index)
        self._rb.update_priority(self._rb.positions[index.reshape(-1)], priority)

    def sample(self, storage, batch_size):
        if self._rb is None:
            self._builders.ReplayBuffer(storage=storage, sampler=self, batch_size=batch_size)
            self._rb.extend(storage.data)
            for index, priority in self._pending:
                self.update_priority(index, priority)
        td = self._rb.sample(batch_size)
        storage._storage = td
        return torch.arange(td.shape[0]), td


class _StoreSliceSampler(_OnStore, _slices.SliceSampler):
    pass


class _StorePrioritizedSliceSampler(_OnStore, _slices.PrioritizedSliceSampler):
    pass


class _Storage:
    """A LazyMemmapStorage that a test fills and hands to a sampler."""

    def __init__(self, max_size):
        self.max_size, self.data, self._storage = max_size, None, None

    def set(self, cursor, data):
        assert list(cursor) == list(range(data.shape[0])), "fills from position 0 only"
        self.data = data


class _Builders:
    """TorchRL's buffer, storage and sampler constructors, building distore
    buffers and their stand-ins instead."""

    _names = itertools.count()

    def __init__(self, address: str, test: str):
        self.address, self.test, self.open = address, test, []

    def ReplayBuffer(self, storage=None, sampler=None, batch_size=None,  # noqa: N802
                     **kwargs):
        from distore_ucx.torchrl import DistoreReplayBuffer

        assert not kwargs, f"no mapping for TorchRL options {sorted(kwargs)}"
        capacity = (storage.max_size if storage is not None
                    else getattr(sampler, "max_capacity", None) or LISTSTORAGE_DEFAULT)
        cls = type("StepBuffer", (_StepBuffer, DistoreReplayBuffer), {})
        rb = cls(self.address, f"{self.test[:40]}-{next(self._names)}", capacity=capacity,
                 batch_size=batch_size, sampler=sampler)
        if isinstance(sampler, _OnStore):
            sampler._rb = rb
        self.open.append(rb)
        return rb

    TensorDictReplayBuffer = ReplayBuffer  # distore buffers hold TensorDicts

    def SliceSampler(self, **kwargs):  # noqa: N802 - TorchRL's names
        sampler = _StoreSliceSampler(**kwargs)
        sampler._init_on_store(self)
        return sampler

    def PrioritizedSliceSampler(self, **kwargs):  # noqa: N802
        sampler = _StorePrioritizedSliceSampler(**kwargs)
        sampler._init_on_store(self)
        return sampler

    def LazyMemmapStorage(self, max_size):  # noqa: N802
        return _Storage(max_size)


@pytest.fixture
def rbs(store, request):
    """Builds distore buffers where the upstream tests build TorchRL ones."""
    yield from closing_builders(_Builders(store.address, request.node.name))


# -- test/rb/test_samplers.py: TestSamplers ----------------------------------------
class TestSamplers:
    @pytest.mark.parametrize(
        "batch_size,num_slices,slice_len,prioritized",
        [
            [100, 20, None, True],
            [100, 20, None, False],
            [120, 30, None, False],
            [100, None, 5, False],
            [120, None, 4, False],
            # (cut: [101, None, 101, False], see the module docstring)
        ],
    )
    @pytest.mark.parametrize("episode_key", ["episode", ("some", "episode")])
    @pytest.mark.parametrize("done_key", ["done", ("some", "done")])
    @pytest.mark.parametrize("match_episode", [True, False])
    @pytest.mark.parametrize("device", get_default_devices())
    def test_slice_sampler(
        self,
        batch_size,
        num_slices,
        slice_len,
        prioritized,
        episode_key,
        done_key,
        match_episode,
        device,
        rbs,
    ):
        torch.manual_seed(0)
        storage = rbs.LazyMemmapStorage(100)
        episode = torch.zeros(100, dtype=torch.int, device=device)
        episode[:30] = 1
        episode[30:55] = 2
        episode[55:70] = 3
        episode[70:] = 4
        steps = torch.cat(
            [torch.arange(30), torch.arange(25), torch.arange(15), torch.arange(30)], 0
        )

        done = torch.zeros(100, 1, dtype=torch.bool)
        done[torch.tensor([29, 54, 69, 99])] = 1

        data = TensorDict(
            {
                # we only use episode_key if we want the sampler to access it
                episode_key if match_episode else "whatever_episode": episode,
                "another_episode": episode,
                "obs": torch.randn((3, 4, 5)).expand(100, 3, 4, 5),
                "act": torch.randn((20,)).expand(100, 20),
                "steps": steps,
                "count": torch.arange(100),
                "other": torch.randn((20, 50)).expand(100, 20, 50),
                done_key: done,
                _replace_last(done_key, "terminated"): done,
            },
            [100],
            device=device,
        )
        storage.set(range(100), data)
        if slice_len is not None and slice_len > 15:
            # we may have to sample trajs shorter than slice_len
            strict_length = False
        else:
            strict_length = True

        if prioritized:
            num_steps = data.shape[0]
            sampler = rbs.PrioritizedSliceSampler(
                max_capacity=num_steps,
                alpha=0.7,
                beta=0.9,
                num_slices=num_slices,
                traj_key=episode_key,
                end_key=done_key,
                slice_len=slice_len,
                strict_length=strict_length,
                truncated_key=_replace_last(done_key, "truncated"),
            )
            index = torch.arange(0, num_steps, 1)
            sampler.extend(index)
            sampler.update_priority(index, 1)
        else:
            sampler = rbs.SliceSampler(
                num_slices=num_slices,
                traj_key=episode_key,
                end_key=done_key,
                slice_len=slice_len,
                strict_length=strict_length,
                truncated_key=_replace_last(done_key, "truncated"),
            )
        if slice_len is not None:
            num_slices = batch_size // slice_len
        trajs_unique_id = set()
        too_short = False
        count_unique = set()
        # adapted: 400 tries, not 50. Starts are drawn uniformly over the valid
        # starts, so a trajectory's last step (one start) comes up less often
        # than TorchRL's trajectory-first draw makes it: 50 missed it ~1-2%
        # of the time; the loop still ends once every step was sampled.
        for _ in range(400):
            index, info = sampler.sample(storage, batch_size=batch_size)
            samples = storage._storage[index]
            if strict_length:
                # check that trajs are ok
                samples = samples.view(num_slices, -1)

                unique_another_episode = (
                    samples["another_episode"].unique(dim=1).squeeze()
                )
                assert unique_another_episode.shape == torch.Size([num_slices]), (
                    num_slices,
                    samples,
                )
                assert (
                    samples["steps"][..., 1:] - 1 == samples["steps"][..., :-1]
                ).all()
            if isinstance(index, tuple):
                index_numel = index[0].numel()
            else:
                index_numel = index.numel()

            too_short = too_short or index_numel < batch_size
            trajs_unique_id = trajs_unique_id.union(
                samples["another_episode"].view(-1).tolist()
            )
            count_unique = count_unique.union(samples.get("count").view(-1).tolist())

            truncated = info[_replace_last(done_key, "truncated")]
            terminated = info[_replace_last(done_key, "terminated")]
            assert (truncated | terminated).view(num_slices, -1)[:, -1].all()
            assert (
                terminated
                == samples[_replace_last(done_key, "terminated")].view_as(terminated)
            ).all()
            done = info[done_key]
            assert done.view(num_slices, -1)[:, -1].all()

            if len(count_unique) == 100:
                # all items have been sampled
                break
        else:
            raise AssertionError(
                f"Not all items can be sampled: {set(range(100)) - count_unique} are missing"
            )

        if strict_length:
            assert not too_short
        else:
            assert too_short

        assert len(trajs_unique_id) == 4

    @pytest.mark.parametrize("sampler", [SliceSampler])  # (cut: SliceSamplerWithoutReplacement)
    def test_slice_sampler_at_capacity(self, sampler, rbs):
        torch.manual_seed(0)

        trajectory0 = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
        trajectory1 = torch.arange(2).repeat_interleave(6)
        trajectory = torch.stack([trajectory0, trajectory1], 0)

        td = TensorDict(
            {"trajectory": trajectory, "steps": torch.arange(12).expand(2, 12)}, [2, 12]
        )

        rb = rbs.ReplayBuffer(
            sampler=sampler(traj_key="trajectory", num_slices=2),
            storage=LazyTensorStorage(20, ndim=2),
            batch_size=6,
        )

        rb.extend(td)

        for s in rb:
            if (s["steps"] == 9).any():
                break
        else:
            raise AssertionError

    def test_slice_sampler_errors(self, rbs):
        device = "cpu"
        batch_size, num_slices = 100, 20

        episode = torch.zeros(100, dtype=torch.int, device=device)
        episode[:30] = 1
        episode[30:55] = 2
        episode[55:70] = 3
        episode[70:] = 4
        steps = torch.cat(
            [torch.arange(30), torch.arange(25), torch.arange(15), torch.arange(30)], 0
        )

        done = torch.zeros(100, 1, dtype=torch.bool)
        done[torch.tensor([29, 54, 69])] = 1

        data = TensorDict(
            {
                # we only use episode_key if we want the sampler to access it
                "episode": episode,
                "another_episode": episode,
                "obs": torch.randn((3, 4, 5)).expand(100, 3, 4, 5),
                "act": torch.randn((20,)).expand(100, 20),
                "steps": steps,
                "other": torch.randn((20, 50)).expand(100, 20, 50),
                ("next", "done"): done,
            },
            [100],
            device=device,
        )

        data_wrong_done = data.clone(False)
        data_wrong_done.rename_key_("episode", "_")
        data_wrong_done["next", "done"] = done.unsqueeze(1).expand(100, 5, 1)
        storage = rbs.LazyMemmapStorage(100)
        storage.set(range(100), data_wrong_done)
        sampler = rbs.SliceSampler(num_slices=num_slices)
        with pytest.raises(
            RuntimeError,
            match="Expected the end-of-trajectory signal to be 1-dimensional",
        ):
            index, _ = sampler.sample(storage, batch_size=batch_size)
        # (cut: the ListStorage part, see the module docstring)

    def test_slice_sampler_strictlength(self, rbs):
        torch.manual_seed(0)

        data = TensorDict(
            {
                "traj": torch.cat(
                    [
                        torch.ones(2, dtype=torch.int),
                        torch.zeros(10, dtype=torch.int),
                    ],
                    dim=0,
                ),
                "x": torch.arange(12),
            },
            [12],
        )

        buffer = rbs.ReplayBuffer(
            storage=LazyTensorStorage(12),
            sampler=SliceSampler(num_slices=2, strict_length=True, traj_key="traj"),
            batch_size=8,
        )
        buffer.extend(data)

        for _ in range(50):
            sample = buffer.sample()
            assert sample.shape == torch.Size([8])
            assert (sample["traj"] == 0).all()

        buffer = rbs.ReplayBuffer(
            storage=LazyTensorStorage(12),
            sampler=SliceSampler(num_slices=2, strict_length=False, traj_key="traj"),
            batch_size=8,
        )
        buffer.extend(_ends_marked(data))  # adapted: ends marked

        for _ in range(50):
            sample = buffer.sample()
            if sample.shape == torch.Size([6]):
                assert (sample["traj"] != 0).any()
            else:
                assert len(sample["traj"].unique()) == 1

    # ------------------------------------------------------------------
    # traj_key auto-detection tests
    # ------------------------------------------------------------------

    def test_slice_sampler_auto_traj_key_collector_ids(self, rbs):
        """Auto-detection should prefer ("collector", "traj_ids") over "episode"."""
        torch.manual_seed(0)
        # Build data with both keys present; sampler should pick collector key.
        traj_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2], dtype=torch.int)
        data = TensorDict(
            {
                ("collector", "traj_ids"): traj_ids,
                "episode": torch.zeros(8, dtype=torch.int),  # wrong, should be ignored
                "obs": torch.arange(8).float(),
            },
            batch_size=[8],
        )
        rb = rbs.TensorDictReplayBuffer(
            storage=LazyTensorStorage(8),
            sampler=SliceSampler(num_slices=2),
            batch_size=6,
        )
        rb.extend(data)
        # Force resolution. Both keys are present, but the collector key wins.
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            sample = rb.sample()
        # (cut: the rb.sampler.traj_key / _fetch_traj / _traj_key_auto asserts)
        # Each slice should come from a single trajectory
        sample_reshaped = sample.reshape(2, 3)
        for i in range(2):
            traj_vals = sample_reshaped[i][("collector", "traj_ids")]
            assert traj_vals.unique().numel() == 1

    def test_slice_sampler_auto_traj_key_no_warning_single_key(self, rbs):
        """No FutureWarning when only one of the two candidate keys is present."""
        torch.manual_seed(0)
        traj_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2], dtype=torch.int)
        data = TensorDict(
            {
                ("collector", "traj_ids"): traj_ids,
                "obs": torch.arange(8).float(),
            },
            batch_size=[8],
        )
        rb = rbs.TensorDictReplayBuffer(
            storage=LazyTensorStorage(8),
            sampler=SliceSampler(num_slices=2),
            batch_size=6,
        )
        rb.extend(data)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            rb.sample()
        # (cut: assert rb.sampler.traj_key == ("collector", "traj_ids"))

    # ------------------------------------------------------------------
    # mask / lengths tests (strict_length=False)
    # ------------------------------------------------------------------

    def _make_rb_with_short_trajs(self, traj_lengths, slice_len, num_slices):
        """Helper: build a TensorDictReplayBuffer with trajectories of given lengths."""
        parts = []
        for t_id, length in enumerate(traj_lengths):
            is_init = torch.zeros(length, 1, dtype=torch.bool)
            is_init[0] = True  # episode reset at the first step of each trajectory
            parts.append(
                TensorDict(
                    {
                        "traj": torch.full((length,), t_id, dtype=torch.int),
                        "obs": torch.arange(length).float(),
                        "is_init": is_init,
                    },
                    batch_size=[length],
                )
            )
        data = _ends_marked(torch.cat(parts))  # adapted: ends marked
        total = sum(traj_lengths)
        rb = self.rbs.TensorDictReplayBuffer(
            storage=LazyTensorStorage(total),
            sampler=SliceSampler(
                slice_len=slice_len,
                traj_key="traj",
                strict_length=False,
                pad_output=True,
            ),
            batch_size=num_slices * slice_len,
        )
        rb.extend(data)
        return rb

    @pytest.fixture(autouse=True)
    def _builders(self, rbs):
        self.rbs = rbs  # for _make_rb_with_short_trajs

    def test_slice_sampler_mask_present_when_short_trajs(self):
        """mask appears in output when short trajectories force padding."""
        torch.manual_seed(0)
        rb = self._make_rb_with_short_trajs(
            traj_lengths=[3, 6, 2], slice_len=5, num_slices=3
        )
        sample = rb.sample()
        assert ("collector", "mask") in sample.keys(True)

    def test_slice_sampler_mask_shape_dtype(self):
        """mask is bool with shape [B*T] (matches batch shape, no trailing 1)."""
        torch.manual_seed(0)
        B, T = 4, 6  # noqa: N806 - TorchRL's names
        rb = self._make_rb_with_short_trajs(
            traj_lengths=[2, 5, 3, 4], slice_len=T, num_slices=B
        )
        sample = rb.sample()
        mask = sample[("collector", "mask")]
        assert mask.shape == torch.Size([B * T])
        assert mask.dtype == torch.bool
        # mask must match the leading batch dim so trainer code can index
        # batch[batch.get(("collector", "mask"))] without broadcasting tricks.
        assert mask.shape[0] == sample.batch_size[0]

    def test_slice_sampler_mask_correctness(self):
        """mask rows are contiguous: True prefix followed by False suffix."""
        torch.manual_seed(0)
        B, T = 6, 8  # noqa: N806
        rb = self._make_rb_with_short_trajs(
            traj_lengths=[3, 8, 2, 7, 1, 5], slice_len=T, num_slices=B
        )
        for _ in range(20):
            sample = rb.sample()
            mask = sample[("collector", "mask")].reshape(B, T)
            # derive lengths from the mask itself
            lengths = mask.sum(-1)  # [B]
            for i in range(B):
                length = lengths[i].item()
                assert length >= 1
                assert length <= T
                assert mask[
                    i, :length
                ].all(), f"slice {i}: first {length} steps should be True"
                assert not mask[
                    i, length:
                ].any(), f"slice {i}: steps after {length} should be False"

    def test_slice_sampler_mask_padded_obs_is_valid(self):
        """Padded positions repeat the last real index — obs values must be finite."""
        torch.manual_seed(0)
        rb = self._make_rb_with_short_trajs(
            traj_lengths=[2, 6, 3], slice_len=5, num_slices=3
        )
        sample = rb.sample()
        assert torch.isfinite(sample["obs"]).all()

    def test_slice_sampler_strict_length_no_mask(self):
        """With pad_output=False, no mask is emitted regardless of strict_length."""
        torch.manual_seed(0)
        data = TensorDict(
            {
                "traj": torch.cat(
                    [torch.zeros(6, dtype=torch.int), torch.ones(6, dtype=torch.int)]
                ),
                "obs": torch.arange(12).float(),
            },
            batch_size=[12],
        )
        rb = self.rbs.TensorDictReplayBuffer(
            storage=LazyTensorStorage(12),
            sampler=SliceSampler(
                slice_len=4, traj_key="traj", strict_length=True, pad_output=False
            ),
            batch_size=8,
        )
        rb.extend(data)
        sample = rb.sample()
        assert ("collector", "mask") not in sample.keys(True)

    def test_slice_sampler_pad_output_strict_length_raises(self):
        """pad_output=True + strict_length=True is rejected at construction."""
        with pytest.raises(ValueError, match="pad_output=True is incompatible"):
            SliceSampler(
                slice_len=4, traj_key="traj", strict_length=True, pad_output=True
            )

    def test_slice_sampler_pad_output_marks_slice_starts(self):
        """pad_output=True writes is_init=True at every slice start.

        This is what lets a recurrent policy in `set_recurrent_mode("recurrent")`
        consume the flat [B*T] sample directly: the RNN splits on `is_init`
        and uses each slice's stored hidden state at position 0.
        """
        torch.manual_seed(0)
        B, T = 4, 8  # noqa: N806
        rb = self._make_rb_with_short_trajs(
            traj_lengths=[3, 8, 2, 7, 1, 5], slice_len=T, num_slices=B
        )
        for _ in range(10):
            sample = rb.sample()
            is_init = sample["is_init"].reshape(B, T)
            # Position 0 of every slice must be True regardless of where the
            # slice landed within its source trajectory.
            assert is_init[:, 0].all(), "every slice must start with is_init=True"

    def test_slice_sampler_marks_slice_starts_no_pad(self):
        """Default (no pad_output) flow: is_init=True at every slice start.

        This is the workflow most users will hit: trajectories are written
        end-to-end into the buffer, the sampler returns concatenated
        variable-length slices, and the RNN splits on `is_init`. No mask, no
        padding involved.
        """
        torch.manual_seed(0)
        traj_lengths = [3, 8, 2, 7, 5]
        parts = []
        for t_id, length in enumerate(traj_lengths):
            init = torch.zeros(length, 1, dtype=torch.bool)
            init[0] = True
            parts.append(
                TensorDict(
                    {
                        "traj": torch.full((length,), t_id, dtype=torch.int),
                        "is_init": init,
                    },
                    batch_size=[length],
                )
            )
        data = _ends_marked(torch.cat(parts))  # adapted: ends marked
        B = 4  # noqa: N806
        rb = self.rbs.TensorDictReplayBuffer(
            storage=LazyTensorStorage(data.numel()),
            sampler=SliceSampler(num_slices=B, traj_key="traj", strict_length=False),
            batch_size=B * 6,
        )
        rb.extend(data)
        for _ in range(10):
            sample = rb.sample()
            assert "is_init" in sample.keys(True)
            is_init = sample["is_init"].squeeze(-1)
            trunc = sample[("next", "truncated")].squeeze(-1)
            # Slice 0 always starts at position 0.
            assert is_init[0].item(), "first slice must start with is_init=True"
            # Every position right after a truncated flag must be is_init=True
            # (next slice's start). The last truncated marks the end of the
            # batch; nothing follows it.
            slice_ends = trunc.nonzero().squeeze(-1).tolist()
            for end in slice_ends[:-1]:
                assert is_init[
                    end + 1
                ].item(), f"slice starting at index {end + 1} missing is_init=True"

    def test_slice_sampler_pad_output_no_is_init_no_marker(self):
        """Without is_init in the storage we don't introduce one out of thin air."""
        torch.manual_seed(0)
        # Build a buffer *without* is_init.
        data = TensorDict(
            {
                "traj": torch.cat(
                    [
                        torch.full((3,), 0, dtype=torch.int),
                        torch.full((6,), 1, dtype=torch.int),
                        torch.full((2,), 2, dtype=torch.int),
                    ]
                ),
                "obs": torch.arange(11).float(),
            },
            batch_size=[11],
        )
        data = _ends_marked(data)  # adapted: ends marked
        rb = self.rbs.TensorDictReplayBuffer(
            storage=LazyTensorStorage(11),
            sampler=SliceSampler(
                slice_len=5, traj_key="traj", strict_length=False, pad_output=True
            ),
            batch_size=15,
        )
        rb.extend(data)
        sample = rb.sample()
        # is_init must not appear if it wasn't in the storage
        assert "is_init" not in sample.keys(True)

    def test_slice_sampler_flat_sample_matches_batched_recurrent_module(self):
        """A flat padded sample must match an explicit [B, T] recurrent call."""
        torch.manual_seed(0)
        B, T = 4, 5  # noqa: N806
        input_size, hidden_size = 3, 7
        parts = []
        for traj_id, length in enumerate([11, 9, 10, 12]):
            is_init = torch.zeros(length, 1, dtype=torch.bool)
            is_init[0] = True
            parts.append(
                TensorDict(
                    {
                        "traj": torch.full((length,), traj_id, dtype=torch.int),
                        "embed": torch.randn(length, input_size),
                        "recurrent_state": torch.randn(length, 1, hidden_size),
                        "is_init": is_init,
                    },
                    batch_size=[length],
                )
            )
        rb = self.rbs.TensorDictReplayBuffer(
            storage=LazyTensorStorage(sum(part.shape[0] for part in parts)),
            sampler=SliceSampler(
                slice_len=T,
                traj_key="traj",
                strict_length=False,
                pad_output=True,
            ),
            batch_size=B * T,
        )
        rb.extend(torch.cat(parts))
        sample = rb.sample()
        assert sample["is_init"].reshape(B, T)[:, 0].all()

        gru = GRUModule(
            input_size=input_size,
            hidden_size=hidden_size,
            num_layers=1,
            in_keys=["embed", "recurrent_state", "is_init"],
            out_keys=["features", ("next", "recurrent_state")],
        )
        with set_recurrent_mode("recurrent"):
            flat_out = gru(sample.clone())
            batched_out = gru(sample.clone().reshape(B, T))

        torch.testing.assert_close(
            flat_out["features"].reshape(B, T, hidden_size), batched_out["features"]
        )
        torch.testing.assert_close(
            flat_out[("next", "recurrent_state")].reshape(B, T, 1, hidden_size),
            batched_out[("next", "recurrent_state")],
        )

    def test_slice_sampler_truncated_marks_last_real_step(self):
        """truncated flag should sit at the last *real* timestep, not the padded end."""
        torch.manual_seed(0)
        B, T = 4, 6  # noqa: N806
        rb = self._make_rb_with_short_trajs(
            traj_lengths=[2, 5, 3, 4], slice_len=T, num_slices=B
        )
        sample = rb.sample()
        mask = sample[("collector", "mask")].reshape(B, T)
        lengths = mask.sum(-1)  # [B] — derived from mask
        trunc = sample[("next", "truncated")].reshape(B, T)
        for i in range(B):
            length = lengths[i].item()
            # truncated should be True exactly at position length-1
            assert trunc[
                i, length - 1
            ].item(), f"slice {i}: truncated missing at last real step"
            # no truncated flag in padded region
            if length < T:
                assert not trunc[
                    i, length:
                ].any(), f"slice {i}: spurious truncated in padding"

    @pytest.mark.parametrize("ndim", [1])  # (cut: 2, see the module docstring)
    @pytest.mark.parametrize("strict_length", [True, False])
    @pytest.mark.parametrize("circ", [False, True])
    @pytest.mark.parametrize("at_capacity", [False, True])
    def test_slice_sampler_prioritized(self, ndim, strict_length, circ, at_capacity):
        torch.manual_seed(0)
        out = []
        for t in range(5):
            length = (t + 1) * 5
            done = torch.zeros(length, 1, dtype=torch.bool)
            done[-1] = 1
            priority = 10 if t == 0 else 1
            traj = TensorDict(
                {
                    "traj": torch.full((length,), t),
                    "step_count": torch.arange(length),
                    "done": done,
                    "priority": torch.full((length,), priority),
                },
                batch_size=length,
            )
            out.append(traj)
        data = torch.cat(out)
        if ndim == 2:
            data = torch.stack([data, data])
        rb = self.rbs.TensorDictReplayBuffer(
            storage=LazyTensorStorage(data.numel() - at_capacity, ndim=ndim),
            sampler=PrioritizedSliceSampler(
                max_capacity=data.numel() - at_capacity,
                alpha=1.0,
                beta=1.0,
                end_key="done",
                slice_len=10,
                strict_length=strict_length,
                cache_values=True,
            ),
            batch_size=50,
        )
        if not circ:
            # Simplest case: the buffer is full but no overlap
            index = rb.extend(data, update_priority=False)
        else:
            # The buffer is 2/3 -> 1/3 overlapping
            rb.extend(data[..., : data.shape[-1] // 3], update_priority=False)
            index = rb.extend(data, update_priority=False)
        rb.update_priority(index, data["priority"])
        samples = []
        found_shorter_batch = False
        for _ in range(100):
            samples.append(rb.sample())
            if samples[-1].numel() < 50:
                found_shorter_batch = True
        samples = torch.cat(samples)
        if strict_length:
            assert not found_shorter_batch
        else:
            assert found_shorter_batch
        # the first trajectory has a very high priority, but should only appear
        # if strict_length=False.
        if strict_length:
            assert (samples["traj"] != 0).all(), samples["traj"].unique()
        else:
            assert (samples["traj"] == 0).any()
            # Check that all samples of the first traj contain all elements (since it's too
            # short to fulfill 10 elts)
            sc = samples[samples["traj"] == 0]["step_count"]
            assert (sc == 1).sum() == (sc == 2).sum()
            assert (sc == 1).sum() == (sc == 4).sum()
        # (cut: assert rb.sampler._cache, extend, assert not rb.sampler._cache)

    @pytest.mark.parametrize("ndim", [1])  # (cut: 2, see the module docstring)
    @pytest.mark.parametrize("strict_length", [True, False])
    @pytest.mark.parametrize("circ", [False])  # (cut: True, see the module docstring)
    @pytest.mark.parametrize(
        "span", [False, [False, True]]  # (cut: [False, False] = False; 3, [False, 3])
    )
    def test_slice_sampler_prioritized_span(self, ndim, strict_length, circ, span):
        torch.manual_seed(0)
        out = []
        # 5 trajs of length 3, 6, 9, 12 and 15
        for t in range(5):
            length = (t + 1) * 3
            done = torch.zeros(length, 1, dtype=torch.bool)
            done[-1] = 1
            priority = 1
            traj = TensorDict(
                {
                    "traj": torch.full((length,), t),
                    "step_count": torch.arange(length),
                    "done": done,
                    "priority": torch.full((length,), priority),
                },
                batch_size=length,
            )
            out.append(traj)
        data = torch.cat(out)
        if ndim == 2:
            data = torch.stack([data, data])
        rb = self.rbs.TensorDictReplayBuffer(
            storage=LazyTensorStorage(data.numel(), ndim=ndim),
            sampler=PrioritizedSliceSampler(
                max_capacity=data.numel(),
                alpha=1.0,
                beta=1.0,
                end_key="done",
                slice_len=5,
                strict_length=strict_length,
                cache_values=True,
                span=span,
            ),
            batch_size=5,
        )
        if not circ:
            # Simplest case: the buffer is full but no overlap
            index = rb.extend(data)
        else:
            # The buffer is 2/3 -> 1/3 overlapping
            rb.extend(data[..., : data.shape[-1] // 3])
            index = rb.extend(data)
        rb.update_priority(index, data["priority"])
        found_traj_0 = False
        found_traj_4_truncated_right = False
        for i, s in enumerate(rb):
            t = s["traj"].unique().tolist()
            assert len(t) == 1
            t = t[0]
            if t == 0:
                found_traj_0 = True
            if t == 4 and s.numel() < 5:
                if s["step_count"][0] > 10:
                    found_traj_4_truncated_right = True
                if s["step_count"][0] == 0:
                    pass
            if i == 1000:
                break
        # (cut: assert not rb.sampler.span[0]; `span` is what the sampler was given)
        sampler_span = span if isinstance(span, list) else [span, span]
        if sampler_span[1]:
            assert found_traj_4_truncated_right
        else:
            assert not found_traj_4_truncated_right
        if strict_length and not sampler_span[1]:
            assert not found_traj_0
        else:
            assert found_traj_0


# -- test/rb/test_samplers.py: module-level PrioritizedSliceSampler tests ------------
@pytest.mark.parametrize("device", get_default_devices())
def test_prioritized_slice_sampler_episodes(device, rbs):
    num_slices = 10
    batch_size = 20

    episode = torch.zeros(100, dtype=torch.int, device=device)
    episode[:30] = 1
    episode[30:55] = 2
    episode[55:70] = 3
    episode[70:] = 4
    steps = torch.cat(
        [torch.arange(30), torch.arange(25), torch.arange(15), torch.arange(30)], 0
    )
    done = torch.zeros(100, 1, dtype=torch.bool)
    done[torch.tensor([29, 54, 69])] = 1

    data = TensorDict(
        {
            "observation": torch.randn(100, 16),
            "action": torch.randn(100, 4),
            "episode": episode,
            "steps": steps,
            ("next", "observation"): torch.randn(100, 16),
            ("next", "reward"): torch.randn(100, 1),
            ("next", "done"): done,
        },
        batch_size=[100],
        device=device,
    )

    num_steps = data.shape[0]
    sampler = rbs.PrioritizedSliceSampler(
        max_capacity=num_steps,
        alpha=0.7,
        beta=0.9,
        num_slices=num_slices,
    )

    rb = rbs.TensorDictReplayBuffer(
        storage=LazyMemmapStorage(100),
        sampler=sampler,
        batch_size=batch_size,
    )
    rb.extend(data)

    episodes = []
    for _ in range(10):
        sample = rb.sample()
        episodes.append(sample["episode"])
    assert {1, 2, 3, 4} == set(
        torch.cat(episodes).cpu().tolist()
    ), "all episodes are expected to be sampled at least once"

    index = torch.arange(0, num_steps, 1)
    new_priorities = torch.cat(
        [torch.ones(30), torch.zeros(25), torch.ones(15), torch.zeros(30)], 0
    )
    sampler.update_priority(index, new_priorities)

    episodes = []
    for _ in range(10):
        sample = rb.sample()
        episodes.append(sample["episode"])
    assert {1, 3} == set(
        torch.cat(episodes).cpu().tolist()
    ), "after priority update, only episode 1 and 3 are expected to be sampled"
