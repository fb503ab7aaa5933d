"""examples/r2d2_cartpole.py's losses on a hand-made batch of slices: which
steps take a loss (real, past the burn-in unless the slice starts its
episode, n steps ahead or the episode's end in the slice) and the n-step
targets (stopped at a terminal step, bootstrapped otherwise)."""

from __future__ import annotations

import importlib
import os
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install '.[examples]')")

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def test_losses_take_real_steps_past_the_burn_in_with_n_step_targets(monkeypatch):
    monkeypatch.syspath_prepend(os.path.abspath(EXAMPLES))
    r2d2 = importlib.import_module("r2d2_cartpole")
    t, burn, n = 12, 4, r2d2.N_STEP
    # slice 0: an episode's first 7 steps, the 7th terminal, then padding;
    # slice 1: steps 40..51 of a longer episode (no end in it).
    mask = np.ones((2, t), bool)
    mask[0, 7:] = False
    positions = np.stack([np.r_[np.arange(7), np.full(5, 6)], np.arange(40, 40 + t)])
    is_last = np.zeros((2, t), bool)
    is_last[0, 6] = True
    terminated = np.zeros((2, t), np.float32)
    terminated[0, 6:] = 1.0  # padding repeats the last step
    data = {"obs": np.random.default_rng(0).normal(size=(2, t, 2)).astype(np.float32),
            "action": np.zeros((2, t), np.int64), "prev_action": np.zeros((2, t), np.int64),
            "reward": np.ones((2, t), np.float32),
            "terminated": terminated}
    batch = types.SimpleNamespace(data=data, mask=mask, positions=positions, is_last=is_last)
    net = r2d2.make_net()
    td, take = r2d2.losses(batch, net, net, burn)
    expect = np.zeros((2, t), bool)
    expect[0, :7] = True  # it starts its episode and ends it: every real step
    expect[1, burn:t - n] = True  # burn-in off, n steps ahead needed
    assert np.array_equal(take.numpy(), expect)
    obs, prev = torch.as_tensor(data["obs"]), torch.as_tensor(data["prev_action"])
    q, _ = net(obs, prev)
    q = q[..., 0].detach()
    y = (td.detach() + q * take)  # the targets where a loss is taken
    # the terminal step's target is its reward; two steps before it, the
    # rewards up to and including the terminal one, nothing bootstrapped
    assert y[0, 6].item() == pytest.approx(1.0, abs=1e-5)
    assert y[0, 4].item() == pytest.approx(1 + r2d2.GAMMA + r2d2.GAMMA ** 2, abs=1e-5)
    # a full slice: n rewards and the bootstrap from n steps ahead
    g = r2d2.GAMMA
    ret = sum(g ** k for k in range(n))
    boot = net(obs, prev)[0][1, burn + n].max().item()
    assert y[1, burn].item() == pytest.approx(ret + g ** n * boot, rel=1e-4)
