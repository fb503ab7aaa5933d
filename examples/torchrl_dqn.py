"""DQN on CartPole-v1 with TorchRL's components and a distore replay buffer.

TorchRL does the RL: a `Collector` (`SyncDataCollector` before TorchRL 0.14)
plays CartPole in 4 environments at once (a `ParallelEnv`, one process each)
with an epsilon-greedy `QValueActor`, `DQNLoss` (double DQN, smooth L1) trains it
and `HardUpdate` refreshes the target network. The replay buffer is
`distore_ucx.torchrl.DistorePrioritizedReplayBuffer`: the collected
[n_envs, T] TensorDicts go into a prioritized distore table, one item a
transition (`ndim=2`, as with TorchRL's `LazyTensorStorage(..., ndim=2)`),
on a LocalCluster (a control plane and a storage node, each its own process), samples come back
as TensorDicts with `index` and `priority_weight`, which DQNLoss reads, and
`update_tensordict_priority` sends the loss's `td_error` back. Nothing in
the TorchRL loop knows that the buffer is remote.

    pip install 'distore-ucx[examples]'
    python examples/torchrl_dqn.py              # learns: see docs/performance.md
    python examples/torchrl_dqn.py --frames 3000 --target 0   # a short smoke run

It stops when the mean return of the last 100 episodes reaches --target
(195), after --frames environment steps or after --minutes.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import time

EXTRAS = ("torch", "gymnasium", "torchrl", "tensordict")
TABLE = "cartpole"


def require_extras(example: str = "torchrl_dqn.py") -> None:
    """Raise ImportError saying what `example` needs installed when an extra
    is missing."""
    missing = [name for name in EXTRAS if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"examples/{example} needs {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: pip install "
            "'distore-ucx[examples]' (from a source checkout: pip install '.[examples]')"
        )


def train(args) -> dict:
    """Collects, trains and reports; returns a summary dict."""
    require_extras()
    import numpy as np
    import torch
    from tensordict.nn import TensorDictSequential
    from torchrl.collectors import Collector  # SyncDataCollector before 0.14
    from torchrl.envs import (
        Compose,
        GymEnv,
        ParallelEnv,
        RewardSum,
        StepCounter,
        TransformedEnv,
    )
    from torchrl.modules import MLP, EGreedyModule, QValueActor
    from torchrl.objectives import DQNLoss, HardUpdate

    import distore_ucx as ds
    from distore_ucx.torchrl import DistorePrioritizedReplayBuffer

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    # One process an environment; functools.partial, not a lambda: it pickles.
    env = TransformedEnv(ParallelEnv(args.envs, functools.partial(GymEnv, "CartPole-v1")),
                         Compose(StepCounter(), RewardSum()))
    env.set_seed(args.seed)
    action_spec = env.action_spec_unbatched  # one env's: what the actor and loss act in
    actor = QValueActor(MLP(in_features=4, out_features=2, num_cells=[128, 128]),
                        in_keys=["observation"], spec=action_spec)
    explore = EGreedyModule(env.action_spec, eps_init=1.0, eps_end=0.02,
                            annealing_num_steps=args.explore_frames)
    policy = TensorDictSequential(actor, explore)
    collector = Collector(env, policy, frames_per_batch=args.frames_per_batch,
                                  total_frames=-1, init_random_frames=args.init_frames,
                                  auto_register_policy_transforms=False)  # it needs none
    loss_module = DQNLoss(actor, action_space=action_spec, delay_value=True,
                          double_dqn=True, loss_function="smooth_l1")
    loss_module.make_value_estimator(gamma=0.99)
    target_updater = HardUpdate(loss_module, value_network_update_interval=args.target_every)
    optim = torch.optim.Adam(loss_module.parameters(), lr=args.lr)

    returns: list[float] = []
    steps, frames, solved_at = 0, 0, None
    t0 = time.monotonic()
    # One machine, busy with training: a node late with its heartbeat is slow,
    # not dead (the 2 s default would drop it, and its items, on a loaded box).
    with ds.LocalCluster(nodes=1, arena_bytes=64 << 20, log_level="WARNING",
                         heartbeat_timeout=30.0) as cluster, \
            DistorePrioritizedReplayBuffer(
                # DQNLoss's td_error is the squared TD error: alpha 0.3 on it
                # prioritizes as alpha 0.6 on |TD error| (dqn_cartpole.py).
                cluster.address, TABLE, alpha=args.alpha, beta=0.4, capacity=50_000,
                batch_size=args.batch, remover=ds.Fifo(),
                ndim=2) as rb:  # [n_envs, T] batches: n_envs * T transitions
        try:
            for data in collector:
                rb.extend(data)  # one batched insert of the [n_envs, T] transitions
                frames += data.numel()
                done = data["next", "done"].squeeze(-1)
                returns += data["next", "episode_reward"][done].squeeze(-1).tolist()
                if frames >= args.init_frames:
                    for _ in range(args.updates_per_batch):
                        sample = rb.sample()  # TensorDict: index, priority_weight, ...
                        loss = loss_module(sample)["loss"]  # writes sample["td_error"]
                        optim.zero_grad()
                        loss.backward()
                        torch.nn.utils.clip_grad_norm_(loss_module.parameters(), 10.0)
                        optim.step()
                        rb.update_tensordict_priority(sample)  # not waited for
                        target_updater.step()
                        steps += 1
                    rb.beta = min(1.0, 0.4 + 0.6 * frames / max(args.frames, 1))
                explore.step(data.numel())
                collector.update_policy_weights_()
                mean100 = float(np.mean(returns[-100:])) if returns else 0.0
                if done.any() and len(returns) % 10 == 0:
                    print(f"[{time.monotonic() - t0:6.1f}s] episodes {len(returns):4d} "
                          f"mean(100) {mean100:6.1f} frames {frames} train steps {steps} "
                          f"table size {len(rb)}", flush=True)
                if len(returns) >= 100 and mean100 >= args.target > 0 and solved_at is None:
                    solved_at = time.monotonic() - t0
                    break
                if frames >= args.frames or time.monotonic() - t0 > args.minutes * 60:
                    break
            missing = rb.flush_priorities()["missing"]  # every update applied first
            table = rb._client.table_info(TABLE)
        finally:
            collector.shutdown()
            if not env.is_closed:
                env.close()
    return {
        "episodes": len(returns),
        "frames": frames,
        "train_steps": steps,
        "first20": float(np.mean(returns[:20])) if returns else 0.0,
        "last20": float(np.mean(returns[-20:])) if returns else 0.0,
        "mean100": float(np.mean(returns[-100:])) if returns else 0.0,
        "solved_seconds": solved_at,
        "seconds": time.monotonic() - t0,
        "returns": returns,
        "table_inserts": table["inserts"],
        "table_samples": table["samples"],
        "priority_updates_missing": missing,
    }


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The options every TorchRL example takes, with this one's defaults
    (another example changes them with `p.set_defaults`)."""
    p.add_argument("--frames", type=int, default=80_000, help="environment steps at most")
    p.add_argument("--minutes", type=float, default=30.0, help="time limit (default 30)")
    p.add_argument("--target", type=float, default=195.0,
                   help="stop when the mean return of 100 episodes reaches it (0: never)")
    p.add_argument("--frames-per-batch", type=int, default=16,
                   help="collector batch, over all environments (a multiple of their number)")
    p.add_argument("--updates-per-batch", type=int, default=8,
                   help="gradient steps per collected batch")
    p.add_argument("--explore-frames", type=int, default=10_000,
                   help="frames over which epsilon anneals from 1 to 0.02")
    p.add_argument("--target-every", type=int, default=500,
                   help="gradient steps between target-network copies")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)


