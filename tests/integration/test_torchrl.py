"""TorchRL replay buffers backed by a distore table, against a real store and
the real torchrl package: contents survive the round trip, weights are the
learner's, priorities reach the control plane, errors say what is wrong,
and TorchRL's DQNLoss, collectors and the example work unchanged."""

from __future__ import annotations

import functools
import importlib
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install '.[examples]')")
tensordict = pytest.importorskip(
    "tensordict", reason="needs tensordict (pip install '.[examples]')"
)
TensorDict = tensordict.TensorDict

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
# One transport is enough here: the read paths have their own tests.
pytestmark = pytest.mark.parametrize("tls", ["sm"], indirect=True)


@pytest.fixture
def cluster(module_clusters, tls, request):
    """Two storage nodes, shared by the module's tests: each uses tables of
    its own name and asserts nothing store-wide (conftest's module_clusters).
    Failure detection is tested elsewhere: here a node late with its
    heartbeat on a busy 2-core machine must not be dropped."""
    return module_clusters(request.node.callspec.params["tls"], heartbeat_timeout=30.0)


def transitions(n: int, start: int = 0) -> TensorDict:
    """n CartPole-like transitions whose every value says which item it is."""
    i = torch.arange(start, start + n)
    return TensorDict(
        {
            "observation": i[:, None].float().expand(n, 4) + torch.arange(4) / 10,
            "action": torch.nn.functional.one_hot(i % 2, 2),
            "done": (i % 3 == 0)[:, None],
            ("next", "observation"): i[:, None].float().expand(n, 4) + 1,
            ("next", "reward"): (i[:, None] * 0.5).float(),
            ("next", "done"): (i % 5 == 0)[:, None],
        },
        [n],
    )


def rows_for(index: torch.Tensor, keys: torch.Tensor, data: TensorDict) -> TensorDict:
    """The rows of `data` (inserted with `keys`) that `index` names."""
    where = {int(k): r for r, k in enumerate(keys.tolist())}
    return data[torch.tensor([where[int(k)] for k in index.tolist()])]


def test_extend_sample_round_trip_keeps_every_value(cluster):
    import distore_ucx as ds
    from distore_ucx.torchrl import DistoreReplayBuffer

    data = transitions(200)
    with DistoreReplayBuffer(cluster.address, "rt", capacity=1000, batch_size=32) as rb:
        keys = rb.extend(data)
        assert keys.dtype == torch.int64 and len(keys) == 200 and len(set(keys.tolist())) == 200
        assert torch.equal(data["index"], keys)  # set on the input, as TorchRL does
        assert len(rb) == 200 and rb.write_count == 200
        with ds.connect(cluster.address) as client:  # the table as distore sees it
            spec = {name: (shape, dtype) for name, shape, dtype in client.table_info("rt")["spec"]}
        assert spec["next/observation"] == ([4], "<f4") and spec["done"] == ([1], "|b1")
        assert "index" not in spec
        for _ in range(5):
            td = rb.sample()
            assert td.batch_size == torch.Size([32]) and td.device == torch.device("cpu")
            assert ("next", "observation") in td.keys(include_nested=True)
            assert "priority_weight" not in td  # not prioritized: no weights
            want = rows_for(td["index"], keys, data)
            for key in want.keys(include_nested=True, leaves_only=True):
                if key != "index":
                    assert torch.equal(td[key], want[key]), key
        big = rb.sample(64)  # another size: another learner, same table
        assert big.batch_size == torch.Size([64])
        one = transitions(1, start=500)[0]
        key = rb.add(one)
        assert len(rb) == 201 and int(one["index"]) == int(key)


