"""The rollouts demo: environment, policy, learner, and the CLI end to end on Pool and Ray."""

from __future__ import annotations

import io
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtransport.rollouts import _backends as backends
from jaxtransport.rollouts._cli import build_parser
from jaxtransport.rollouts import _env as env
from jaxtransport.rollouts import _policy as policy
from jaxtransport.rollouts import _worker as worker
from jaxtransport import rollouts

from .conftest import ROOT

# Small enough that a run is dominated by process start-up, large enough to be the real loop.
TINY = ["--iterations", "2", "--envs", "4", "--steps", "16", "--frame-size", "24",
        "--param-mb", "1", "--hidden", "16", "--warmup", "0"]


def _cli(*args: str, timeout: float = 240, merged: bool = False) -> subprocess.CompletedProcess:
    """The demo in a fresh interpreter, stdout and stderr to pipes (``merged``: one pipe, as
    ``2>&1`` into a log does)."""
    environ = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", "jaxtransport.rollouts", *args],
        env=environ, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        text=True, timeout=timeout, cwd=ROOT,
    )


# ------------------------------------------------------------------------------------------
# environment


def _gym_step(s, action):
    """Gym's CartPole-v1 step (Euler), written out in numpy as the reference."""
    x, x_dot, theta, theta_dot = s
    force = 10.0 if action == 1 else -10.0
    cos, sin = math.cos(theta), math.sin(theta)
    temp = (force + 0.05 * theta_dot**2 * sin) / 1.1
    theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos**2 / 1.1))
    x_acc = temp - 0.05 * theta_acc * cos / 1.1
    return (x + 0.02 * x_dot, x_dot + 0.02 * x_acc, theta + 0.02 * theta_dot,
            theta_dot + 0.02 * theta_acc)


def test_physics_match_gym_cartpole():
    s = env.EnvState(*(jnp.float32(v) for v in (0.01, -0.02, 0.03, 0.04)), jnp.int32(0),
                     jnp.float32(0))
    ref = (0.01, -0.02, 0.03, 0.04)
    for t, action in enumerate([1, 1, 0, 1, 0, 0, 1]):
        s, reward, done, failed, finished = env.step(s, jnp.int32(action), jax.random.key(t))
        ref = _gym_step(ref, action)
        np.testing.assert_allclose([s.x, s.x_dot, s.theta, s.theta_dot], ref, rtol=1e-5,
                                   atol=1e-6)
        assert float(reward) == 1.0 and not bool(done) and not bool(failed)
        assert float(finished) == 0.0
        assert int(s.steps) == t + 1 and float(s.ep_return) == t + 1


def test_episode_ends_and_resets():
    s = env.EnvState(jnp.float32(0.0), jnp.float32(0.0), jnp.float32(0.2), jnp.float32(2.0),
                     jnp.int32(41), jnp.float32(41.0))
    s, _, done, failed, finished = env.step(s, jnp.int32(0), jax.random.key(0))
    assert bool(done) and bool(failed) and float(finished) == 42.0
    assert int(s.steps) == 0 and float(s.ep_return) == 0.0
    assert all(abs(float(v)) <= 0.05 for v in (s.x, s.x_dot, s.theta, s.theta_dot))
    # Truncation at MAX_STEPS counts as an episode end too.
    s = s._replace(steps=jnp.int32(env.MAX_STEPS - 1), ep_return=jnp.float32(env.MAX_STEPS - 1))
    _, _, done, failed, finished = env.step(s, jnp.int32(1), jax.random.key(1))
    assert bool(done) and not bool(failed) and float(finished) == env.MAX_STEPS


@pytest.mark.parametrize("frame_size", [32, 84])
def test_render_and_read_back(frame_size):
    """Frames carry the state: the policy's pixel encoder recovers x and theta from them."""
    n = 64
    k1, k2 = jax.random.split(jax.random.key(0))
    s = env.reset_batch(jax.random.key(1), n)._replace(
        x=jax.random.uniform(k1, (n,), minval=-2.3, maxval=2.3),
        theta=jax.random.uniform(k2, (n,), minval=-0.2, maxval=0.2),
    )
    frames = jax.vmap(env.render, in_axes=(0, None))(s, frame_size)
    assert frames.shape == (n, frame_size, frame_size) and frames.dtype == jnp.uint8
    assert int(frames.max()) == env.CART_VALUE
    got = env.read_frame(frames, frame_size)
    np.testing.assert_allclose(got[:, 0], s.x, atol=0.02)
    np.testing.assert_allclose(got[:, 1], s.theta, atol=0.03)
    # Different states draw different frames.
    assert not np.array_equal(np.asarray(frames[0]), np.asarray(frames[1]))


