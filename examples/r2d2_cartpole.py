"""R2D2-style recurrent DQN on CartPole-v1 without velocities, from slices.

The agent sees only the cart's position and the pole's angle (a POMDP: the
velocities must be inferred from what came before), so it needs memory: an
LSTM Q-network. An actor process plays with an epsilon-greedy copy of it and
appends every step once (`writer.append`, `done` at each episode's end) to
a table of slices of 80 steps starting every 40th step (R2D2's period), of
which short ones at an episode's end are padded (`slice_pad="end"`:
early episodes last ~20 steps). The learner (this process) samples
prioritized slices and, as R2D2 with a zero start state:

- burn-in: a slice that does not start its episode runs its first 40
  steps only to warm the LSTM's state, without a loss on them (one that
  starts its episode has the true zero state from its first step);
- n-step (5) double-DQN targets inside each slice, stopped at the
  episode's end (`batch.mask` says which rows are real, `is_last` where
  it ended) and at the slice's end;
- a slice's priority is 0.9 max |TD| + 0.1 mean |TD| over its steps, set
  through the slice's key (its start step's).

    pip install '.[examples]'
    python examples/r2d2_cartpole.py                 # about 10-20 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import sys
import time

import numpy as np
from dqn_cartpole import finish, follow_returns, report, require_extras, summarize, sync_nets

STEP = {
    "obs": ((2,), "float32"),       # position and angle only
    "prev_action": ((), "int64"),   # the action before it (R2D2 feeds it to the LSTM)
    "action": ((), "int64"),
    "reward": ((), "float32"),
    "terminated": ((), "float32"),  # the pole fell after this step (no bootstrap past it)
}
TABLE = "r2d2_steps"
SEEN = (0, 2)  # of CartPole's (x, x', theta, theta'): no velocities
GAMMA, N_STEP, ETA = 0.997, 5, 0.9


def make_net():
    """The recurrent Q-network: (observation, previous action one-hot) 4 ->
    64 -> LSTM(64) -> 2."""
    import torch

    class RecurrentQ(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU())
            self.lstm = torch.nn.LSTM(64, 64, batch_first=True)
            self.head = torch.nn.Linear(64, 2)

        def forward(self, obs, prev_action, state=None):
            """obs [B, T, 2], prev_action [B, T] -> (Q-values [B, T, 2], the
            LSTM's state after)."""
            x = torch.cat([obs, torch.nn.functional.one_hot(prev_action, 2).float()], -1)
            out, state = self.lstm(self.embed(x), state)
            return self.head(out), state

    return RecurrentQ()


def actor(address: str, seed: int, weights_q, returns_q, stop) -> None:
    """Plays episodes with the recurrent policy (its state reset at each
    episode's start) and appends every step to the table of slices."""
    import gymnasium as gym
    import torch

    import distore_ucx as ds

    torch.set_num_threads(1)
    net = make_net()
    rng = np.random.default_rng(seed)
    env = gym.make("CartPole-v1")
    steps, episode, max_priority = 0, 0, 1.0
    with ds.connect(address) as client:
        writer = client.writer(max_items=64, timeout=120)
        while not stop.is_set():
            full, _ = env.reset(seed=seed + episode)
            obs, state, total, done = full[list(SEEN)], None, 0.0, False
            prev = 0
            while not done and not stop.is_set():
                try:  # newest weights, and the priority to give new steps
                    while True:
                        weights, max_priority = weights_q.get_nowait()
                        net.load_state_dict(weights)
                except queue.Empty:
                    pass
                with torch.no_grad():  # the state follows every step, greedy or not
                    q, state = net(torch.as_tensor(obs).view(1, 1, 2),
                                   torch.tensor([[prev]]), state)
                eps = max(0.02, 1.0 - steps / 30_000)
                action = int(rng.integers(2)) if rng.random() < eps else int(q.argmax())
                full, reward, terminated, truncated, _ = env.step(action)
                writer.append(TABLE, {"obs": obs, "prev_action": prev, "action": action,
                                      "reward": reward, "terminated": float(terminated)},
                              done=terminated or truncated, priority=max_priority)
                obs, total, steps = full[list(SEEN)], total + reward, steps + 1
                prev = action
                done = terminated or truncated
            writer.flush()
            returns_q.put((episode, total, steps))
            episode += 1
        writer.close()


def losses(batch, net, target, burn_in: int):
    """Each slice's TD errors [B, T] over the steps that take a loss (zero
    elsewhere), and that mask: real steps (batch.mask), past the burn-in
    unless the slice starts its episode, with n steps ahead in the slice
    or the episode's end within it."""
    import torch

    d = batch.data
    obs = torch.as_tensor(d["obs"])
    prev = torch.as_tensor(d["prev_action"])
    act = torch.as_tensor(d["action"])
    rew = torch.as_tensor(d["reward"])
    term = torch.as_tensor(d["terminated"])
    real = torch.as_tensor(batch.mask)
    b, t = real.shape
    q_all, _ = net(obs, prev)
    with torch.no_grad():
        q_next_online = q_all.detach()
        q_next_target, _ = target(obs, prev)
    q = q_all.gather(2, act.unsqueeze(2)).squeeze(2)  # [B, T]
    # n-step returns: rewards of real steps until one terminated, then the
    # bootstrap from step t + n when it is real and nothing terminated.
    ret = torch.zeros(b, t)
    alive = torch.ones(b, t)
    for k in range(N_STEP):
        r_k = torch.zeros(b, t)
        r_k[:, :t - k] = rew[:, k:] * real[:, k:]
        ret += (GAMMA ** k) * alive * r_k
        term_k = torch.zeros(b, t)
        term_k[:, :t - k] = term[:, k:] * real[:, k:]
        alive = alive * (1 - term_k)
    boot = torch.zeros(b, t)
    ahead = torch.zeros(b, t, dtype=torch.bool)
    ahead[:, :t - N_STEP] = real[:, N_STEP:]
    best = q_next_online[:, N_STEP:].argmax(2, keepdim=True)
    boot[:, :t - N_STEP] = q_next_target[:, N_STEP:].gather(2, best).squeeze(2)
    y = ret + (GAMMA ** N_STEP) * alive * boot * ahead
    ends = torch.as_tensor(batch.is_last).any(1, keepdim=True)  # the episode ends here
    starts = torch.as_tensor(batch.positions[:, :1] == 0)
    steps = torch.arange(t).unsqueeze(0)
    take = real & (ahead | ends) & (starts | (steps >= burn_in))
    return (y - q) * take, take


def slice_loss(td, take, weights):
    """The batch's loss and each slice's priority, from `losses`' TD errors
    [B, T] and mask: the importance-weighted (`weights` [B]) mean over slices
    of each slice's smooth-L1 TD error averaged over the steps that take a
    loss, and R2D2's priority ETA max |TD| + (1 - ETA) mean |TD| (no grad)."""
    import torch

    counted = take.sum(1).clamp(min=1)
    per_slice = torch.nn.functional.smooth_l1_loss(
        td, torch.zeros_like(td), reduction="none").sum(1) / counted
    err = td.detach().abs()
    return (weights * per_slice).mean(), ETA * err.max(1).values + (1 - ETA) * err.sum(1) / counted


def train(args) -> dict:
    """Runs the actor and the learner; returns a summary dict."""
    require_extras()
    import torch

    import distore_ucx as ds

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    weights_q, returns_q, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    returns: list[float] = []
    t0 = time.monotonic()
    with ds.LocalCluster(nodes=1, arena_bytes=64 << 20, log_level="WARNING") as cluster:
        client = ds.connect(cluster.address)
        client.create_table(
            TABLE, capacity=100_000, spec=STEP, sampler=ds.Prioritized(0.9),
            slice_len=args.slice_len, slice_period=args.period, slice_pad="end",
            # samples count slices, inserts steps: a slice trains up to slice_len
            # steps, so each step is trained on about `replay` times
            rate_limiter=ds.SampleToInsertRatio(
                samples_per_insert=args.replay / args.slice_len,
                min_size_to_sample=2000, error_buffer=args.batch * 20))
        net, target = make_net(), make_net()
        target.load_state_dict(net.state_dict())
        weights_q.put((net.state_dict(), 1.0))
        proc = ctx.Process(target=actor, args=(cluster.address, args.seed, weights_q,
                                               returns_q, stop), daemon=True)
        proc.start()
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        learner = client.learner(TABLE, batch_size=args.batch, beta=0.6, timeout=120)
        max_priority, step, solved_at = 1.0, 0, None
        try:
            while time.monotonic() - t0 < args.minutes * 60:
                batch = learner.sample()  # slices: fields [batch, 80, ...], mask [batch, 80]
                td, take = losses(batch, net, target, args.burn_in)
                loss, prios = slice_loss(td, take, torch.as_tensor(batch.weights,
                                                                   dtype=torch.float32))
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
                opt.step()
                prios = prios.numpy().astype(np.float64) + 1e-3
                max_priority = max(max_priority, float(prios.max()))
                learner.update_priorities(batch.keys, prios)  # the slices' start steps
                step += 1
                sync_nets(step, net, target, weights_q, max_priority, 250, 25)
                solved_at = solved_at or follow_returns(returns_q, returns, t0, step,
                                                        args.target)
                if solved_at is not None:
                    break
        finally:
            finish(stop, learner, proc, client)
    return summarize(returns, step, solved_at, t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="R2D2-style recurrent DQN on CartPole-v1 "
                                "without velocities, from slices of episodes")
    p.add_argument("--minutes", type=float, default=20.0, help="time limit (default 20)")
    p.add_argument("--target", type=float, default=195.0, help="mean return over 100 episodes")
    p.add_argument("--batch", type=int, default=32, help="slices a batch")
    p.add_argument("--slice-len", type=int, default=80)
    p.add_argument("--period", type=int, default=40, help="a slice starts every PERIOD steps")
    p.add_argument("--burn-in", type=int, default=40)
    p.add_argument("--replay", type=float, default=16.0,
                   help="times each step is trained on, on average (the rate limiter's ratio)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        require_extras()
    except ImportError as exc:
        print(str(exc).replace("dqn_cartpole.py", "r2d2_cartpole.py"), file=sys.stderr)
        return 2
    return report(train(args), args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # ^C: the store's processes stopped with it
        print("interrupted", file=sys.stderr)
        sys.exit(130)