def test_weights_are_the_learners_and_priorities_come_from_td_error(cluster):
    import distore_ucx as ds
    from distore_ucx.torchrl import DistorePrioritizedReplayBuffer

    n, alpha, beta = 50, 0.6, 0.4
    data = transitions(n)
    prio = torch.arange(1, n + 1).float()
    data["td_error"] = prio[:, None]  # TorchRL's priority_key, with a trailing dimension
    with DistorePrioritizedReplayBuffer(
        cluster.address, "per", alpha=alpha, beta=beta, eps=0.0, capacity=1000, batch_size=64
    ) as rb:
        keys = rb.extend(data)
        p = dict(zip(keys.tolist(), prio.tolist()))
        total = sum(v**alpha for v in p.values())
        p_min = min(p.values()) ** alpha / total  # the least likely item of the table
        for _ in range(3):
            td, info = rb.sample(return_info=True)
            probs = np.array([p[k] ** alpha / total for k in td["index"].tolist()])
            # TorchRL's formula (PrioritizedSampler.sample): (p_i / p_min)^-beta,
            # i.e. (N * P(i))^-beta normalised by the largest weight of the whole table.
            expected = (probs / p_min) ** -beta
            assert torch.allclose(td["priority_weight"], torch.from_numpy(expected).float())
            assert td["_weight"] is td["priority_weight"]
            assert info["priority_weight"] is td["priority_weight"]
            assert torch.equal(info["index"], td["index"])
        with ds.connect(cluster.address) as client:  # the store's own learner agrees
            assert client.table_info("per")["sampler"]["kind"] == "prioritized"
            batch = client.learner("per", batch_size=64, beta=beta).sample()
            probs = np.array([p[k] ** alpha / total for k in batch.keys.tolist()])
            np.testing.assert_allclose(batch.probabilities, probs, rtol=1e-9)
            np.testing.assert_allclose(batch.weights, (probs / p_min) ** -beta, rtol=1e-9)


def test_update_priority_reaches_the_table(cluster):
    from distore_ucx.torchrl import DistorePrioritizedReplayBuffer

    with DistorePrioritizedReplayBuffer(
        cluster.address, "upd", alpha=1.0, beta=0.5, eps=0.0, capacity=1000, batch_size=16
    ) as rb:
        data = transitions(100)
        keys = rb.extend(data, update_priority=False)  # all at the default priority, 1.0
        td = rb.sample()
        # As a TorchRL loop does: the loss writes td_error, the buffer sends it back.
        hot = td["index"][0]
        td["td_error"] = torch.where(td["index"] == hot, 5.0, 0.0)[:, None]
        assert rb.update_tensordict_priority(td) is None  # not waited for, as TorchRL's
        out = rb.flush_priorities()
        assert out["missing"] == 0 and out["updated"] == len(td)
        # Items sampled above now have priority 0 (never drawn) except `hot`.
        zero = set(td["index"].tolist()) - {int(hot)}
        seen = torch.cat([rb.sample()["index"] for _ in range(20)]).tolist()
        assert int(hot) in seen and not zero & set(seen)
        # update_priority with keys and a plain tensor: everything at 0 but one item.
        rb.update_priority(keys, torch.zeros(100))
        rb.update_priority(keys[7:8], torch.tensor([3.0]))
        assert set(rb.sample()["index"].tolist()) == {int(keys[7])}
        # The largest priority so far is what new items get (TorchRL's default).
        rb.update_priority(keys[7:8], torch.tensor([0.0]))
        new = rb.extend(transitions(1, start=100))
        assert set(rb.sample()["index"].tolist()) == {int(new[0])}
        with pytest.raises(ValueError, match="finite"):
            rb.update_priority(keys[:1], torch.tensor([float("nan")]))