@pytest.mark.parametrize("frame_size", [16, 24, 84, 101])
def test_render_stays_in_the_rows_the_encoder_reads(frame_size):
    """read_frame reads only env.scene_rows: nothing may be drawn outside them, whatever the
    state (cart at the edges, pole upright or lying flat on either side)."""
    xs = jnp.array([-2.8, -2.4, 0.0, 2.4, 2.8])
    thetas = jnp.linspace(-jnp.pi / 2, jnp.pi / 2, 13)
    x, th = (a.reshape(-1) for a in jnp.meshgrid(xs, thetas))
    s = env.reset_batch(jax.random.key(0), x.shape[0])._replace(x=x, theta=th)
    frames = np.asarray(jax.vmap(env.render, in_axes=(0, None))(s, frame_size))
    first, stop = env.scene_rows(frame_size)
    assert 0 <= first < stop <= frame_size
    assert frames[:, first:stop].any(axis=(1, 2)).all()
    assert not frames[:, :first].any() and not frames[:, stop:].any()


def test_velocity_features_from_frame_pairs():
    s0 = env.EnvState(*(jnp.float32(v) for v in (0.3, 0.8, 0.05, -0.6)), jnp.int32(0),
                      jnp.float32(0))
    s1, *_ = env.step(s0, jnp.int32(1), jax.random.key(0))
    f0, f1 = env.render(s0, 84), env.render(s1, 84)
    feats = env.features(env.read_frame(f0, 84), env.read_frame(f1, 84))
    # Frame differences see the velocity that moved the state between the frames.
    np.testing.assert_allclose(feats[1], s0.x_dot, atol=0.15)
    np.testing.assert_allclose(feats[3], s0.theta_dot, atol=0.4)


# ------------------------------------------------------------------------------------------
# policy and learner


@pytest.mark.parametrize("param_mb", [1, 8, 32])
def test_param_mb_sets_the_policy_size(param_mb):
    shapes = jax.eval_shape(lambda: policy.init(jax.random.key(0), param_mb, 64))
    nbytes = policy.num_bytes(shapes)
    assert abs(nbytes - param_mb * 2**20) <= 64 * 4, nbytes


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="param_mb"):
        policy.table_rows(0, 64)
    with pytest.raises(ValueError, match="--workers"):
        rollouts.Config(workers=0).validate()
    with pytest.raises(ValueError, match="--address"):
        rollouts.Config(address="127.0.0.1:6379").validate()
    with pytest.raises(ValueError, match="--steps must be >= 2 for an Atari game"):
        rollouts.Config.for_env("pong", steps=1).validate()
    rollouts.Config(steps=1).validate()  # CartPole trains on every step


def test_tiles_in_range_and_local():
    feats = jax.random.uniform(jax.random.key(0), (500, 4), minval=-5, maxval=5)
    idx = policy.tiles(feats, 1000)
    assert idx.shape == (500, policy.N_TILINGS)
    assert int(idx.min()) >= 0 and int(idx.max()) < 1000
    # Nearby inputs share most tiles (generalization); far ones share few.
    a = jnp.array([0.1, 0.2, 0.01, 0.1])
    near = set(np.asarray(policy.tiles(a + 0.01, 1 << 20)).tolist())
    far = set(np.asarray(policy.tiles(-a * 10, 1 << 20)).tolist())
    base = set(np.asarray(policy.tiles(a, 1 << 20)).tolist())
    assert len(base & near) >= policy.N_TILINGS // 2 > len(base & far)


