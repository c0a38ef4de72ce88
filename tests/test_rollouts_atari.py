"""The rollouts demo on Atari (ALE through gymnasium) and the threaded baseline.

Needs the ``atari`` extra (``pip install 'jaxtransport[atari]'``); every test here is skipped
with the reason where it is missing. The end-to-end runs go through the real command line, in
fresh interpreters, with real actor processes and shared memory.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtransport.rollouts import _atari as atari
from jaxtransport.rollouts import _backends as backends
from jaxtransport.rollouts import _cli as cli
from jaxtransport.rollouts import _conv as conv
from jaxtransport.rollouts import _policy as policy

from .conftest import ROOT

_MISSING = atari.available()
requires_atari = pytest.mark.skipif(_MISSING is not None,
                                    reason=f"the atari extra is not installed: {_MISSING}")

# A few iterations of the real loop, small enough for 2 loaded cores.
TINY = ["--env", "pong", "--iterations", "3", "--envs", "2", "--steps", "12", "--warmup", "0",
        "--frame-size", "36", "--hidden", "16"]


def _cli(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    environ = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "jaxtransport.rollouts", *args], env=environ,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=timeout, cwd=ROOT)


# Slow (make test-slow): ALE environments, actor processes, the demo end to end.
pytestmark = pytest.mark.slow

def _spec(envs=3, frame_size=36, seed=0, engine="gymnasium"):
    return atari.Spec(atari.game_id("pong", engine), envs, frame_size, seed, engine)


@requires_atari
def test_game_names():
    assert atari.game_id("pong") == "ALE/Pong-v5"
    assert atari.game_id("space_invaders") == "ALE/SpaceInvaders-v5"
    assert atari.game_id("ALE/Breakout-v5") == "ALE/Breakout-v5"
    with pytest.raises(ValueError, match=r"--env 'nosuchgame'.*pong"):
        atari.game_id("nosuchgame")


@pytest.mark.parametrize("engine", atari.ENGINES)
def test_actor_trajectory_layout_and_repeatability(engine):
    """Frames are stacked 84x84-style uint8 observations (each step's stack is the previous one
    shifted by a frame, except across an episode boundary); the recorded log-probabilities are
    the acting policy's; the same actor index, parameters and key give the same trajectory
    bit for bit, and another index other environments. Either engine (the rollout loop is
    shared; envpool's test skips without the envpool extra)."""
    missing = atari.available(engine)
    if missing is not None:
        pytest.skip(f"the {engine} engine is not installed: {missing}")
    spec = _spec(engine=engine)
    params = conv.init(jax.random.key(0), atari.num_actions(spec.game_id, engine), 16, atari.STACK, 36)

    def run(index):
        a = atari.make_actor(spec, index)
        try:
            return a.rollout(params, jax.random.key(1), 20)
        finally:
            a.close()

    traj, carry, compute, act = run(0)
    assert traj.frames.shape == (20, 3, atari.STACK, 36, 36) and traj.frames.dtype == jnp.uint8
    for name in ("actions", "logp", "rewards", "dones", "failures"):
        assert getattr(traj, name).shape == (20, 3), name
    assert carry.ep_return.shape == (3,) and 0 < act < compute
    f = np.asarray(traj.frames)
    assert f.any()
    np.testing.assert_array_equal(f[1:, :, :-1], f[:-1, :, 1:])  # no episode ends in 20 steps
    logits = conv.apply(params, traj.frames.reshape((-1, atari.STACK, 36, 36)))
    want = jnp.take_along_axis(jax.nn.log_softmax(logits), traj.actions.reshape(-1, 1), 1)[:, 0]
    np.testing.assert_allclose(traj.logp.reshape(-1), want, rtol=1e-5, atol=1e-5)
    for x, y in zip(jax.tree.leaves(traj), jax.tree.leaves(run(0)[0])):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(run(1)[0].frames, traj.frames)


def _update(params, trajs):
    opt = policy.adam_init(params)
    params = jax.tree.map(jnp.copy, params)  # learn() donates its inputs
    out = conv.learn(params, opt, trajs, 1e-3, gamma=0.99, entropy_coef=0.01)
    return cli.params_digest(out[0]), float(out[2])


def _identity(x):
    return x


@requires_atari
def test_learner_update_is_bit_identical_whichever_transport_carried_the_trajectories():
    """The same two trajectories, moved by stock pickle, jaxtransport's pickling, a
    jaxtransport.Pool round trip through a spawned worker (shared memory both ways) and a
    jaxtransport.multiprocessing queue: the learner's update from each is the same, bit for
    bit, as from the originals."""
    import jaxtransport as jt
    from jaxtransport import multiprocessing as jmp

    spec = _spec(envs=2)
    params = conv.init(jax.random.key(0), atari.num_actions(spec.game_id), 16, atari.STACK, 36)
    trajs = []
    for i in range(2):
        a = atari.Actor(spec, i)
        trajs.append(a.rollout(params, jax.random.key(i), 16)[0])
        a.close()
    want = _update(params, trajs)
    carried = {"pickle": pickle.loads(pickle.dumps(trajs)),
               "jaxtransport.dumps": jt.loads(*jt.dumps(trajs))}
    with jt.Pool(1, start_method="spawn") as pool:
        carried["jaxtransport.Pool"] = pool.apply(_identity, (trajs,))
    q = jmp.get_context("spawn").Queue()
    try:
        q.put(trajs)
        carried["jaxtransport.multiprocessing.Queue"] = q.get(timeout=60)
    finally:
        q.close()
        q.join_thread()
    for name, got in carried.items():
        for x, y in zip(jax.tree.leaves(trajs), jax.tree.leaves(got)):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            np.testing.assert_array_equal(x, y)
        assert _update(params, got) == want, name


@requires_atari
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cli_atari_streaming_compare_end_to_end():
    """A few iterations of Pong through streaming actor processes, stock multiprocessing then
    jaxtransport.multiprocessing, on-policy (--max-lag 0): every update of the learner is the
    same bit for bit (the final parameters' digest), the report shows acting's cost."""
    proc = _cli(*TINY, "--backend", "queue", "--compare", "--max-lag", "0")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "## Rollouts: pong, queue backend, 2 workers" in out, out
    assert "| queue/stock |" in out and "| queue/jaxtransport |" in out, out
    assert ("learner's final parameters identical across transports (SHA-256, every update "
            "bit for bit): yes") in out, out
    assert re.search(r"queue/jaxtransport: acting .* ms per step of 2 envs", out), out
    assert len(re.findall(r"^iter +\d/3 ", out, re.M)) == 6, out


@requires_atari
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_atari_threads_backend_end_to_end():
    """The threaded baseline (actor threads, queue.Queue, nothing serialized) runs the same
    loop in one process and reports its lag; it has no transport to compare."""
    proc = _cli(*TINY, "--backend", "threads")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "start-up: starting 2 actor threads" in out, out
    assert "| threads |" in out and "threads: off-policy lag per update" in out, out
    proc = _cli(*TINY, "--backend", "threads", "--compare")
    assert proc.returncode == 2 and "--backend threads moves nothing" in proc.stderr


def test_unknown_env_is_refused_with_the_fix():
    proc = _cli("--env", "nosuchgame", "--iterations", "1")
    assert proc.returncode == 2, proc.stderr
    if _MISSING is None:
        assert "no ALE game" in proc.stderr, proc.stderr
    else:
        assert "pip install 'jaxtransport[atari]'" in proc.stderr, proc.stderr


@requires_atari
def test_threads_backend_reports_a_failed_actor_instead_of_hanging():
    """An actor thread that fails (here: its game cannot be made) stops the learner's wait
    with an error naming the thread, not a hang."""
    spec = atari.Spec("ALE/NoSuchGame-v5", 1, 36, 0)
    warm = atari.Warm(spec, 4, 8, 6, 1)
    with pytest.raises(RuntimeError, match="actor thread jaxtransport-rollouts-actor-0 failed"):
        with backends.make("threads", "none", 1, warm=warm, timeout=120.0) as be:
            be.wait_ready()




def test_threads_backend_runs_cartpole_too():
    """The threaded baseline is environment-agnostic: CartPole's jitted rollout in actor
    threads learns as in the other backends (its return improves), with nothing pickled."""
    cfg = cli.Config(backend="threads", workers=2, envs=8, steps=64, frame_size=32, param_mb=1,
                     iterations=8, seed=0, lr=0.01, table_lr=0.3, max_lag=0)
    result = cli.train(cfg, "none", out=io.StringIO(), err=io.StringIO())
    assert [it.lag for it in result.iterations] == [0.0] * 8
    assert np.mean(result.returns[-3:]) > 1.5 * result.returns[0], result.returns


@requires_atari
def test_threads_backend_atari_runs_repeat_exactly_in_one_process():
    """Two threaded Atari runs in one process, on-policy (--max-lag 0), same seed: the
    learner's final parameters are identical bit for bit (each run's actor threads build
    their own environments from the seed, not ones a previous run left stepped)."""
    cfg = cli.Config.for_env("pong", backend="threads", workers=2, envs=2, steps=12,
                             iterations=2, frame_size=36, hidden=16, warmup=0, max_lag=0)
    digests = [cli.train(cfg, "none", out=io.StringIO(), err=io.StringIO()).params_sha256
               for _ in range(2)]
    assert digests[0] == digests[1] != ""