def test_mismatched_data_is_refused_naming_the_key(cluster):
    import distore_ucx as ds
    from distore_ucx.torchrl import DistoreReplayBuffer

    with DistoreReplayBuffer(cluster.address, "bad", capacity=100, batch_size=4) as rb:
        rb.extend(transitions(8))
        bad = transitions(4).exclude(("next", "reward"))
        with pytest.raises(ds.SpecMismatch, match=r"missing: \[\('next', 'reward'\)\]"):
            rb.extend(bad)
        bad = transitions(4)
        bad["extra"] = torch.zeros(4)
        with pytest.raises(ds.SpecMismatch, match=r"not in the table: \['extra'\]"):
            rb.extend(bad)
        bad = transitions(4)
        bad["observation"] = torch.zeros(4, 5)
        with pytest.raises(ds.SpecMismatch, match=r"key 'observation': shape \[4, 5\]"):
            rb.extend(bad)
        bad = transitions(4)
        bad["next", "reward"] = torch.zeros(4, 1, dtype=torch.float64)
        with pytest.raises(ds.SpecMismatch, match=r"\('next', 'reward'\).*float64.*float32"):
            rb.extend(bad)
        with pytest.raises(ds.SpecMismatch, match=r"items have batch size \[\], the data's \[2\]"):
            rb.extend(transitions(4).reshape(2, 2))  # 2 items of 2 steps, as TorchRL reads it
        with pytest.raises(ds.SpecMismatch, match="batch size"):
            rb.add(transitions(2))
        with pytest.raises(ds.SpecMismatch, match="first 1 batch dimension"):
            rb.extend(transitions(1)[0])  # one item: add() it
        with pytest.raises(TypeError, match="TensorDict"):
            rb.extend({"observation": torch.zeros(4, 4)})
        assert len(rb) == 8  # nothing of the refused data went in
        # A buffer on the existing table with other fields is refused as well.
        with pytest.raises(ds.SpecMismatch, match="exists with fields"):
            DistoreReplayBuffer(cluster.address, "bad", spec=TensorDict({"obs": torch.zeros(1)}))
    with pytest.raises(ds.Closed, match="closed"):
        rb.sample()
    with DistoreReplayBuffer(cluster.address, "none", batch_size=4) as rb:
        with pytest.raises(ds.ConfigError, match="capacity="):
            rb.extend(transitions(4))
        with pytest.raises(RuntimeError, match="empty storage.*does not exist yet"):
            rb.sample()
        assert len(rb) == 0


def test_an_existing_table_is_used_as_it_is(cluster):
    import distore_ucx as ds
    from distore_ucx.torchrl import DistoreReplayBuffer

    with ds.connect(cluster.address) as client:
        client.create_table(
            "made", capacity=100, spec={"obs": ((3,), "float32"), "next/obs": ((3,), "float32")}
        )
        with client.writer() as w:  # a plain distore writer (an actor elsewhere)
            obs = np.repeat(np.arange(50, dtype=np.float32)[:, None], 3, axis=1)
            keys = w.insert("made", {"obs": obs, "next/obs": obs + 1})
    value = dict(zip(keys.tolist(), range(50)))
    with DistoreReplayBuffer(cluster.address, "made", batch_size=5, clone=True) as rb:
        td = rb.sample()
        assert torch.equal(td["next", "obs"], td["obs"] + 1)
        keep, index = td["obs"], td["index"]
        want = torch.tensor([[float(value[k])] * 3 for k in index.tolist()])
        assert torch.equal(keep, want)
        for _ in range(6):  # enough to refill every slot of the learner's ring
            rb.sample()
        assert torch.equal(keep, want)  # clone=True: a copy, not a view of the ring


def test_a_sample_after_extend_never_holds_the_items_it_evicted(cluster):
    # TorchRL's test_prb at capacity 5: extend 3, sample, extend 5, sample.
    from distore_ucx.torchrl import DistorePrioritizedReplayBuffer, DistoreReplayBuffer

    for i, cls in enumerate((DistoreReplayBuffer, DistorePrioritizedReplayBuffer)):
        opts = {"alpha": 0.7, "beta": 0.9} if i else {}
        with cls(cluster.address, f"evict{i}", capacity=5, batch_size=5, **opts) as rb:
            for round_ in range(3):
                rb.extend(transitions(3, start=100 * round_))
                rb.sample()
                second = rb.extend(transitions(5, start=100 * round_ + 10))
                got = set(rb.sample()["index"].tolist())
                assert got <= set(second.tolist()), (round_, got, second)


def test_a_priority_update_shows_in_the_very_next_sample(cluster):
    from distore_ucx.torchrl import DistorePrioritizedReplayBuffer

    with DistorePrioritizedReplayBuffer(cluster.address, "next", alpha=1.0, beta=0.5,
                                        capacity=100, batch_size=8) as rb:
        keys = rb.extend(transitions(50))
        for k in keys[:10].tolist():  # extend, sample, loss, update, sample: as TorchRL
            td = rb.sample()
            td["index"][0] = k  # the hot item is in the update whether drawn or not
            td["td_error"] = torch.where(td["index"] == k, 1e9, 0.0)[:, None]
            rb.update_tensordict_priority(td)
            assert set(rb.sample()["index"].tolist()) == {k}
            rb.update_priority(keys, torch.ones(50))


