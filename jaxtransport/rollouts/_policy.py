"""The demo's policy: hashed tile coding into an MLP, REINFORCE, Adam.

Architecture (``apply``): pixel-moment features (``_env.read_frame``) are tile
coded (``N_TILINGS`` offset grids of ``BINS`` cells per dimension, Sutton & Barto ch. 9.5.4),
each active tile is hashed into a table of ``rows`` embeddings of width ``hidden``; the sum of
the ``N_TILINGS`` active rows (an embedding bag: the first dense layer of an MLP over the sparse
one-hot tile vector) goes through ReLU -> dense ``hidden x hidden`` -> ReLU -> dense
``hidden x 2`` logits.

Almost all parameters live in the table, whose size is the ``--param-mb`` knob. Per decision the
policy reads ``N_TILINGS`` rows of it, so acting stays cheap however large the table is, while the
learner's parameter broadcast grows with it: the regime of embedding-heavy policies, where moving
the parameters, not the arithmetic, is what costs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

N_TILINGS = 16
BINS = 8
# Ranges the features are scaled from (clipped outside): x, x_dot, theta, theta_dot.
FEATURE_LOW = np.array([-2.4, -3.0, -0.21, -3.5], np.float32)
FEATURE_HIGH = np.array([2.4, 3.0, 0.21, 3.5], np.float32)
# Asymmetric tiling offsets (1, 3, 5, 7), as recommended for tile coding.
_OFFSET_STEPS = np.array([1.0, 3.0, 5.0, 7.0], np.float32)
_HASH_PRIMES = np.array([0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F], np.uint32)


def table_rows(param_mb: float, hidden: int) -> int:
    """How many embedding rows make the whole parameter tree about ``param_mb`` MiB (float32)."""
    if param_mb <= 0:
        raise ValueError(f"param_mb must be positive, got {param_mb!r}")
    if hidden <= 0:
        raise ValueError(f"hidden must be positive, got {hidden!r}")
    dense = hidden * hidden + hidden + 2 * hidden + 2 + hidden
    rows = int(param_mb * (1 << 20) / 4 - dense) // hidden
    return max(rows, N_TILINGS)


def init(key: jax.Array, param_mb: float, hidden: int) -> dict:
    """Fresh parameters (float32), about ``param_mb`` MiB in total."""
    rows = table_rows(param_mb, hidden)
    k1, k2, k3 = jax.random.split(key, 3)
    scale = 1.0 / jnp.sqrt(N_TILINGS)
    return {
        "table": jax.random.normal(k1, (rows, hidden), jnp.float32) * scale,
        "b1": jnp.zeros((hidden,), jnp.float32),
        "w2": jax.random.normal(k2, (hidden, hidden), jnp.float32) / jnp.sqrt(hidden),
        "b2": jnp.zeros((hidden,), jnp.float32),
        "w3": jax.random.normal(k3, (hidden, 2), jnp.float32) * (0.01 / jnp.sqrt(hidden)),
        "b3": jnp.zeros((2,), jnp.float32),
    }


def num_bytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def tiles(features: jax.Array, rows: int) -> jax.Array:
    """``(..., N_TILINGS)`` int32 row indices of the active tiles of ``(..., 4)`` features."""
    unit = jnp.clip((features - FEATURE_LOW) / (FEATURE_HIGH - FEATURE_LOW), 0.0, 1.0)
    tiling = jnp.arange(N_TILINGS, dtype=jnp.float32)[:, None]
    offsets = tiling * _OFFSET_STEPS / (N_TILINGS * BINS)  # (T, 4), fractions of a cell
    coords = jnp.floor((unit[..., None, :] + offsets) * BINS).astype(jnp.uint32)  # (..., T, 4)
    h = jnp.arange(N_TILINGS, dtype=jnp.uint32) * jnp.uint32(0x165667B1)
    h = h + (coords * _HASH_PRIMES).sum(-1, dtype=jnp.uint32)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x2C1B3C6D)
    h = h ^ (h >> 12)
    return (h % jnp.uint32(rows)).astype(jnp.int32)


def embed(table: jax.Array, features: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The embedding bag: ``(rows_sum (..., hidden), idx (..., N_TILINGS))``."""
    idx = tiles(features, table.shape[0])
    return jnp.take(table, idx, axis=0).sum(-2), idx


def head(params: dict, bag: jax.Array) -> jax.Array:
    """The MLP above the embedding bag: logits ``(..., 2)``. Reads every key but ``table``."""
    h = jax.nn.relu(bag + params["b1"])
    h = jax.nn.relu(h @ params["w2"] + params["b2"])
    return h @ params["w3"] + params["b3"]


def apply(params: dict, features: jax.Array) -> jax.Array:
    """Action logits ``(..., 2)`` for ``(..., 4)`` features."""
    return head(params, embed(params["table"], features)[0])


# Importance ratios pi/mu are truncated at this value (IMPALA's rho-bar; Espeholt et al. 2018).
RHO_BAR = 1.0


class Batch(NamedTuple):
    """What the learner trains on: ``features`` (B, 4), ``actions`` (B,), ``advantages`` (B,),
    and ``behaviour_logp`` (B,): log mu(a|o) of the policy that chose each action."""

    features: jax.Array
    actions: jax.Array
    advantages: jax.Array
    behaviour_logp: jax.Array


