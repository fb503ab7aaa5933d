"""R2D2-style recurrent DQN on CartPole-v1 without velocities, with TorchRL's
components: a multi-process collector writes into a distore buffer of slices.

The agent sees the cart's position and the pole's angle only (a POMDP), as in
examples/r2d2_cartpole.py, whose network and loss this example imports; what
changes is everything around them, which is TorchRL's:

- each collector worker steps 8 CartPole-v1 games as one batch (gymnasium's
  `SyncVectorEnv` in a `GymWrapper`: TorchRL's per-step cost, a few ms on
  2 cores, is paid once for all of them), with TorchRL transforms: `UnaryTransform` drops
  the velocities, `PreviousAction` (below) adds the action before each step
  (R2D2 feeds it to the LSTM; the R2D2 example learned nothing without it),
  `StepCounter`, `RewardSum` and `InitTracker`;
- the policy is `LSTMModule` (wrapping the Q-network's own `nn.LSTM`, so the
  learner trains the same weights), `QValueModule` and `EGreedyModule`; the
  collector adds the LSTM's state primer to each worker's env;
- `MultiSyncCollector(..., replay_buffer=rb)`: each worker extends the buffer
  itself (it pickles to a handle that connects in the worker), every frame
  once, each trajectory kept whole by the collector's traj ids;
- the buffer is a `DistoreReplayBuffer` with TorchRL's
  `PrioritizedSliceSampler` arguments (distore's stand-in: TorchRL's own needs
  compiled segment trees the CPU torch lacks): a table of slices of
  `--slice-len` steps of one episode, any step a start, short ones at an
  episode's end padded (`("collector", "mask")`);
- the learner reshapes each sample to [slices, steps] and takes the R2D2 loss
  of examples/r2d2_cartpole.py: zero start state, burn-in, 5-step double-DQN
  targets stopped at the episode's end; each slice's priority (0.9 max + 0.1
  mean |TD|) goes back through `update_tensordict_priority`, as `td_error` on
  the slice's steps (TorchRL's slice samplers leave that aggregation to the
  user). New steps get the largest priority set so far, as R2D2's: the
  learner sends it to the workers with the policy's weights.

The episodes' returns come back to this process through a second, small
distore buffer (the collector's `postproc`, which runs in each worker, extends
it): with a replay buffer, TorchRL's multi-process collectors yield nothing.

    pip install '.[examples]'
    python examples/torchrl_r2d2_cartpole.py       # solved in 2-3 minutes on 2 cores
    python examples/torchrl_r2d2_cartpole.py --frames 2000 --target 0   # a short smoke run

It stops when the mean return of the last 100 episodes reaches --target
(195), after --frames environment steps or after --minutes.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import types

import numpy as np
from r2d2_cartpole import SEEN, losses, make_net, slice_loss
from torchrl_dqn import add_common_args, require_extras, run

TABLE, EPISODES = "r2d2_slices", "episodes"
# Added to each priority (the R2D2 example's 1e-3): a slice with no step that
# takes a loss has priority 0, and TorchRL's weights (p / p_min)^-beta would
# then shrink every other slice's to nothing.
PRIORITY_EPS = 1e-3
# Never stored: the LSTM's state (the learner starts each slice from zeros),
# the actor's Q-values, and the new steps' priority (used, not stored).
NOT_STORED = ("recurrent_state_h", "recurrent_state_c", ("next", "recurrent_state_h"),
              ("next", "recurrent_state_c"), "action_value", "chosen_action_value", "td_error")


try:  # the classes below need them; without, main() says what to install
    import torch
    from torchrl.data import Categorical
    from torchrl.envs import Transform
except ImportError:
    torch = None
else:  # module-level classes: the policy and envs pickle into the workers

    class PreviousAction(Transform):
        """Adds "prev_action" to the observation: the index of the action taken
        before this step, 0 at an episode's first step (as the R2D2 example's
        actor feeds its LSTM)."""

        def __init__(self, n_actions: int = 2):
            super().__init__(in_keys=[], out_keys=["prev_action"])
            self.n_actions = n_actions

        def _reset(self, tensordict, tensordict_reset):
            tensordict_reset.set("prev_action", torch.zeros(tensordict_reset.batch_size,
                                                            dtype=torch.int64))
            return tensordict_reset

        def _step(self, tensordict, next_tensordict):
            next_tensordict.set("prev_action", tensordict.get("action").argmax(-1))
            return next_tensordict

        def transform_observation_spec(self, observation_spec):
            observation_spec["prev_action"] = Categorical(
                self.n_actions, shape=observation_spec.shape, dtype=torch.int64,
                device=observation_spec.device)
            return observation_spec

    class Features(torch.nn.Module):
        """The Q-network's input layer on one step: (observation, previous
        action), as RecurrentQ.forward (examples/r2d2_cartpole.py) feeds it."""

        def __init__(self, embed):
            super().__init__()
            self.embed = embed

        def forward(self, obs, prev_action):
            onehot = torch.nn.functional.one_hot(prev_action, 2).to(obs.dtype)
            return self.embed(torch.cat([obs, onehot], -1))

    class NewPriority(torch.nn.Module):
        """The priority of the steps the actors take: the learner's largest so
        far, held in a buffer that travels to the workers with the weights."""

        def __init__(self):
            super().__init__()
            self.register_buffer("value", torch.ones(()))

        def forward(self, chosen):
            return self.value.expand(chosen.shape)


def seen(obs):
    """CartPole's observation without the velocities (a UnaryTransform's fn:
    module-level, so that it pickles into the collector's workers)."""
    return obs[..., list(SEEN)]