def test_discounted_returns_match_a_loop():
    rng = np.random.default_rng(0)
    rewards = rng.random((3, 20)).astype(np.float32)
    dones = rng.random((3, 20)) < 0.2
    got = np.asarray(policy.discounted_returns(jnp.asarray(rewards), jnp.asarray(dones), 0.9))
    want = np.zeros_like(rewards)
    for e in range(3):
        g = 0.0
        for t in reversed(range(20)):
            g = rewards[e, t] + 0.9 * g * (1.0 - dones[e, t])
            want[e, t] = g
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_rollout_trajectory_layout():
    params = policy.init(jax.random.key(0), 1, 16)
    carry = worker.initial_carry(jax.random.key(1), 3)
    traj, carry2, secs = worker.rollout(params, carry, jax.random.key(2), 24, 10)
    assert traj.frames.shape == (11, 3, 24, 24) and traj.frames.dtype == jnp.uint8
    assert traj.actions.shape == traj.rewards.shape == traj.dones.shape == (10, 3)
    assert bool(traj.firsts[0].all())  # a fresh carry starts episodes
    assert secs > 0
    # The carry continues the episodes: the next rollout's step 0 is the state after step 9.
    traj2, _, _ = worker.rollout(params, carry2, jax.random.key(3), 24, 10)
    assert np.array_equal(np.asarray(traj2.frames[0]), np.asarray(traj.frames[-1]))
    np.testing.assert_array_equal(traj2.firsts[0], traj.dones[-1])