def importance_weights(logp: jax.Array, behaviour_logp: jax.Array) -> jax.Array:
    """Truncated importance ratios ``min(RHO_BAR, pi(a|o) / mu(a|o))`` from log-probabilities:
    1 when the data is on-policy, smaller for actions the learner's policy ``pi`` has since made
    less likely than the acting policy ``mu`` did (stale parameters), never above ``RHO_BAR``
    (an unbounded ratio's variance is what makes off-policy REINFORCE unreliable)."""
    return jnp.minimum(jnp.exp(logp - behaviour_logp), RHO_BAR)


def reinforce_loss(dense: dict, bag: jax.Array, batch: Batch, entropy_coef: float) -> jax.Array:
    """Policy-gradient surrogate with truncated importance weights (IMPALA's policy-gradient term,
    without a value function): -E[rho * log pi(a|o) * A] - entropy_coef * E[H(pi(.|o))], ``rho``
    = :func:`importance_weights` held constant, as a function of the dense parameters and the
    embedding-bag outputs ``bag`` (B, hidden)."""
    return pg_loss(head(dense, bag), batch, entropy_coef)


def pg_loss(logits: jax.Array, batch: Batch, entropy_coef: float) -> jax.Array:
    """The importance-weighted policy-gradient surrogate of :func:`reinforce_loss` from the
    policy's logits (B, actions) (CartPole's; Atari's learner is ``_conv.learn``'s PPO).
    ``batch.features`` is not read."""
    logp = jax.nn.log_softmax(logits)
    chosen = jnp.take_along_axis(logp, batch.actions[:, None], axis=-1)[:, 0]
    rho = jax.lax.stop_gradient(importance_weights(chosen, batch.behaviour_logp))
    entropy = -(jnp.exp(logp) * logp).sum(-1)
    return -(rho * chosen * batch.advantages).mean() - entropy_coef * entropy.mean()


def advantages(returns: jax.Array) -> jax.Array:
    """Advantages from reward-to-go ``returns`` (T, E), flattened to (T * E,): the mean return
    at the same step across all environments is the baseline (every rollout is cut after T
    steps, so late steps see fewer future rewards whatever the actions were; a per-step
    baseline removes that bias, a batch-wide mean would blame late actions), then
    standardized. With a single environment there is nothing to compare with at a step: the
    batch mean is the baseline."""
    base = returns.mean(axis=1, keepdims=True) if returns.shape[1] > 1 else returns.mean()
    adv = returns - base
    return (adv / (adv.std() + 1e-6)).reshape(-1)


def update(params: dict, opt: Adam, batch: Batch, lr: float, table_lr: float, entropy_coef: float):
    """One REINFORCE step. Returns ``(params, opt, loss)``.

    The dense layers take an Adam step. The embedding table takes a sparse SGD step, as tile
    coding always has: each active row moves by ``-table_lr * B * dL/dbag / N_TILINGS`` (a
    per-sample step of ``table_lr``), and rows no sample touched are not read or written --
    the learner's cost does not grow with ``--param-mb``.
    """
    dense = {k: v for k, v in params.items() if k != "table"}
    bag, idx = embed(params["table"], batch.features)
    loss, (g_dense, g_bag) = jax.value_and_grad(reinforce_loss, argnums=(0, 1))(dense, bag, batch, entropy_coef)
    dense, opt = adam_update(dense, g_dense, opt, lr)
    step = (-table_lr * bag.shape[0] / N_TILINGS) * g_bag
    table = (
        params["table"]
        .at[idx.reshape(-1)]
        .add(jnp.repeat(step, N_TILINGS, axis=0), indices_are_sorted=False, unique_indices=False)
    )
    return {"table": table, **dense}, opt, loss


def discounted_returns(rewards: jax.Array, dones: jax.Array, gamma: float) -> jax.Array:
    """Reward-to-go along the last axis, cut at episode ends; the rollout's tail is truncated."""

    def back(carry, x):
        r, d = x
        g = r + gamma * carry * (1.0 - d)
        return g, g

    xs = (jnp.moveaxis(rewards, -1, 0), jnp.moveaxis(dones.astype(jnp.float32), -1, 0))
    _, g = jax.lax.scan(back, jnp.zeros(rewards.shape[:-1], jnp.float32), xs, reverse=True)
    return jnp.moveaxis(g, 0, -1)


class Adam(NamedTuple):
    step: jax.Array
    mu: dict
    nu: dict


def adam_init(params: dict) -> Adam:
    """Adam moments for the dense parameters (every key but ``table``)."""
    dense = {k: v for k, v in params.items() if k != "table"}
    return Adam(jnp.int32(0), jax.tree.map(jnp.zeros_like, dense), jax.tree.map(jnp.zeros_like, dense))


def adam_update(params, grads, state: Adam, lr, b1=0.9, b2=0.999, eps=1e-8):
    step = state.step + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
    c1 = 1 - b1 ** step.astype(jnp.float32)
    c2 = 1 - b2 ** step.astype(jnp.float32)
    params = jax.tree.map(lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), params, mu, nu)
    return params, Adam(step, mu, nu)