def parse_args(argv=None) -> argparse.Namespace:
    """The example's options (its defaults solve CartPole)."""
    p = argparse.ArgumentParser(description="TorchRL DQN on CartPole-v1 with a distore "
                                            "replay buffer")
    add_common_args(p)
    p.add_argument("--batch", type=int, default=64, help="sample size")
    p.add_argument("--envs", type=int, default=4,
                   help="environments the collector steps at once (a ParallelEnv)")
    p.add_argument("--init-frames", type=int, default=1024,
                   help="random frames first (a multiple of --frames-per-batch)")
    p.add_argument("--alpha", type=float, default=0.3,
                   help="priority exponent on DQNLoss's td_error (a squared error)")
    return p.parse_args(argv)


def report(s: dict, args) -> int:
    """Print a run's summary (`train`'s dict); the exit code: 0 when it
    solved, or when it had no target (--target 0)."""
    solved = s["solved_seconds"] is not None
    print(f"\n{s['episodes']} episodes, {s['frames']} frames, {s['train_steps']} training steps "
          f"in {s['seconds']:.0f} s; mean return of the first 20 episodes {s['first20']:.1f}, "
          f"of the last 100 {s['mean100']:.1f}; the table took {s['table_inserts']} inserts and "
          f"{s['table_samples']} samples"
          + (f"; solved (>= {args.target}) after {s['solved_seconds']:.0f} s" if solved else ""))
    return 0 if solved or args.target <= 0 else 1


def run(example: str, parse_args, train, argv=None) -> int:
    """A TorchRL example as a program: its options, what to install when an
    extra is missing (exit code 2), the run and its summary (`report`'s
    exit code), or 130 after ^C (the store's processes stop with it)."""
    args = parse_args(argv)
    try:
        require_extras(example)
    except ImportError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        return report(train(args), args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv=None) -> int:
    return run("torchrl_dqn.py", parse_args, train, argv)


if __name__ == "__main__":
    sys.exit(main())