def test_the_priority_key_is_stored_and_a_missing_one_means_the_default(cluster):
    from distore_ucx.torchrl import DistorePrioritizedReplayBuffer

    with DistorePrioritizedReplayBuffer(cluster.address, "pk", alpha=1.0, beta=0.5, eps=0.0,
                                        capacity=100, batch_size=16) as rb:
        data = transitions(20)
        data["td_error"] = torch.arange(1, 21).float()[:, None]
        keys = rb.extend(data)
        td = rb.sample()
        want = rows_for(td["index"], keys, data)
        assert torch.equal(td["td_error"], want["td_error"])  # kept, as TorchRL keeps it
        # Without td_error: the default priority, the largest so far (20), as TorchRL.
        rb.update_priority(keys, torch.full((20,), 1e-6))
        rb.update_tensordict_priority(td.exclude("td_error")[:1])
        assert set(rb.sample()["index"].tolist()) == {int(td["index"][0])}


def test_errors_are_what_torchrl_code_catches(cluster):
    import time

    import distore_ucx as ds
    from distore_ucx.torchrl import DistoreReplayBuffer

    with DistoreReplayBuffer(cluster.address, "errs", capacity=10) as rb:
        rb.extend(transitions(4))
        assert rb.sample(3).batch_size == torch.Size([3])
        with pytest.raises(RuntimeError, match="batch_size not specified"):
            rb.sample()
        with pytest.raises(RuntimeError, match="Batch_size was not specified"):
            iter(rb)
        with pytest.raises(ds.ConfigError):  # still a distore error
            rb.sample()
    # An empty table: at once, a RuntimeError (TorchRL's message) and ds.NoData.
    with ds.connect(cluster.address) as client:
        client.create_table("void", capacity=10, spec={"obs": ((4,), "float32")})
    with DistoreReplayBuffer(cluster.address, "void", batch_size=2) as rb:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="Cannot sample from an empty storage") as err:
            rb.sample()
        assert time.monotonic() - t0 < 5.0 and isinstance(err.value, ds.NoData)
    with DistoreReplayBuffer(cluster.address, "void", batch_size=2, sample_timeout=0.5) as rb:
        t0 = time.monotonic()
        with pytest.raises(ds.NoData):
            rb.sample()  # waited for actors, as asked
        assert time.monotonic() - t0 >= 0.5


def test_options_that_differ_from_the_table_are_refused_by_name(cluster):
    import distore_ucx as ds
    from distore_ucx.torchrl import DistorePrioritizedReplayBuffer, DistoreReplayBuffer

    with DistorePrioritizedReplayBuffer(cluster.address, "opts", alpha=0.6, beta=0.4,
                                        capacity=100) as rb:
        rb.extend(transitions(4))
    with pytest.raises(ds.TableExists, match=r"sampler.*'alpha': 0\.6.*'alpha': 0\.8"):
        DistorePrioritizedReplayBuffer(cluster.address, "opts", alpha=0.8, beta=0.4)
    with pytest.raises(ds.TableExists, match=r"capacity: 100 there, 50 asked"):
        DistorePrioritizedReplayBuffer(cluster.address, "opts", alpha=0.6, beta=0.4, capacity=50)
    with pytest.raises(ds.TableExists, match="sampler"):
        DistoreReplayBuffer(cluster.address, "opts", sampler=ds.Uniform())
    # The same options, or none, use the table as it is.
    with DistorePrioritizedReplayBuffer(cluster.address, "opts", alpha=0.6, beta=0.4,
                                        capacity=100, batch_size=2) as rb:
        assert rb.sample().batch_size == torch.Size([2])
    with DistoreReplayBuffer(cluster.address, "opts", batch_size=2) as rb:
        assert len(rb) == 4


def test_sampled_tensors_are_the_callers_unless_views_are_asked_for(cluster):
    from distore_ucx.torchrl import DistoreReplayBuffer

    with DistoreReplayBuffer(cluster.address, "own", capacity=100, batch_size=4) as rb:
        rb.extend(transitions(50))
        first = rb.sample()
        keep = first["observation"].clone()
        for _ in range(8):  # more than the learner's ring holds
            rb.sample()
        assert torch.equal(first["observation"], keep)
    with DistoreReplayBuffer(cluster.address, "own", batch_size=4, clone=False,
                             prefetch=0) as rb:
        first = rb.sample()
        keep = first["observation"].clone()
        changed = False
        for _ in range(20):  # a ring of one batch: the next sample reuses it
            rb.sample()
            changed |= not torch.equal(first["observation"], keep)
        assert changed


