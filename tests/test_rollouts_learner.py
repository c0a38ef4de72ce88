"""The Atari learner (``_conv.learn``): GAE against a plain sum, and a learner that learns.

No environments: synthetic trajectories in the layout the actors send (``_ale.Trajectory``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtransport.rollouts import _ale as ale
from jaxtransport.rollouts import _conv as conv
from jaxtransport.rollouts import _policy as policy


def _reference_gae(v, boot, r, disc, lam):
    """Schulman et al. 2016, eq. 16, as the finite sum of discounted TD errors, in float64."""
    T, E = v.shape
    v_next = np.concatenate([v[1:], boot[None]]).astype(np.float64)
    delta = r + disc * v_next - v
    adv = np.zeros((T, E))
    for t in range(T):
        weight = np.ones(E)
        for k in range(t, T):
            adv[t] += weight * delta[k]
            weight = weight * disc[k] * lam
    return adv


def test_gae_matches_the_sum_of_discounted_td_errors_and_stops_at_episode_ends():
    rng = np.random.default_rng(0)
    T, E = 9, 4
    v = rng.normal(size=(T, E)).astype(np.float32)
    boot = rng.normal(size=E).astype(np.float32)
    r = rng.normal(size=(T, E)).astype(np.float32)
    disc = (0.99 * (rng.random((T, E)) > 0.2)).astype(np.float32)  # some episodes end
    assert (disc == 0).any()
    adv, ret = conv.gae(*map(jnp.asarray, (v, boot, r, disc)), lam=0.9)
    want = _reference_gae(v, boot, r, disc, 0.9)
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, want + v, rtol=1e-5, atol=1e-5)
    # lambda = 1: the returns are the discounted rewards to go, bootstrapped at the end.
    _, ret1 = conv.gae(*map(jnp.asarray, (v, boot, r, disc)), lam=1.0)
    g = boot.astype(np.float64)
    for t in reversed(range(T)):
        g = r[t] + disc[t] * g
        np.testing.assert_allclose(ret1[t], g, rtol=1e-5, atol=1e-5)


def _bandit_trajectory(params, seed, T=16, E=8, size=conv.MIN_FRAME):
    """A trajectory of a one-step game: random frames, actions from the policy (``conv.act``,
    as an actor chooses them), reward 1 for action 0 and 0 otherwise, every step its own
    episode."""
    frames = np.random.default_rng(seed).integers(0, 256, (T * E, ale.STACK, size, size), dtype=np.uint8)
    a, logp = conv.act(params, frames, jax.random.key(seed), np.int32(0))
    a, logp = np.asarray(a), np.asarray(logp)
    return ale.Trajectory(
        frames=jnp.asarray(frames.reshape(T, E, ale.STACK, size, size)), actions=jnp.asarray(a.reshape(T, E)),
        logp=jnp.asarray(logp.reshape(T, E)), rewards=jnp.asarray((a == 0).astype(np.float32).reshape(T, E)),
        dones=jnp.ones((T, E), bool), failures=jnp.ones((T, E), bool), finished_return_sum=jnp.float32(0),
        finished_count=jnp.int32(0))


def test_learner_learns_the_rewarded_action_and_its_value():
    """Through the real jitted step (donated inputs, two actors' trajectories, each iteration
    its EPOCHS x MINIBATCHES Adam steps): the rewarded action's probability rises from about a
    third to over 0.9 in 8 iterations, and the value head from 0 to about the reward the policy
    now collects (1)."""
    size, actions = conv.MIN_FRAME, 3
    params = conv.init(jax.random.key(0), actions, 16, ale.STACK, size)
    opt = policy.adam_init(params)
    probe = _bandit_trajectory(params, 99).frames.reshape((-1, ale.STACK, size, size))
    p0 = float(jax.nn.softmax(jax.jit(conv.apply)(params, probe))[:, 0].mean())
    assert 0.25 < p0 < 0.42
    for i in range(8):
        trajs = [_bandit_trajectory(params, 2 * i + j) for j in range(2)]
        params, opt, loss = conv.learn(params, opt, trajs, 1e-3, gamma=0.99, entropy_coef=0.01)
        assert np.isfinite(float(loss))
    logits, values = jax.jit(conv.apply_value)(params, probe)
    p1 = float(jax.nn.softmax(logits)[:, 0].mean())
    assert p1 > 0.9, (p0, p1)
    assert 0.8 < float(values.mean()) < 1.1, float(values.mean())
