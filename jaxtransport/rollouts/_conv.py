"""The Atari policy: a small convolutional network on stacked 84x84 frames, and its learner.

Architecture (``apply``): ``uint8`` frames (..., K, S, S) scaled to [0, 1]; a convolution of
``FILTERS`` filters, ``PATCH`` x ``PATCH`` pixels, stride ``PATCH`` (a patch embedding: 14x14
positions at 84x84), ReLU; 2x2 max-pool (7x7); dense ``hidden``, ReLU; linear to the game's
actions (the policy) and to one value (the critic, ``apply_value``: only the learner reads
it). About 0.2 M multiply-adds per observation, 0.2 MiB of parameters: acting must not be what
bounds an actor on a CPU (as on a host whose actors run inference on an accelerator), and on
the demo's 2 cores the learner's backward pass shares the cores with the actors. DQN's network
(Mnih et al. 2015) is ~40x the arithmetic, and its overlapping strided convolutions are
several times slower again on XLA's CPU backend than this one, which XLA runs as one matrix
product (patches x filters). Each actor reports what acting cost (``act_s``).

``learn`` is the learner's jitted step, an actor-critic as cleanba's (``cleanba_ppo.py``)
and CleanRL's Atari PPO: with the values of the learner's current parameters it computes
generalized advantage estimates (``GAE_LAMBDA``) and returns, then takes ``EPOCHS`` passes of
``MINIBATCHES`` Adam steps over the iteration's samples with PPO's clipped surrogate (the ratio
of the learner's policy to the one that acted, recorded by the actors, clipped at
1 +- ``CLIP``: what keeps an actor's parameters being an update or two old harmless), the
value head's squared error (``VALUE_COEF``) and an entropy bonus, the gradient's global norm
clipped at ``MAX_GRAD_NORM``. A trajectory of ``T`` steps trains on its first ``T - 1``: the
last step's frames give the value its returns are bootstrapped from (nothing else travels).
Rewards are clipped to [-1, 1] (as DQN, IMPALA and PPO do on Atari).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import _policy as policy

PATCH = 6
FILTERS = 16
MIN_FRAME = 2 * PATCH


def _grid(frame_size: int) -> int:
    """Convolution positions per side (the frame is cropped to a multiple of 2 * PATCH)."""
    return (frame_size // (2 * PATCH)) * 2


def init(key: jax.Array, actions: int, hidden: int, stack: int, frame_size: int) -> dict:
    """Fresh parameters (float32) for ``actions`` actions on ``stack`` frames of
    ``frame_size`` pixels square (He-initialised; a near-uniform first policy)."""
    if frame_size < MIN_FRAME:
        raise ValueError(f"--frame-size must be at least {MIN_FRAME} pixels for the Atari policy, got {frame_size!r}")
    k0, k1, k2 = jax.random.split(key, 3)
    fan_in = stack * PATCH * PATCH
    flat = FILTERS * (_grid(frame_size) // 2) ** 2
    return {
        "conv": jax.random.normal(k0, (fan_in, FILTERS), jnp.float32) * jnp.sqrt(2.0 / fan_in),
        "conv_b": jnp.zeros((FILTERS,), jnp.float32),
        "w1": jax.random.normal(k1, (flat, hidden), jnp.float32) * jnp.sqrt(2.0 / flat),
        "b1": jnp.zeros((hidden,), jnp.float32),
        "w2": jax.random.normal(k2, (hidden, actions), jnp.float32) * (0.01 / jnp.sqrt(hidden)),
        "b2": jnp.zeros((actions,), jnp.float32),
        "wv": jnp.zeros((hidden, 1), jnp.float32),
        "bv": jnp.zeros((1,), jnp.float32),
    }


def apply(params: dict, frames: jax.Array) -> jax.Array:
    """Action logits ``(B, actions)`` for ``uint8`` frames ``(B, K, S, S)``."""
    return _logits(params, _torso(params, frames))


def apply_value(params: dict, frames: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(logits (B, actions), values (B,))`` for ``uint8`` frames ``(B, K, S, S)``: the policy
    and the value head on the same hidden layer (the learner's; acting reads only the logits)."""
    x = _torso(params, frames)
    return _logits(params, x), (x @ params["wv"] + params["bv"])[:, 0]


def _logits(params: dict, x: jax.Array) -> jax.Array:
    """The policy head: action logits from the hidden layer."""
    return x @ params["w2"] + params["b2"]


def _torso(params: dict, frames: jax.Array) -> jax.Array:
    """The hidden layer ``(B, hidden)`` both heads read."""
    b, k, s, _ = frames.shape
    g = _grid(s)
    x = frames[:, :, : g * PATCH, : g * PATCH].astype(jnp.float32) * (1.0 / 255.0)
    # The convolution (kernel = stride = PATCH) as patches x filters.
    x = x.reshape(b, k, g, PATCH, g, PATCH).transpose(0, 2, 4, 1, 3, 5)
    x = jax.nn.relu(x.reshape(b * g * g, k * PATCH * PATCH) @ params["conv"] + params["conv_b"])
    h = g // 2
    x = x.reshape(b, h, 2, h, 2, FILTERS).max((2, 4)).reshape(b, h * h * FILTERS)
    return jax.nn.relu(x @ params["w1"] + params["b1"])