def make_env(lanes: int = 8):
    """One worker's environment: `lanes` CartPole-v1 games stepped as one
    batch (gymnasium's SyncVectorEnv in the worker's process: TorchRL's
    per-step cost is paid once for all of them), without velocities, with
    the previous action, step count, return and episode starts. Lanes reset
    one by one when their episode ends (TorchRL's partial resets)."""
    import gymnasium as gym
    from torchrl.envs import (
        Compose,
        GymWrapper,
        InitTracker,
        RewardSum,
        StepCounter,
        TransformedEnv,
        UnaryTransform,
    )

    games = gym.make_vec("CartPole-v1", num_envs=lanes, vectorization_mode="sync",
                         vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.DISABLED})
    return TransformedEnv(GymWrapper(games), Compose(
        UnaryTransform(in_keys=["observation"], out_keys=["observation"], fn=seen),
        PreviousAction(), StepCounter(), RewardSum(), InitTracker()))


def make_policy(net, action_spec, explore_frames: int):
    """The collectors' policy around the learner's Q-network `net` (its
    modules, shared, not copied), acting in `action_spec` (one lane's):
    (features, LSTMModule, head, QValueModule), then EGreedyModule, then the
    priority new steps get. Returns (policy, explore, new_priority)."""
    from tensordict.nn import TensorDictModule, TensorDictSequential
    from torchrl.modules import EGreedyModule, LSTMModule, QValueModule

    explore = EGreedyModule(action_spec, eps_init=1.0, eps_end=0.02,
                            annealing_num_steps=explore_frames)
    new_priority = NewPriority()
    policy = TensorDictSequential(
        TensorDictModule(Features(net.embed), in_keys=["observation", "prev_action"],
                         out_keys=["embed"]),
        LSTMModule(lstm=net.lstm, in_key="embed", out_key="features"),
        TensorDictModule(net.head, in_keys=["features"], out_keys=["action_value"]),
        QValueModule(spec=action_spec),
        explore,
        TensorDictModule(new_priority, in_keys=["chosen_action_value"], out_keys=["td_error"]),
    )
    return policy, explore, new_priority


