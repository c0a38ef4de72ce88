"""The Atari policy: a small convolutional network on stacked 84x84 frames, and its learner.

Architecture (``apply``): ``uint8`` frames (..., K, S, S) scaled to [0, 1]; a convolution of
``FILTERS`` filters, ``PATCH`` x ``PATCH`` pixels, stride ``PATCH`` (a patch embedding: 14x14
positions at 84x84), ReLU; 2x2 max-pool (7x7); dense ``hidden``, ReLU; linear to the game's
actions. About 0.2 M multiply-adds per observation, 0.2 MiB of parameters: acting must not be
what bounds an actor on a CPU (as on a host whose actors run inference on an accelerator), and
on the demo's 2 cores the learner's backward pass shares the cores with the actors. DQN's
network (Mnih et al. 2015) is ~40x the arithmetic, and its overlapping strided convolutions
are several times slower again on XLA's CPU backend than this one, which XLA runs as one
matrix product (patches x filters). Each actor reports what acting cost (``act_s``).

``learn`` is the learner's jitted step: the same truncated-importance-weighted policy gradient
and Adam as CartPole's (``_policy.pg_loss``, ``_policy.advantages``, ``_policy.adam_update``),
with the logits recomputed from the frames the actors sent.
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
    }


def apply(params: dict, frames: jax.Array) -> jax.Array:
    """Action logits ``(B, actions)`` for ``uint8`` frames ``(B, K, S, S)``."""
    b, k, s, _ = frames.shape
    g = _grid(s)
    x = frames[:, :, : g * PATCH, : g * PATCH].astype(jnp.float32) * (1.0 / 255.0)
    # The convolution (kernel = stride = PATCH) as patches x filters.
    x = x.reshape(b, k, g, PATCH, g, PATCH).transpose(0, 2, 4, 1, 3, 5)
    x = jax.nn.relu(x.reshape(b * g * g, k * PATCH * PATCH) @ params["conv"] + params["conv_b"])
    h = g // 2
    x = x.reshape(b, h, 2, h, 2, FILTERS).max((2, 4)).reshape(b, h * h * FILTERS)
    x = jax.nn.relu(x @ params["w1"] + params["b1"])
    return x @ params["w2"] + params["b2"]


@jax.jit
def act(params: dict, frames: jax.Array, key: jax.Array, t: jax.Array):
    """One acting step for a batch of environments: ``(actions (E,) int32, logp (E,))``,
    sampled with ``fold_in(key, t)``."""
    logits = apply(params, frames)
    action = jax.random.categorical(jax.random.fold_in(key, t), logits).astype(jnp.int32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], axis=-1)[:, 0]
    return action, logp


@functools.partial(jax.jit, static_argnames=("gamma", "entropy_coef"), donate_argnums=(0, 1))
def learn(params, opt, trajs, lr, *, gamma: float, entropy_coef: float):
    """One policy-gradient step on the trajectories of all actors (``_atari.Trajectory``, time
    major). Returns ``(params, opt, loss)``; ``params`` and ``opt`` are donated.

    Rewards are clipped to [-1, 1] (as DQN and IMPALA do on Atari) before the discounted
    returns, which are cut at true terminations only (a time-limit truncation could have gone
    on). Everything else is CartPole's learner: per-step baseline, standardized advantages,
    truncated importance weights, entropy bonus, Adam."""
    acts = jnp.concatenate([t.actions for t in trajs], axis=1)
    logps = jnp.concatenate([t.logp for t in trajs], axis=1)
    rets = jnp.concatenate(
        [policy.discounted_returns(jnp.clip(t.rewards, -1.0, 1.0).T, t.failures.T, gamma).T for t in trajs], axis=1
    )
    adv = policy.advantages(rets)

    def loss_fn(p):
        # Per trajectory, then concatenated in the same (T, E) layout as the targets: the
        # frames (the bulk) are never copied into one array.
        logits = jnp.concatenate(
            [apply(p, t.frames.reshape((-1,) + t.frames.shape[2:])).reshape(t.frames.shape[:2] + (-1,)) for t in trajs],
            axis=1,
        )
        batch = policy.Batch(None, acts.reshape(-1), adv, logps.reshape(-1))  # type: ignore[arg-type]  # pg_loss reads no features
        return policy.pg_loss(logits.reshape(-1, logits.shape[-1]), batch, entropy_coef)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    params, opt = policy.adam_update(params, grads, opt, lr)
    return params, opt, loss