def test_rollout_records_the_acting_policys_log_probs():
    """The actor's ``logp`` is what the learner recomputes from the frames with the same
    parameters: on-policy data gets importance weight 1, so the correction changes nothing
    for the Pool and Ray backends."""
    params = policy.init(jax.random.key(0), 1, 16)
    traj, _, _ = worker.rollout(params, worker.initial_carry(jax.random.key(1), 4),
                                jax.random.key(2), 24, 12)
    assert traj.logp.shape == traj.actions.shape and traj.logp.dtype == jnp.float32
    logits = policy.apply(params, worker._features(traj, 24))
    want = jnp.take_along_axis(jax.nn.log_softmax(logits), traj.actions[..., None], -1)[..., 0]
    np.testing.assert_allclose(traj.logp, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(policy.importance_weights(want, traj.logp), 1.0, atol=1e-4)


def test_stale_actions_are_weighted_by_truncated_importance_ratios():
    """--max-lag > 0: each step's policy-gradient term is weighted by min(1, pi/mu). An action
    the acting policy mu chose twice as often as the learner's pi would counts half; one pi
    prefers counts once (truncated), as on-policy; the entropy term is not weighted."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    dense = {k: v for k, v in policy.init(k1, 0.25, 8).items() if k != "table"}
    bag = jax.random.normal(k2, (6, 8))
    actions = jnp.array([0, 1, 1, 0, 1, 0], jnp.int32)
    adv = jax.random.normal(k3, (6,))
    logp = jnp.take_along_axis(jax.nn.log_softmax(policy.head(dense, bag)), actions[:, None],
                               -1)[:, 0]

    def pg_loss(behaviour_logp):  # the policy-gradient term alone (no entropy bonus)
        return policy.reinforce_loss(dense, bag, policy.Batch(None, actions, adv, behaviour_logp),
                                     0.0)

    def grads(behaviour_logp):
        return jax.grad(lambda d: policy.reinforce_loss(
            d, bag, policy.Batch(None, actions, adv, behaviour_logp), 0.0))(dense)

    on = pg_loss(logp)
    np.testing.assert_allclose(on, -(logp * adv).mean(), rtol=1e-6)
    np.testing.assert_allclose(pg_loss(logp + jnp.log(2.0)), on / 2, rtol=1e-5)  # mu = 2 pi
    np.testing.assert_allclose(pg_loss(logp - jnp.log(2.0)), on, rtol=1e-6)  # mu = pi/2: 1
    # The weights are constants: the gradient is the on-policy one scaled, not d(rho)/d(theta).
    for a, b in zip(jax.tree.leaves(grads(logp + jnp.log(2.0))), jax.tree.leaves(grads(logp))):
        np.testing.assert_allclose(a, b / 2, rtol=1e-4, atol=1e-7)
    w = policy.importance_weights(logp, logp + jnp.array([1.0, -1.0, 0.0, 3.0, -3.0, 0.5]))
    assert float(w.max()) <= policy.RHO_BAR and float(w.min()) > 0
    np.testing.assert_allclose(w, jnp.minimum(jnp.exp(-jnp.array([1.0, -1, 0, 3, -3, 0.5])), 1),
                               rtol=1e-6)


class _Inline:
    """A backend that runs the tasks in this process (the loop without the transport)."""

    name = "inline"

    def __init__(self, *args, **kwargs):
        pass

    def broadcast(self, params):
        return params

    def map(self, handle, tasks):
        return [worker.rollout(handle, *t) for t in tasks]

    def release(self, handle):
        pass

    def wait_ready(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.mark.slow
def test_return_improves_with_a_fixed_seed(monkeypatch):
    """REINFORCE on pixels learns: the last iterations' mean return is at least twice the
    first's. Deterministic (fixed seed, XLA CPU), so this cannot flake."""
    monkeypatch.setattr(backends, "make", _Inline)
    cfg = rollouts.Config(workers=2, envs=8, steps=64, frame_size=32, param_mb=1,
                          iterations=10, seed=0, lr=0.01, table_lr=0.3)
    result = rollouts.train(cfg, "stock", out=io.StringIO(), err=io.StringIO())
    returns = result.returns
    assert len(returns) == 10 and all(r > 0 for r in returns)
    assert np.mean(returns[-3:]) > 2 * returns[0], returns
    # And again: bit-identical.
    again = rollouts.train(cfg, "stock", out=io.StringIO(), err=io.StringIO())
    assert again.returns == returns


class _InlineLagged(_Inline):
    """The loop as a streaming actor with --max-lag 1 sees it, in this process: every rollout
    acts with the parameters of the update before the newest (one version stale)."""

    def __init__(self, *args, **kwargs):
        self._published = []

    def broadcast(self, params):
        # learn() donates the learner's parameters: keep a copy, as a queue's put() does.
        self._published = (self._published + [jax.tree.map(jnp.copy, params)])[-2:]
        return len(self._published)

    def map(self, handle, tasks):
        stale = self._published[0]
        return [worker.Rollout(*worker.rollout(stale, *t), lag=handle - 1) for t in tasks]


def test_learning_with_one_update_of_lag_is_corrected(monkeypatch):
    """Data one update stale (--backend queue --max-lag 1), fixed seed: with the truncated
    importance weights the learner still improves the return at least twice over in 10
    updates, as on-policy. Deterministic (XLA CPU, inline)."""
    monkeypatch.setattr(backends, "make", _InlineLagged)
    cfg = rollouts.Config(workers=2, envs=8, steps=64, frame_size=32, param_mb=1,
                          iterations=10, seed=0, lr=0.01, table_lr=0.3)
    result = rollouts.train(cfg, "stock", out=io.StringIO(), err=io.StringIO())
    assert [it.lag for it in result.iterations] == [0.0] + [1.0] * 9
    assert np.mean(result.returns[-3:]) > 2 * result.returns[0], result.returns


# ------------------------------------------------------------------------------------------
# the CLI, end to end through real worker processes


@pytest.mark.slow
def test_cli_pool_compare_end_to_end():
    """Both transports on the Pool backend: the same learning curve bit for bit (the transport
    changes nothing but the speed), and the report table. Output into a pipe (stdout and
    stderr merged, as in a log): plain lines, exactly one per iteration (no progress-bar
    frames repeating them), and the start-up is announced and timed before iteration 1."""
    proc = _cli(*TINY, "--compare", merged=True)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    for needle in ("pool/stock", "pool/jaxtransport", "env steps/s", "transport share",
                   "speedup (env steps/s, jaxtransport over stock)"):
        assert needle in out, out
    assert "learning curves identical across transports: yes" in out, out
    assert _printed_returns(out) == 2 * _inline_returns(), out
    lines = out.splitlines()
    for n in (1, 2):  # one line per iteration and run, nothing else mentions "n/2"
        assert sum(f"{n}/2" in line for line in lines) == 2, out
    assert "\r" not in out and "\x1b" not in out and "[###" not in out, out
    for run in ("stock", "jaxtransport"):
        block = out.split(f"# pool/{run}:")[1]
        starting = block.index("start-up: starting 2 worker processes and compiling")
        done = block.index("start-up: done in")
        assert starting < done < block.index("iter   1/2"), out


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_when_every_stream_is_a_terminal(monkeypatch):
    """On terminals the bar is redrawn in place on stderr and erased before each iteration
    line; if either stream is not a terminal there is no bar at all."""
    monkeypatch.setattr(backends, "make", _Inline)
    cfg = rollouts.Config(workers=1, envs=2, steps=8, frame_size=16, param_mb=0.25, hidden=8,
                          iterations=2)
    out, err = _Terminal(), _Terminal()
    rollouts.train(cfg, "stock", out=out, err=err)
    assert "[##############################] 2/2" in err.getvalue()
    assert err.getvalue().count("\r\x1b[2K") >= 2 and "\n" not in err.getvalue()[:-1]
    for out, err in ((io.StringIO(), _Terminal()), (_Terminal(), io.StringIO())):
        rollouts.train(cfg, "stock", out=out, err=err)
        assert err.getvalue() == "", err.getvalue()
        assert sum(line.startswith("iter ") for line in out.getvalue().splitlines()) == 2


@pytest.mark.slow
@pytest.mark.parametrize("transport,max_lag", [("jaxtransport", 1), ("compare", 0)])
def test_cli_queue_backend_streams_and_reports_lag(transport, max_lag):
    """--backend queue: long-lived actors stream trajectories through a queue (the same code on
    jaxtransport.multiprocessing and on multiprocessing: --compare runs both); each update
    reports its off-policy lag (never more than --max-lag), the table its run and the summary
    the mean lag."""
    flags = ["--compare"] if transport == "compare" else ["--transport", transport]
    proc = _cli(*TINY, "--backend", "queue", *flags, "--max-lag", str(max_lag))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    runs = ["stock", "jaxtransport"] if transport == "compare" else [transport]
    for run in runs:
        assert f"| queue/{run} |" in out, out
        assert f"queue/{run}: off-policy lag per update: " in out, out
    lags = [float(x) for x in re.findall(r"lag (\d+\.\d)", out)]
    assert len(lags) == 2 * len(runs) and all(0 <= x <= max_lag for x in lags), out
    if max_lag == 0:
        assert lags == [0.0] * len(lags), out
    else:
        assert lags[0] == 0.0, out  # the first update's data: the first parameters
    if transport == "compare":
        assert "speedup (env steps/s, jaxtransport over stock)" in out, out
    assert len(_printed_returns(out)) == 2 * len(runs)


def test_queue_backend_reports_a_dead_actor_instead_of_hanging():
    """An actor killed while the learner waits for trajectories: map() raises naming it."""
    import signal

    params = policy.init(jax.random.key(0), 0.25, 8)
    rows = params["table"].shape[0]
    with pytest.raises(RuntimeError, match="exited with code -9"):
        with backends.make("queue", "jaxtransport", 1, warm=(rows, 8, 2, 24, 8), timeout=120.0) as be:
            os.kill(be._procs[0].pid, signal.SIGKILL)
            version = be.broadcast(params)
            be.map(version, [None])


def test_cli_rejects_bad_flags():
    proc = _cli("--workers", "0")
    assert proc.returncode == 2 and "--workers must be >= 1" in proc.stderr
    proc = _cli("--backend", "queue", "--max-lag", "-1")
    assert proc.returncode == 2 and "--max-lag must be >= 0" in proc.stderr
    proc = _cli("--address", "127.0.0.1:6379")
    assert proc.returncode == 2 and "--backend ray" in proc.stderr


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_ray_end_to_end():
    """Both transports on a local Ray started by the demo (its own interpreter, so no Ray state
    is shared with other tests): the learning curve is the one the loop gives in-process, to
    the printed digit -- arrays crossed Ray's object store both ways unchanged. Ray is started
    once, before the demo initializes JAX, so nothing forks a process that runs JAX: JAX's
    fork warning never appears (it did twice when each run started its own Ray)."""
    pytest.importorskip("ray")
    proc = _cli(*TINY, "--backend", "ray", "--compare", timeout=560)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "| ray/stock |" in out and "| ray/jaxtransport |" in out, out
    assert "learning curves identical across transports: yes" in out, out
    assert _printed_returns(out) == 2 * _inline_returns(), out
    assert "os.fork()" not in proc.stderr and "deadlock" not in proc.stderr, proc.stderr
    assert "start-up: starting 2 Ray actors" in out, out


_RETURN = re.compile(r"^iter +\d+/\d+ +(return .*? episodes\))", re.M)


def _printed_returns(text: str) -> list[str]:
    return _RETURN.findall(text)


def _inline_returns() -> list[str]:
    """The TINY configuration's per-iteration returns, run in this process, formatted as the
    demo prints them."""
    args = build_parser().parse_args(TINY)
    cfg = rollouts.Config(iterations=args.iterations, envs=args.envs, steps=args.steps,
                          frame_size=args.frame_size, param_mb=args.param_mb,
                          hidden=args.hidden, warmup=args.warmup)
    out = io.StringIO()
    saved = backends.make
    backends.make = _Inline
    try:
        rollouts.train(cfg, "stock", out=out, err=io.StringIO())
    finally:
        backends.make = saved
    return _printed_returns(out.getvalue())


@pytest.mark.slow
def test_killed_worker_stops_the_loop_with_an_error_not_a_hang():
    """multiprocessing.Pool waits forever for a task whose worker was killed
    (python/cpython#66587): the demo's backends bound the wait with --task-timeout, raise
    TimeoutError saying what to do, and leaving the ``with`` block on that error terminates the
    pool instead of joining it (which would hang too)."""
    import signal
    import threading
    import time

    from jaxtransport.rollouts import _backends as backends

    params = policy.init(jax.random.key(0), 0.25, 8)
    carry = worker.initial_carry(jax.random.key(1), 2)
    killed = threading.Event()

    def cpu_ticks(pid):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    def kill_once_busy(pid):
        # An idle worker burns no CPU: once it has used 0.2 s more, it is inside the task
        # (compiling or running it), so the kill loses the task.
        base = cpu_ticks(pid)
        deadline = time.monotonic() + 60
        while cpu_ticks(pid) - base < 0.2 * os.sysconf("SC_CLK_TCK"):
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        killed.set()

    start = time.monotonic()
    with pytest.raises(TimeoutError, match="--task-timeout=8s"):
        with backends.make("pool", "stock", 1, timeout=8.0) as be:
            pid = be._pool._pool[0].pid  # the one worker of the underlying multiprocessing.Pool
            # Let it finish starting up (imports) before watching its CPU: idle for 0.5 s.
            last, quiet_since = cpu_ticks(pid), time.monotonic()
            while time.monotonic() - quiet_since < 0.5:
                time.sleep(0.05)
                now = cpu_ticks(pid)
                if now != last:
                    last, quiet_since = now, time.monotonic()
            killer = threading.Thread(target=kill_once_busy, args=(pid,))
            killer.start()
            try:
                be.map(params, [(carry, jax.random.key(2), 16, 100_000)])
            finally:
                killer.join()
    assert killed.is_set()
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_ctrl_c_stops_the_demo_and_its_workers(tmp_path):
    import time

    from .conftest import child_pids, interrupt, popen_interruptible, wait_until

    environ = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    args = [a if a != "2" else "500" for a in TINY]  # --iterations 500: still running
    err = tmp_path / "stderr"
    with open(err, "w") as stderr:
        proc = popen_interruptible(
            [sys.executable, "-m", "jaxtransport.rollouts", *args],
            env=environ, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT,
        )
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if line.startswith("iter   1/"):
                break
            assert time.monotonic() < deadline
        workers = child_pids(proc.pid)
        assert workers, "the demo should be running worker processes"
        assert interrupt(proc, str(err), timeout=60) == 130
        assert "interrupted" in err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    def gone():
        return not any(os.path.exists(f"/proc/{pid}") for pid in workers)

    assert wait_until(gone, 20), "worker processes survived the interrupted demo"