@pytest.mark.slow
def test_batches_of_a_collector_over_parallel_envs_are_stored_as_torchrl_stores_them(cluster):
    pytest.importorskip("torchrl", reason="needs torchrl (pip install '.[examples]')")
    pytest.importorskip("gymnasium", reason="needs gymnasium (pip install '.[examples]')")
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv, ParallelEnv, SerialEnv

    from distore_ucx.torchrl import DistoreReplayBuffer

    def policy(td):  # random actions; CartPole's action spec is one-hot
        return td.set("action", torch.nn.functional.one_hot(
            torch.randint(2, td.batch_size), 2))

    # ndim=2: every step of every env one item (LazyTensorStorage(..., ndim=2)).
    # Forked workers: a spawned one imports torch and TorchRL again, seconds
    # each on 2 busy cores; how the envs' steps are stored is what is checked
    # here.
    env = ParallelEnv(4, functools.partial(GymEnv, "CartPole-v1"), mp_start_method="fork")
    try:
        with DistoreReplayBuffer(cluster.address, "par", capacity=1000, ndim=2,
                                 batch_size=16) as rb:
            collector = Collector(env, policy, frames_per_batch=40, total_frames=120,
                                  replay_buffer=rb, auto_register_policy_transforms=False)
            for _ in collector:
                pass
            collector.shutdown()
            assert rb.write_count == 120 and len(rb) == 120
            td = rb.sample()
            assert td.batch_size == torch.Size([16]) and td["observation"].shape == (16, 4)
            assert td["next", "observation"].shape == (16, 4)
    finally:
        if not env.is_closed:
            env.close()
    # ndim=1 (TorchRL's default): each env's [T] steps are one item.
    env = SerialEnv(2, functools.partial(GymEnv, "CartPole-v1"))
    with DistoreReplayBuffer(cluster.address, "ser", capacity=100, batch_size=3) as rb:
        collector = Collector(env, policy, frames_per_batch=20, total_frames=40,
                              replay_buffer=rb, auto_register_policy_transforms=False)
        for _ in collector:
            pass
        collector.shutdown()
        assert rb.write_count == 4 and len(rb) == 4  # 2 batches x 2 envs
        td = rb.sample()
        assert td.batch_size == torch.Size([3, 10]) and td["observation"].shape == (3, 10, 4)
        assert td["index"].shape == (3, 10) and (td["index"] == td["index"][:, :1]).all()
        # A trajectory's steps are in order: each next observation is the following one.
        same = td["next", "observation"][:, :-1] == td["observation"][:, 1:]
        done = td["next", "done"][:, :-1].squeeze(-1)
        assert same.all(-1)[~done].all()


def test_dqn_loss_and_a_collector_use_the_buffer_unchanged(cluster):
    pytest.importorskip("torchrl", reason="needs torchrl (pip install '.[examples]')")
    pytest.importorskip("gymnasium", reason="needs gymnasium (pip install '.[examples]')")
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv
    from torchrl.modules import MLP, QValueActor
    from torchrl.objectives import DQNLoss, SoftUpdate

    from distore_ucx.torchrl import DistorePrioritizedReplayBuffer

    env = GymEnv("CartPole-v1")
    actor = QValueActor(
        MLP(in_features=4, out_features=2, num_cells=[32]),
        in_keys=["observation"],
        spec=env.action_spec,
    )
    with DistorePrioritizedReplayBuffer(
        cluster.address, "dqn", alpha=0.6, beta=0.4, capacity=10_000, batch_size=32
    ) as rb:
        # The collector writes into the buffer itself (replay_buffer=).
        collector = Collector(
            env,
            actor,
            frames_per_batch=50,
            total_frames=200,
            replay_buffer=rb,
            auto_register_policy_transforms=False,
        )
        for _ in collector:
            pass
        collector.shutdown()
        assert rb.write_count == 200 and len(rb) == 200
        loss = DQNLoss(actor, action_space=env.action_spec, delay_value=True)
        loss.make_value_estimator(gamma=0.99)
        SoftUpdate(loss, eps=0.99)
        td = rb.sample()
        out = loss(td)  # reads priority_weight, writes td_error
        assert torch.isfinite(out["loss"]) and td["td_error"].shape == (32, 1)
        out["loss"].backward()
        rb.update_tensordict_priority(td)
        assert rb.flush_priorities()["missing"] == 0


