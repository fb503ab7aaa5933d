"""n-step DQN on CartPole-v1 from slices of episodes: each step stored once.

The actor appends steps (`writer.append`, one env, `done` on each episode's
last step) to a table of slices of n steps; the learner samples
prioritized slices and computes each slice's n-step return from its own
steps (rewards, stopped where a step's `terminated` says the episode
ended), bootstrapping from the Q-value of the last step's next
observation. No n-step transition is cut or copied in the actor: the start
of each slice is chosen when sampling. Priorities (|n-step TD error|) go
back through the slices' keys, their start steps'.

Each step keeps its next observation (16 bytes here): slices are strict
(they never run past an episode's end), so the terminal step must lie
inside a slice for its return to be learned, which a slice of n steps
ending with it does. An episode's last n - 1 steps start no slice.

    pip install 'distore-ucx[examples]'
    python examples/nstep_dqn_cartpole.py --n 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import numpy as np
from dqn_cartpole import (
    actor,
    finish,
    follow_returns,
    make_net,
    report,
    require_extras,
    summarize,
    sync_nets,
)

STEP = {
    "obs": ((4,), "float32"),
    "action": ((), "int64"),
    "reward": ((), "float32"),
    "terminated": ((), "float32"),  # the episode ended after this step's action (no bootstrap)
    "next_obs": ((4,), "float32"),
}
TABLE = "cartpole_steps"
GAMMA = 0.99


def append_step(writer, obs, action, reward, nxt, terminated: bool, truncated: bool,
                priority: float) -> None:
    """How this actor stores a step: appended once to its episode (the env's
    only one; `done` ends it)."""
    writer.append(TABLE, {"obs": obs, "action": action, "reward": reward,
                          "terminated": float(terminated), "next_obs": nxt},
                  done=terminated or truncated, priority=priority)


def nstep_targets(batch, target_net, online_net, n: int):
    """Each slice's n-step Double-DQN target from its n steps: their rewards
    discounted, stopped at a terminal step, plus the bootstrap from the last
    step's next observation when none terminated. (Strict slices never
    cross an episode's end: the n steps are of one episode.)"""
    import torch

    d = batch.data
    rew = torch.as_tensor(d["reward"][:, :n])
    term = torch.as_tensor(d["terminated"][:, :n])
    alive = torch.cumprod(1 - term, dim=1)  # 1 while no step so far terminated
    before = torch.cat([torch.ones_like(alive[:, :1]), alive[:, :-1]], dim=1)
    discount = GAMMA ** torch.arange(n, dtype=torch.float32)
    ret = (rew * before * discount).sum(1)
    last_obs = torch.as_tensor(d["next_obs"][:, n - 1])
    with torch.no_grad():
        best = online_net(last_obs).argmax(1, keepdim=True)
        boot = target_net(last_obs).gather(1, best).squeeze(1)
    return ret + (GAMMA ** n) * alive[:, -1] * boot


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
            TABLE, capacity=50_000, spec=STEP, sampler=ds.Prioritized(0.6),
            slice_len=args.n,
            # samples count slices, inserts count steps
            rate_limiter=ds.SampleToInsertRatio(samples_per_insert=args.batch / 2,
                                                min_size_to_sample=1000,
                                                error_buffer=args.batch * 500),
        )
        net, target = make_net(), make_net()
        target.load_state_dict(net.state_dict())
        weights_q.put((net.state_dict(), 1.0))
        proc = ctx.Process(target=actor, args=(cluster.address, args.seed, weights_q,
                                               returns_q, stop, append_step), daemon=True)
        proc.start()
        opt = torch.optim.Adam(net.parameters(), lr=5e-4)
        learner = client.learner(TABLE, batch_size=args.batch, beta=0.4, timeout=120)
        max_priority, step, solved_at = 1.0, 0, None
        try:
            max_steps = getattr(args, "max_steps", 0) or float("inf")
            while time.monotonic() - t0 < args.minutes * 60 and step < max_steps:
                batch = learner.sample()  # slices: fields [batch, n, ...]
                obs = torch.as_tensor(batch.data["obs"][:, 0])
                act = torch.as_tensor(batch.data["action"][:, 0])
                y = nstep_targets(batch, target, net, args.n)
                q = net(obs).gather(1, act.unsqueeze(1)).squeeze(1)
                w = torch.as_tensor(batch.weights, dtype=torch.float32)
                loss = (w * torch.nn.functional.smooth_l1_loss(q, y, reduction="none")).mean()
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
                opt.step()
                prios = (y - q).detach().abs().numpy().astype(np.float64) + 1e-3
                max_priority = max(max_priority, float(prios.max()))
                learner.update_priorities(batch.keys, prios)  # the slices' start steps
                learner.beta = min(1.0, 0.4 + step / 20_000)
                step += 1
                sync_nets(step, net, target, weights_q, max_priority, 500, 100)
                solved_at = solved_at or follow_returns(returns_q, returns, t0, step,
                                                        args.target)
                if solved_at is not None:
                    break
        finally:
            finish(stop, learner, proc, client)
    return summarize(returns, step, solved_at, t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="n-step DQN on CartPole-v1 from slices")
    p.add_argument("--n", type=int, default=3, help="steps of the return (slices of n)")
    p.add_argument("--minutes", type=float, default=10.0, help="time limit (default 10)")
    p.add_argument("--target", type=float, default=195.0, help="mean return over 100 episodes")
    p.add_argument("--batch", type=int, default=64, help="slices a batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many training "
                   "steps (0: no limit)")
    args = p.parse_args(argv)
    try:
        require_extras()
    except ImportError as exc:
        print(str(exc).replace("dqn_cartpole.py", "nstep_dqn_cartpole.py"), file=sys.stderr)
        return 2
    return report(train(args), args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # ^C: the store's processes stopped with it
        print("interrupted", file=sys.stderr)
        sys.exit(130)
