"""What TorchRL tests run in other processes: an env whose every frame says
which it is (to count what collectors' workers wrote) and the children that
use a pickled replay buffer. Importable as `torchrl_children` by spawned
processes: pyproject's pytest `pythonpath` puts tests/ on sys.path, which
children inherit (test files themselves are imported by path)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data import Categorical, Composite, Unbounded
from torchrl.envs import EnvBase


def episode_length(uid: Any, episode: Any) -> Any:
    """Steps of episode `episode` of the lane `uid` (tensors or arrays): 3 to
    12, varied, so that episodes end at every offset of a collector's batch."""
    return 3 + (uid + 7 * episode) % 10


class CountingEnv(EnvBase):
    """`lanes` independent episodes stepped together (batch size [lanes]: one
    process steps many, which keeps collector tests cheap). A lane's
    observation "obs" is (uid, episode, t): uid is random per lane (62
    bits: unique across processes), t the step within the episode, which
    lasts `episode_length(uid, episode)` steps. So a frame's obs names it,
    and its ("next", "obs") is (uid, episode, t + 1)."""

    def __init__(self, lanes: int = 1):
        """`lanes` lanes with fresh uids; actions are ignored."""
        super().__init__(batch_size=torch.Size([lanes]))
        self.observation_spec = Composite(
            obs=Unbounded(shape=(lanes, 3), dtype=torch.int64), shape=(lanes,))
        self.action_spec = Categorical(2, shape=(lanes,))
        self.reward_spec = Unbounded(shape=(lanes, 1))
        rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
        self.uid = torch.from_numpy(rng.integers(0, 1 << 62, lanes, dtype=np.int64))
        self.episode = torch.full((lanes,), -1, dtype=torch.int64)
        self.t = torch.zeros(lanes, dtype=torch.int64)

    def _obs(self) -> torch.Tensor:
        return torch.stack([self.uid, self.episode, self.t], -1)

    def _reset(self, tensordict):
        lanes = self.batch_size[0]
        mask = torch.ones(lanes, dtype=torch.bool)
        if tensordict is not None and "_reset" in tensordict.keys():
            mask = tensordict["_reset"].reshape(lanes)
        self.episode = torch.where(mask, self.episode + 1, self.episode)
        self.t = torch.where(mask, 0, self.t)
        done = torch.zeros(lanes, 1, dtype=torch.bool)
        return TensorDict({"obs": self._obs(), "done": done, "terminated": done.clone()},
                          self.batch_size)

    def _step(self, tensordict):
        self.t = self.t + 1
        done = (self.t >= episode_length(self.uid, self.episode))[:, None]
        return TensorDict({"obs": self._obs(), "reward": self.t[:, None].float(),
                           "done": done, "terminated": done.clone()}, self.batch_size)

    def _set_seed(self, seed):
        return seed


def numbered(n: int, first: int) -> TensorDict:
    """n items whose "x" is first, first + 1, ... and "pid" the writer's pid."""
    return TensorDict({"x": torch.arange(first, first + n),
                       "pid": torch.full((n,), os.getpid(), dtype=torch.int64)}, [n])


def extend_in_child(rb, first: int, out) -> None:
    """A child's use of a buffer it got from its parent (pickled, or copied
    by a fork): it must not have connected before its first use; extend
    `numbered(10, first)`, report (connected before use, keys, write_count,
    len) on the queue `out`, close it."""
    try:
        lazy = "_pending_handle" in rb.__dict__
        keys = rb.extend(numbered(10, first))
        out.put((lazy, keys.tolist(), rb.write_count, len(rb)))
        rb.close()
    except BaseException as exc:  # the parent's assertion shows the child's error
        out.put(repr(exc))
        raise


def extend_from_queue(inbox, first: int, out) -> None:
    """extend_in_child with a buffer that comes through the queue `inbox`."""
    extend_in_child(inbox.get(timeout=60), first, out)