class EpisodeLog:
    """The collector's postproc: it runs in each worker on each batch before
    the worker extends the replay buffer, and puts the returns of the
    episodes that ended in it into `episodes` (a distore buffer: it
    pickles to a handle that connects in the worker). Returns the batch."""

    def __init__(self, episodes):
        self.episodes = episodes

    def __call__(self, td):
        from tensordict import TensorDict

        done = td.get(("next", "done")).reshape(-1)
        if done.any():
            ended = td.reshape(-1)[done].get("next")
            self.episodes.extend(TensorDict(
                {"return": ended.get("episode_reward").reshape(-1)},
                batch_size=[int(done.sum())]))
        return td


def as_slices(td, num_slices: int):
    """A flat sample of slices (TorchRL's layout) as examples/r2d2_cartpole.py's
    `losses` reads a batch of slices: fields [slices, steps], `mask` (real
    steps), `positions` (the step in its episode), `is_last` (where the
    episode ended) and `weights` (each slice's importance weight)."""
    s = td.reshape(num_slices, -1)
    mask = s.get(("collector", "mask"))
    data = {"obs": s.get("observation"), "prev_action": s.get("prev_action"),
            "action": s.get("action").argmax(-1),
            "reward": s.get(("next", "reward")).squeeze(-1),
            "terminated": s.get(("next", "terminated")).squeeze(-1).float()}
    return types.SimpleNamespace(
        data=data, mask=mask, positions=s.get("step_count").squeeze(-1),
        is_last=s.get(("next", "done")).squeeze(-1) & mask,
        weights=s.get("priority_weight")[:, 0])


def drain(episodes, returns: list) -> None:
    """Move the finished episodes' returns from the episodes buffer (a FIFO:
    each item leaves at its sample) into `returns`."""
    for _ in range(len(episodes)):
        returns.append(float(episodes.sample(1)["return"]))


def update(rb, net, target, optim, args) -> float:
    """One gradient step of the R2D2 loss on a sample of `args.batch` slices;
    writes each slice's priority back, as `td_error` on each of its real
    steps. Returns the largest priority it set."""
    sample = rb.sample()  # flat: batch * slice_len steps, slice by slice
    batch = as_slices(sample, args.batch)
    td_error, take = losses(batch, net, target, args.burn_in)
    loss, priority = slice_loss(td_error, take, batch.weights)
    optim.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
    optim.step()
    sample.set("td_error", priority.repeat_interleave(args.slice_len))
    real = sample[sample.get(("collector", "mask"))]  # not the padding
    rb.update_tensordict_priority(real)  # not waited for: the next sample follows it
    return float(priority.max())