@pytest.fixture
def fork_start():
    """The global start method fork, which the example's ParallelEnv takes
    up (TorchRL's default is spawn when none is set): a spawned env worker
    imports torch and TorchRL again, 2-3 s of a core each of the four on 2
    busy cores. The workers only step CartPole; the buffer stays in this
    process. As test_examples.py's fork_start for the R2D2 example."""
    import multiprocessing as mp

    before = mp.get_start_method(allow_none=True)
    mp.set_start_method("fork", force=True)
    yield
    mp.set_start_method(before, force=True)


def test_the_example_trains_with_torchrl_components(tls, monkeypatch, fork_start):
    pytest.importorskip("torchrl", reason="needs torchrl (pip install '.[examples]')")
    pytest.importorskip("gymnasium", reason="needs gymnasium (pip install '.[examples]')")
    monkeypatch.syspath_prepend(os.path.abspath(EXAMPLES))
    example = importlib.import_module("torchrl_dqn")
    args = example.parse_args(
        [
            "--frames",
            "1200",
            "--init-frames",
            "400",
            "--target",
            "0",
            "--updates-per-batch",
            "4",
            "--minutes",
            "4",
        ]
    )
    s = example.train(args)
    assert s["frames"] >= 1200 and s["episodes"] >= 10, s
    steps = (s["frames"] - 400) // 16 * 4
    assert steps - 8 <= s["train_steps"] <= steps + 8, s
    # Every transition went through the table, every sample came from it.
    assert s["table_inserts"] == s["frames"]
    assert s["table_samples"] >= s["train_steps"] * args.batch
    assert s["priority_updates_missing"] == 0
    assert all(math.isfinite(r) and r >= 8 for r in s["returns"])  # CartPole returns


@pytest.mark.gpu
def test_samples_land_on_the_gpu(cluster):
    from distore_ucx.torchrl import DistorePrioritizedReplayBuffer

    with DistorePrioritizedReplayBuffer(
        cluster.address, "gpu", alpha=0.6, beta=0.4, capacity=100, batch_size=8, device="cuda:0"
    ) as rb:
        data = transitions(20)
        keys = rb.extend(data.to("cuda:0"))
        td = rb.sample()
        assert td.device == torch.device("cuda:0")
        assert td["observation"].is_cuda and td["index"].is_cuda and td["priority_weight"].is_cuda
        want = rows_for(td["index"].cpu(), keys.cpu(), data)
        assert torch.equal(td["next", "observation"].cpu(), want["next", "observation"])
        rb.update_tensordict_priority(td.set("td_error", torch.ones(8, 1, device="cuda:0")))


DROPPED = """
import gc, sys, torch
from tensordict import TensorDict
from distore_ucx.torchrl import DistoreReplayBuffer
def use(name):
    rb = DistoreReplayBuffer(sys.argv[1], name, capacity=100, batch_size=4)
    rb.extend(TensorDict({"obs": torch.zeros(16, 4)}, batch_size=[16]))
    rb.sample()
    return rb
use("dropped")  # garbage-collected while the program runs
gc.collect()
kept = use("kept")  # still open at exit
print("done", flush=True)
"""


def test_a_buffer_never_closed_closes_its_client_quietly(cluster, tmp_path):
    # Issue 51: a buffer with its own client (an address), dropped without
    # close(), left ucxx to stop the client's progress thread in a destructor:
    # "UCXX WARN The progress thread should be explicitly stopped".
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", DROPPED, cluster.address], capture_output=True,
                         text=True, timeout=120, cwd=str(tmp_path), check=False)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    # ucxx logs to stdout
    assert "progress thread should be explicitly stopped" not in out.stdout + out.stderr, \
        out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
