"""DQN with prioritized replay on CartPole-v1, through a distore-ucx store.

An actor process plays CartPole with an epsilon-greedy copy of the Q-network
and inserts transitions; the learner (this process) samples prioritized
batches with importance weights, trains a Double-DQN, and sends new
priorities (|TD error|) back. A SampleToInsertRatio rate limiter keeps the
two in step, as in Reverb. It stops when the mean return of the last 100
episodes reaches --target (195) or after --minutes.

    pip install 'distore-ucx[examples]'
    python examples/dqn_cartpole.py            # solves in a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import sys
import time

import numpy as np

SPEC = {
    "obs": ((4,), "float32"),
    "action": ((), "int64"),
    "reward": ((), "float32"),
    "next_obs": ((4,), "float32"),
    "done": ((), "float32"),
}
TABLE = "cartpole"


EXTRAS = ("torch", "gymnasium")


def require_extras() -> None:
    """Raise ImportError saying what to install when torch or gymnasium is missing."""
    import importlib.util

    missing = [name for name in EXTRAS if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"examples/dqn_cartpole.py needs {' and '.join(missing)}, which are not "
            "installed: pip install 'distore-ucx[examples]' (from a source checkout: "
            "pip install '.[examples]')"
        )


def make_net():
    """The Q-network: 4 -> 128 -> 128 -> 2."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(4, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 2),
    )


def insert_transition(writer, obs, action, reward, nxt, terminated: bool, truncated: bool,
                      priority: float) -> None:
    """How the DQN actor stores a step: one transition, as an item."""
    writer.insert(TABLE, {"obs": obs, "action": action, "reward": reward, "next_obs": nxt,
                          "done": float(terminated)}, priority=priority)


def actor(address: str, seed: int, weights_q, returns_q, stop, store=insert_transition) -> None:
    """Plays episodes and stores every step with `store` (runs in its own
    process; `store` must be a module-level function, to be sent to it)."""
    import gymnasium as gym
    import torch

    torch.set_num_threads(1)
    net = make_net()
    rng = np.random.default_rng(seed)
    env = gym.make("CartPole-v1")
    try:
        _play(address, net, rng, env, weights_q, returns_q, stop, store, seed)
    except KeyboardInterrupt:
        # ^C reaches every process of the terminal's group: the learner's
        # process says "interrupted" once; a traceback from here would not help.
        pass


def _play(address: str, net, rng, env, weights_q, returns_q, stop, store, seed: int) -> None:
    """The actor's loop: episodes until `stop` is set."""
    import torch

    import distore_ucx as ds

    steps, episode, max_priority = 0, 0, 1.0
    with ds.connect(address) as client:
        writer = client.writer(max_items=32, timeout=120)
        while not stop.is_set():
            obs, _ = env.reset(seed=seed + episode)
            total, done = 0.0, False
            while not done and not stop.is_set():
                try:  # newest weights and the priority to give new items
                    while True:
                        state, max_priority = weights_q.get_nowait()
                        net.load_state_dict(state)
                except queue.Empty:
                    pass
                eps = max(0.02, 1.0 - steps / 10_000)
                if rng.random() < eps:
                    action = int(rng.integers(2))
                else:
                    with torch.no_grad():
                        action = int(net(torch.as_tensor(obs)).argmax())
                nxt, reward, terminated, truncated, _ = env.step(action)
                store(writer, obs, action, reward, nxt, terminated, truncated, max_priority)
                obs, total, steps = nxt, total + reward, steps + 1
                done = terminated or truncated
            writer.flush()
            returns_q.put((episode, total, steps))
            episode += 1
        writer.close()


def let_actor_finish(learner, proc, errors, seconds: float = 30.0) -> None:
    """Sample (and drop) batches until the actor process has exited, at most
    `seconds`, then kill it. The table's SampleToInsertRatio holds the
    actor's last inserts until the learner samples again: without this,
    the actor waited in `writer.flush()` until it was killed 30 s later."""
    deadline = time.monotonic() + seconds
    while proc.is_alive() and time.monotonic() < deadline:
        try:
            learner.sample(timeout=0.5)
        except errors:  # nothing to sample just now, or the store is gone
            pass
        proc.join(0.01)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def sync_nets(step: int, net, target, weights_q, max_priority: float, target_every: int,
              send_every: int) -> None:
    """After training step `step`: copy the online net into the target net
    every `target_every` steps, and send the actor the weights (and the
    priority for new items) every `send_every` steps."""
    if step % target_every == 0:
        target.load_state_dict(net.state_dict())
    if step % send_every == 0:
        weights_q.put(({k: v.clone() for k, v in net.state_dict().items()}, max_priority))