@jax.jit
def act(params: dict, frames: jax.Array, key: jax.Array, t: jax.Array):
    """One acting step for a batch of environments: ``(actions (E,) int32, logp (E,))``,
    sampled with ``fold_in(key, t)``."""
    logits = apply(params, frames)
    action = jax.random.categorical(jax.random.fold_in(key, t), logits).astype(jnp.int32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], axis=-1)[:, 0]
    return action, logp


# The learner's settings: cleanba's and CleanRL's Atari PPO.
GAE_LAMBDA = 0.95
CLIP = 0.1
VALUE_COEF = 0.5
MAX_GRAD_NORM = 0.5
EPOCHS = 4
MINIBATCHES = 4


def gae(values, bootstrap, rewards, discounts, lam: float = GAE_LAMBDA):
    """Generalized advantage estimates (Schulman et al. 2016), time-major ``(T, E)``:
    ``values`` V(x_t), ``bootstrap`` (E,) V(x_T), ``rewards`` r_t, ``discounts``
    gamma * (1 - done_t). Returns ``(advantages, returns)``, ``returns = advantages + values``
    (the value head's targets)."""
    nxt = jnp.concatenate([values[1:], bootstrap[None]], axis=0)
    deltas = rewards + discounts * nxt - values

    def back(acc, x):
        delta, disc = x
        acc = delta + disc * lam * acc
        return acc, acc

    _, adv = jax.lax.scan(back, jnp.zeros_like(bootstrap), (deltas, discounts), reverse=True)
    return adv, adv + values


def _clip_by_global_norm(grads, max_norm: float):
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: g * scale, grads)


def ppo_loss(params, frames, actions, mu_logp, adv, returns, entropy_coef: float):
    """PPO's loss on a minibatch of samples: ``frames`` (B, K, S, S) ``uint8``, ``actions``
    (B,), ``mu_logp`` (B,) the acting policy's log-probabilities, ``adv`` (B,) advantages
    (standardized here), ``returns`` (B,) the value head's targets."""
    logits, values = apply_value(params, frames)
    logp_all = jax.nn.log_softmax(logits)
    logp = jnp.take_along_axis(logp_all, actions[:, None], axis=-1)[:, 0]
    ratio = jnp.exp(logp - mu_logp)
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    pg = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - CLIP, 1.0 + CLIP)).mean()
    value_loss = 0.5 * ((values - returns) ** 2).mean()
    entropy = -(jnp.exp(logp_all) * logp_all).sum(-1).mean()
    return pg + VALUE_COEF * value_loss - entropy_coef * entropy


@functools.partial(jax.jit, static_argnames=("gamma", "entropy_coef"), donate_argnums=(0, 1))
def learn(params, opt, trajs, lr, *, gamma: float, entropy_coef: float):
    """One learner iteration on the trajectories of all actors (``_atari.Trajectory``, time
    major; see the module docstring): ``EPOCHS`` x ``MINIBATCHES`` Adam steps. Returns
    ``(params, opt, loss)`` (``loss``: the mean over the steps); ``params`` and ``opt`` are
    donated.

    Episodes end at ``dones`` (a termination or a time-limit truncation: the next observation
    is already the next episode's, so nothing is bootstrapped across it). Minibatches are
    drawn without replacement from a permutation keyed by Adam's step count, so the same
    trajectories and parameters give the same update in any process."""
    frames = jnp.concatenate([t.frames for t in trajs], axis=1)  # (T, E, K, S, S)
    T, E = frames.shape[:2]
    flat = frames.reshape((T * E,) + frames.shape[2:])
    values = apply_value(params, flat)[1].reshape(T, E)  # before the steps: not differentiated
    rewards = jnp.concatenate([jnp.clip(t.rewards[:-1], -1.0, 1.0) for t in trajs], axis=1)
    discounts = gamma * (1.0 - jnp.concatenate([t.dones[:-1] for t in trajs], axis=1).astype(jnp.float32))
    adv, returns = gae(values[:-1], values[-1], rewards, discounts)
    n = (T - 1) * E
    samples = (
        frames[:-1].reshape((n,) + frames.shape[2:]),
        jnp.concatenate([t.actions[:-1] for t in trajs], axis=1).reshape(n),
        jnp.concatenate([t.logp[:-1] for t in trajs], axis=1).reshape(n),
        adv.reshape(n),
        returns.reshape(n),
    )
    size = max(n // MINIBATCHES, 1)
    count = n // size
    key = jax.random.fold_in(jax.random.key(0x5EED), opt.step)
    grad_fn = jax.value_and_grad(ppo_loss)

    def minibatch(carry, idx):
        params, opt = carry
        loss, grads = grad_fn(params, *(x[idx] for x in samples), entropy_coef)
        params, opt = policy.adam_update(params, _clip_by_global_norm(grads, MAX_GRAD_NORM), opt, lr)
        return (params, opt), loss

    def epoch(carry, k):
        order = jax.random.permutation(k, n)[: count * size].reshape(count, size)
        return jax.lax.scan(minibatch, carry, order)

    (params, opt), losses = jax.lax.scan(epoch, (params, opt), jax.random.split(key, EPOCHS))
    return params, opt, losses.mean()