def train(args) -> dict:
    """Collects, trains and reports; returns a summary dict."""
    require_extras("torchrl_r2d2_cartpole.py")
    from tensordict import TensorDict
    from torchrl.collectors import MultiSyncCollector

    import distore_ucx as ds
    from distore_ucx.torchrl import DistoreReplayBuffer, PrioritizedSliceSampler

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    probe = make_env(1)
    action_spec = probe.action_spec_unbatched  # one lane's
    probe.close()
    net, target = make_net(), make_net()
    target.load_state_dict(net.state_dict())
    policy, explore, new_priority = make_policy(net, action_spec, args.explore_frames)
    optim = torch.optim.Adam(net.parameters(), lr=args.lr)
    sampler = PrioritizedSliceSampler(
        slice_len=args.slice_len, alpha=0.9, beta=0.6, eps=PRIORITY_EPS,
        traj_key=("collector", "traj_ids"),
        strict_length=False, pad_output=True, span=(False, True),  # padded at the end
        truncated_key=None)  # keep the stored done: where an episode really ended
    returns: list[float] = []
    steps, solved_at, max_priority = 0, None, 1.0
    t0 = last_print = time.monotonic()
    # One machine, busy: a node late with its heartbeat is slow, not dead.
    with ds.LocalCluster(nodes=1, arena_bytes=128 << 20, log_level="WARNING",
                         heartbeat_timeout=30.0) as cluster, \
            DistoreReplayBuffer(cluster.address, TABLE, capacity=100_000, sampler=sampler,
                                batch_size=args.batch * args.slice_len,
                                eps=PRIORITY_EPS,  # the buffer adds its own (not the sampler's)
                                exclude_keys=NOT_STORED) as rb, \
            DistoreReplayBuffer(cluster.address, EPISODES, capacity=10_000,
                                sampler=ds.Fifo(), max_times_sampled=1,
                                spec=TensorDict({"return": torch.zeros(())},
                                                batch_size=[])) as episodes:
        rb.share()  # write_count: every worker's inserts (the collector would do it)
        batches = -(-args.frames // args.frames_per_batch)  # whole (TorchRL warns otherwise)
        collector = MultiSyncCollector(
            [functools.partial(make_env, args.lanes)] * args.workers, policy,
            frames_per_batch=args.frames_per_batch,
            total_frames=batches * args.frames_per_batch, replay_buffer=rb,
            postproc=EpisodeLog(episodes),
            auto_register_policy_transforms=True)  # the LSTM's state primer
        collector.set_seed(args.seed)
        try:
            for _ in collector:  # each worker extended rb with its frames
                frames = rb.write_count
                drain(episodes, returns)
                if frames >= args.init_frames:
                    for _ in range(args.updates_per_batch):
                        max_priority = max(max_priority, update(rb, net, target, optim, args))
                        steps += 1
                        if steps % args.target_every == 0:
                            target.load_state_dict(net.state_dict())
                new_priority.value.fill_(max_priority)
                explore.step(args.frames_per_batch)
                collector.update_policy_weights_()
                mean100 = float(np.mean(returns[-100:])) if returns else 0.0
                if time.monotonic() - last_print >= args.print_every:
                    last_print = time.monotonic()
                    print(f"[{last_print - t0:6.1f}s] episodes {len(returns):4d} mean(100) "
                          f"{mean100:6.1f} frames {frames} train steps {steps} "
                          f"eps {float(explore.eps):.2f}", flush=True)
                if len(returns) >= 100 and mean100 >= args.target > 0:
                    solved_at = time.monotonic() - t0
                    break
                if time.monotonic() - t0 > args.minutes * 60:
                    break
        finally:
            collector.shutdown()
        drain(episodes, returns)
        missing = rb.flush_priorities()["missing"]  # every update applied first
        table = rb._client.table_info(TABLE)
    return {
        "episodes": len(returns),
        "frames": int(table["inserts"]),  # every frame stored once
        "table_inserts": int(table["inserts"]),
        "train_steps": steps,
        "first20": float(np.mean(returns[:20])) if returns else 0.0,
        "mean100": float(np.mean(returns[-100:])) if returns else 0.0,
        "solved_seconds": solved_at,
        "seconds": time.monotonic() - t0,
        "returns": returns,
        "table_samples": int(table["samples"]),
        "priority_updates_missing": missing,
    }


def parse_args(argv=None) -> argparse.Namespace:
    """The example's options (its defaults solve masked CartPole)."""
    p = argparse.ArgumentParser(description="R2D2-style recurrent DQN with TorchRL's "
                                "components on CartPole-v1 without velocities, from a "
                                "distore buffer of slices")
    add_common_args(p)
    p.set_defaults(frames=1_000_000, frames_per_batch=128, updates_per_batch=4,
                   explore_frames=30_000, target_every=250, lr=1e-3)
    p.add_argument("--workers", type=int, default=2, help="collector processes")
    p.add_argument("--lanes", type=int, default=8, help="CartPole games each worker steps")
    p.add_argument("--batch", type=int, default=32, help="slices a sample")
    p.add_argument("--slice-len", type=int, default=20)
    p.add_argument("--burn-in", type=int, default=5)
    p.add_argument("--init-frames", type=int, default=2000,
                   help="frames in the buffer before training starts")
    p.add_argument("--print-every", type=float, default=10.0,
                   help="seconds between progress lines")
    return p.parse_args(argv)


def main(argv=None) -> int:
    return run("torchrl_r2d2_cartpole.py", parse_args, train, argv)


if __name__ == "__main__":
    sys.exit(main())