def finish(stop, learner, proc, client) -> None:
    """Stop the actor (see let_actor_finish), then close the learner and client."""
    import distore_ucx as ds

    stop.set()
    let_actor_finish(learner, proc, ds.DistoreError)
    learner.close()
    client.close()


def follow_returns(returns_q, returns: list, t0: float, step: int,
                   target: float) -> float | None:
    """Take the episodes the actor finished from `returns_q` into `returns`
    (printing every tenth); the seconds since `t0` at which the mean of the
    last 100 reached `target`, or None."""
    solved_at = None
    while not returns_q.empty():
        episode, ret, env_steps = returns_q.get()
        returns.append(ret)
        mean100 = float(np.mean(returns[-100:]))
        if episode % 10 == 0:
            print(f"[{time.monotonic() - t0:6.1f}s] episode {episode:4d} return "
                  f"{ret:5.0f} mean(100) {mean100:6.1f} env steps {env_steps} "
                  f"train steps {step}", flush=True)
        if len(returns) >= 100 and mean100 >= target and solved_at is None:
            solved_at = time.monotonic() - t0
    return solved_at


def summarize(returns: list, step: int, solved_at: float | None, t0: float) -> dict:
    """A run's summary: episodes, training steps, returns and when it solved."""
    return {
        "episodes": len(returns),
        "train_steps": step,
        "first20": float(np.mean(returns[:20])) if returns else 0.0,
        "last20": float(np.mean(returns[-20:])) if returns else 0.0,
        "mean100": float(np.mean(returns[-100:])) if returns else 0.0,
        "solved_seconds": solved_at,
        "seconds": time.monotonic() - t0,
        "returns": returns,
    }


def report(summary: dict, args) -> int:
    """Print a run's last line; exit code 0 if it solved."""
    solved = summary["solved_seconds"] is not None
    print(f"\n{summary['episodes']} episodes, {summary['train_steps']} training steps in "
          f"{summary['seconds']:.0f} s; mean return of the last 100: {summary['mean100']:.1f}"
          + (f"; solved (>= {args.target}) after {summary['solved_seconds']:.0f} s" if solved
             else f"; not solved within {args.minutes} min"))
    return 0 if solved else 1


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
            TABLE, capacity=50_000, spec=SPEC, sampler=ds.Prioritized(0.6), remover=ds.Fifo(),
            rate_limiter=ds.SampleToInsertRatio(samples_per_insert=args.batch / 2,
                                                min_size_to_sample=1000,
                                                error_buffer=args.batch * 500),
        )
        net, target = make_net(), make_net()
        target.load_state_dict(net.state_dict())
        weights_q.put((net.state_dict(), 1.0))
        proc = ctx.Process(target=actor, args=(cluster.address, args.seed, weights_q,
                                               returns_q, stop), daemon=True)
        proc.start()
        opt = torch.optim.Adam(net.parameters(), lr=5e-4)
        learner = client.learner(TABLE, batch_size=args.batch, beta=0.4, timeout=120)
        max_priority, step, solved_at = 1.0, 0, None
        try:
            max_steps = getattr(args, "max_steps", 0) or float("inf")
            while time.monotonic() - t0 < args.minutes * 60 and step < max_steps:
                batch = learner.sample()
                d = batch.data
                obs = torch.as_tensor(d["obs"])
                act = torch.as_tensor(d["action"])
                rew = torch.as_tensor(d["reward"])
                nxt = torch.as_tensor(d["next_obs"])
                done = torch.as_tensor(d["done"])
                with torch.no_grad():  # Double DQN target
                    best = net(nxt).argmax(1, keepdim=True)
                    y = rew + 0.99 * (1 - done) * target(nxt).gather(1, best).squeeze(1)
                q = net(obs).gather(1, act.unsqueeze(1)).squeeze(1)
                td = y - q
                w = torch.as_tensor(batch.weights, dtype=torch.float32)
                loss = (w * torch.nn.functional.smooth_l1_loss(q, y, reduction="none")).mean()
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 10.0)
                opt.step()
                prios = td.detach().abs().numpy().astype(np.float64) + 1e-3
                max_priority = max(max_priority, float(prios.max()))
                learner.update_priorities(batch.keys, prios)
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
    p = argparse.ArgumentParser(description="DQN on CartPole-v1 with distore-ucx replay")
    p.add_argument("--minutes", type=float, default=10.0, help="time limit (default 10)")
    p.add_argument("--target", type=float, default=195.0, help="mean return over 100 episodes")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many training "
                   "steps (0: no limit)")
    args = p.parse_args(argv)
    try:
        require_extras()
    except ImportError as exc:
        print(exc, file=sys.stderr)
        return 2
    return report(train(args), args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # ^C: the store's processes stopped with it
        print("interrupted", file=sys.stderr)
        sys.exit(130)
