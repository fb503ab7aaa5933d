"""The examples run and learn (a short version of each)."""

from __future__ import annotations

import argparse
import importlib.util
import os

import numpy as np
import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


@pytest.mark.slow
def test_dqn_cartpole_returns_improve():
    pytest.importorskip("torch", reason="needs torch (pip install '.[examples]')")
    pytest.importorskip("gymnasium", reason="needs gymnasium (pip install '.[examples]')")
    spec = importlib.util.spec_from_file_location(
        "dqn_cartpole", os.path.join(EXAMPLES, "dqn_cartpole.py")
    )
    dqn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dqn)
    summary = dqn.train(argparse.Namespace(minutes=2.0, target=195.0, batch=64, seed=0))
    returns = np.array(summary["returns"])
    assert len(returns) >= 60, f"only {len(returns)} episodes in 2 minutes"
    first, last = returns[:20].mean(), returns[-20:].mean()
    # A random policy averages ~22; learning shows as a clear rise.
    assert last > 2 * first and last > 50, (first, last)
    assert summary["train_steps"] > 1000
