"""examples/torchrl_r2d2_cartpole.py's own pieces: the env a worker steps
(velocities dropped, the previous action right across TorchRL's partial
resets of its lanes) and the reshaping of a flat TorchRL sample of slices
into the batch examples/r2d2_cartpole.py's loss reads."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples"))


@pytest.fixture
def example(monkeypatch):
    for name in ("torch", "torchrl", "gymnasium"):
        pytest.importorskip(name, reason=f"needs {name} (pip install '.[examples]')")
    monkeypatch.syspath_prepend(EXAMPLES)
    return importlib.import_module("torchrl_r2d2_cartpole")


def test_without_torchrl_it_says_what_to_install():
    # As `python examples/torchrl_r2d2_cartpole.py` runs it (its folder first
    # on sys.path), with torchrl made unimportable.
    path = os.path.join(EXAMPLES, "torchrl_r2d2_cartpole.py")
    code = (f"import runpy, sys; sys.modules['torchrl'] = None; sys.path.insert(0, {EXAMPLES!r}); "
            f"sys.argv = [{path!r}]; runpy.run_path({path!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "examples/torchrl_r2d2_cartpole.py needs torchrl, which is not installed" in out.stderr
    assert "pip install 'distore-ucx[examples]'" in out.stderr and "Traceback" not in out.stderr


def test_lanes_see_position_angle_and_the_previous_action(example):
    import torch

    env = example.make_env(4)
    try:
        env.set_seed(0)
        # Random play: CartPole episodes of ~20 steps, so 200 steps of 4 lanes
        # hold dozens of episode ends, each lane resetting on its own.
        td = env.rollout(200, break_when_any_done=False)
    finally:
        env.close()
    assert td["observation"].shape == (4, 200, 2)
    steps = td["step_count"].squeeze(-1)
    prev, action = td["prev_action"], td["action"].argmax(-1)
    assert (steps == 0).sum() > 20, "too few episode starts to test the resets"
    # An episode's first step follows no action (0, as the R2D2 actor feeds
    # it); every other step follows its lane's action before it.
    assert (prev[steps == 0] == 0).all()
    later = steps[:, 1:] > 0
    assert (prev[:, 1:][later] == action[:, :-1][later]).all()
    assert (td["next", "prev_action"] == action).all()
    # CartPole's (x, x', theta, theta') without the velocities; a lane's
    # step starts where its step before led.
    assert example.seen(torch.arange(8.0).reshape(2, 4)).tolist() == [[0, 2], [4, 6]]
    obs, nxt = td["observation"], td["next", "observation"]
    assert (obs[:, 1:][later] == nxt[:, :-1][later]).all()
    assert td["is_init"].squeeze(-1).eq(steps == 0).all()


def test_a_flat_sample_becomes_the_losses_batch(example):
    import torch
    from tensordict import TensorDict

    b, t = 3, 5
    n = b * t
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 3:] = False  # slice 1: its episode ended at its third step
    done = torch.zeros(b, t, 1, dtype=torch.bool)
    done[1, 2] = True
    action = torch.zeros(n, 2, dtype=torch.int64)
    action[torch.arange(n), torch.arange(n) % 2] = 1
    td = TensorDict({
        "observation": torch.arange(n * 2.0).reshape(n, 2),
        "prev_action": torch.arange(n) % 2,
        "action": action,
        "step_count": torch.arange(n).reshape(n, 1),
        "priority_weight": torch.tensor([0.5, 0.25, 1.0]).repeat_interleave(t),
        ("collector", "mask"): mask.reshape(n),
        ("next", "reward"): torch.ones(n, 1),
        ("next", "terminated"): done.reshape(n, 1),
        ("next", "done"): done.reshape(n, 1),
    }, batch_size=[n])
    batch = example.as_slices(td, b)
    assert batch.data["obs"].shape == (b, t, 2) and batch.data["obs"][1, 0].tolist() == [10, 11]
    assert batch.data["action"].tolist() == (torch.arange(n) % 2).reshape(b, t).tolist()
    assert batch.data["reward"].shape == (b, t) and batch.data["terminated"][1, 2] == 1.0
    assert batch.mask.tolist() == mask.tolist()
    assert batch.positions[2].tolist() == list(range(10, 15))
    assert batch.is_last.tolist() == done.squeeze(-1).tolist()
    assert batch.weights.tolist() == [0.5, 0.25, 1.0]
