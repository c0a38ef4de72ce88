"""CartPole in ``jax.numpy``, vectorized, with Atari-style pixel observations.

The physics are Gym's CartPole-v1 (Barto, Sutton & Anderson 1983): Euler integration at
``TAU`` = 0.02 s, failure when the pole leans past 12 degrees or the cart leaves +-2.4 m, reward
1 per step, episodes truncated at ``MAX_STEPS`` = 500. Environments reset themselves when an
episode ends (auto-reset), so every simulated step is a real environment step.

The agent observes pixels only: :func:`render` draws a grayscale ``uint8`` frame of the cart
(a filled rectangle on a track) and the pole (a thick segment), ``frame_size`` pixels square.
A frame costs about 10 float operations per pixel, so observations dominate the trajectory's
bytes (``frame_size**2`` per step) as they do in Atari-style rollouts, while the simulation
itself is cheap.

Everything here is a pure function of its inputs (no Python state), jit- and vmap-friendly.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

# Gym CartPole-v1 constants.
GRAVITY = 9.8
MASS_CART = 1.0
MASS_POLE = 0.1
TOTAL_MASS = MASS_CART + MASS_POLE
HALF_LENGTH = 0.5
POLE_MASS_LENGTH = MASS_POLE * HALF_LENGTH
FORCE_MAG = 10.0
TAU = 0.02
THETA_LIMIT = 12 * 2 * jnp.pi / 360
X_LIMIT = 2.4
MAX_STEPS = 500

# Rendering geometry, in world units: the frame spans x in [-VIEW_X, VIEW_X] horizontally.
VIEW_X = 2.8
CART_HALF_WIDTH = 0.25
CART_HEIGHT_FRAC = 0.08  # of the frame height
TRACK_ROW_FRAC = 0.80  # cart centre row, as a fraction of the height (top = 0)
POLE_PIXELS_FRAC = 0.42  # drawn pole length, as a fraction of the frame height
POLE_HALF_THICKNESS_FRAC = 0.022
CART_VALUE = 255
POLE_VALUE = 160


class EnvState(NamedTuple):
    """One environment (or a batch, with a leading axis on every field)."""

    x: jax.Array
    x_dot: jax.Array
    theta: jax.Array
    theta_dot: jax.Array
    steps: jax.Array  # steps taken in the current episode (int32)
    ep_return: jax.Array  # undiscounted return of the current episode so far (float32)


def reset(key: jax.Array) -> EnvState:
    """A fresh episode: the four physical variables uniform in [-0.05, 0.05]."""
    x, x_dot, theta, theta_dot = jax.random.uniform(key, (4,), jnp.float32, -0.05, 0.05)
    return EnvState(x, x_dot, theta, theta_dot, jnp.int32(0), jnp.float32(0))


def reset_batch(key: jax.Array, n: int) -> EnvState:
    return jax.vmap(reset)(jax.random.split(key, n))


def step(state: EnvState, action: jax.Array, key: jax.Array):
    """Advance one environment by one step; reset it when the episode ends.

    ``action`` is 0 (push left) or 1 (push right). Returns ``(next_state, reward, done,
    failed, finished_return)`` where ``done`` says the episode ended at this step (failure or
    truncation at ``MAX_STEPS``), ``failed`` that it ended by failure (a true terminal state;
    a truncated episode could have gone on), ``next_state`` is then a fresh episode, and
    ``finished_return`` is the ended episode's return (0 when ``done`` is false).
    """
    force = jnp.where(action == 1, FORCE_MAG, -FORCE_MAG)
    cos, sin = jnp.cos(state.theta), jnp.sin(state.theta)
    temp = (force + POLE_MASS_LENGTH * state.theta_dot**2 * sin) / TOTAL_MASS
    theta_acc = (GRAVITY * sin - cos * temp) / (HALF_LENGTH * (4.0 / 3.0 - MASS_POLE * cos**2 / TOTAL_MASS))
    x_acc = temp - POLE_MASS_LENGTH * theta_acc * cos / TOTAL_MASS
    x = state.x + TAU * state.x_dot
    x_dot = state.x_dot + TAU * x_acc
    theta = state.theta + TAU * state.theta_dot
    theta_dot = state.theta_dot + TAU * theta_acc
    steps = state.steps + 1
    ep_return = state.ep_return + 1.0
    failed = (jnp.abs(x) > X_LIMIT) | (jnp.abs(theta) > THETA_LIMIT)
    done = failed | (steps >= MAX_STEPS)
    stepped = EnvState(x, x_dot, theta, theta_dot, steps, ep_return)
    fresh = reset(key)
    next_state = jax.tree.map(lambda a, b: jnp.where(done, a, b), fresh, stepped)
    return next_state, jnp.float32(1.0), done, failed, jnp.where(done, ep_return, 0.0)


def _geometry(frame_size: int):
    size = float(frame_size)
    track_row = TRACK_ROW_FRAC * size
    cart_half_h = 0.5 * CART_HEIGHT_FRAC * size
    pole_len = POLE_PIXELS_FRAC * size
    pole_half_t = max(POLE_HALF_THICKNESS_FRAC * size, 0.75)
    px_per_m = size / (2 * VIEW_X)
    return track_row, cart_half_h, pole_len, pole_half_t, px_per_m


def render(state: EnvState, frame_size: int) -> jax.Array:
    """A ``(frame_size, frame_size)`` ``uint8`` frame of one environment.

    The cart is a rectangle (value 255) centred on row ``0.8 * frame_size``; the pole a thick
    segment (value 160) from the cart's top centre, leaning by ``theta``; the background is 0.
    Edges are anti-aliased (a pixel's value is proportional to how much of it is covered), so
    positions can be read back to a fraction of a pixel, as from a real camera.
    """
    track_row, cart_half_h, pole_len, pole_half_t, px_per_m = _geometry(frame_size)
    rows = jnp.arange(frame_size, dtype=jnp.float32)[:, None] + 0.5
    cols = jnp.arange(frame_size, dtype=jnp.float32)[None, :] + 0.5
    cx = (state.x + VIEW_X) * px_per_m
    cover_c = jnp.clip(CART_HALF_WIDTH * px_per_m + 0.5 - jnp.abs(cols - cx), 0.0, 1.0)
    cover_r = jnp.clip(cart_half_h + 0.5 - jnp.abs(rows - track_row), 0.0, 1.0)
    cart = cover_c * cover_r
    # Pole: distance from each pixel centre to the segment base -> tip.
    base_r, base_c = track_row - cart_half_h, cx
    dir_r, dir_c = -jnp.cos(state.theta), jnp.sin(state.theta)
    rel_r, rel_c = rows - base_r, cols - base_c
    along = jnp.clip(rel_r * dir_r + rel_c * dir_c, 0.0, pole_len)
    dist = jnp.sqrt((rel_r - along * dir_r) ** 2 + (rel_c - along * dir_c) ** 2)
    pole = jnp.clip(pole_half_t + 0.5 - dist, 0.0, 1.0) * (rows < base_r)
    frame = jnp.maximum(cart * CART_VALUE, pole * POLE_VALUE)
    return jnp.round(frame).astype(jnp.uint8)


def scene_rows(frame_size: int) -> tuple[int, int]:
    """``(first, stop)``: :func:`render` draws only on rows ``first:stop``, from the highest the
    pole's tip reaches to the bottom of the cart (about half the frame), a row of margin each
    side."""
    track_row, cart_half_h, pole_len, pole_half_t, _ = _geometry(frame_size)
    first = max(math.floor(track_row - cart_half_h - pole_len - pole_half_t - 1.5), 0)
    stop = min(math.ceil(track_row + cart_half_h + 1.5), frame_size)
    return first, stop


# Frames read per block by the learner's read_frame: the float32 copy of a block (~1.8 MiB at
# 84x84) is reused from the heap, where one of a whole rollout (~50 MiB) would be fresh pages
# on every update.
_READ_BLOCK = 128


def read_frame(frame: jax.Array, frame_size: int) -> jax.Array:
    """Read the cart position and pole angle back from frames (the policy's fixed encoder).

    ``frame`` is ``(..., S, S)`` ``uint8``; returns ``(..., 2)`` float32 ``(x, theta)``
    estimates from intensity moments: the column centroid of the cart's band gives ``x``; the
    centroid of the pixels above it, relative to the cart's top centre, gives ``theta``. The
    estimates carry the (anti-aliased) pixel grid's quantization noise, as any pixel-based
    agent's do. Costs two multiply-adds per pixel of the rows the scene can occupy.

    More than ``_READ_BLOCK`` frames (the learner reads a whole rollout) are read a block at a
    time (``lax.map``): a single pass would materialize a float32 copy of every frame, tens of
    MB of temporary memory that XLA maps afresh, and pays first-touch page faults for, on every
    learner step.
    """
    lead = frame.shape[:-2]
    n = math.prod(lead)
    if n <= _READ_BLOCK:
        return _read_frame_block(frame, frame_size)
    flat = frame.reshape((n,) + frame.shape[-2:])
    blocks = -(-n // _READ_BLOCK)
    flat = jnp.pad(flat, ((0, blocks * _READ_BLOCK - n), (0, 0), (0, 0)))
    out = jax.lax.map(
        lambda b: _read_frame_block(b, frame_size), flat.reshape((blocks, _READ_BLOCK) + frame.shape[-2:])
    )
    return out.reshape((blocks * _READ_BLOCK, 2))[:n].reshape(lead + (2,))


def _read_frame_block(frame: jax.Array, frame_size: int) -> jax.Array:
    track_row, cart_half_h, _, _, px_per_m = _geometry(frame_size)
    top = track_row - cart_half_h
    first, stop = scene_rows(frame_size)  # only the rows the renderer can draw on are read
    r0 = math.ceil(top - 0.5) - first  # first row of the cart's band (centre at/below its top)
    centres = jnp.arange(frame_size, dtype=jnp.float32) + 0.5
    rows = frame[..., first:stop, :]
    # Per-row intensity moments (mass, column moment) as one matrix product: XLA's CPU
    # reductions over a multiplied operand are several times slower than this GEMM.
    flat = rows.reshape(-1, frame_size).astype(jnp.float32)
    moments = (flat @ jnp.stack([jnp.ones_like(centres), centres], 1)).reshape(rows.shape[:-1] + (2,))
    mass, col = moments[..., 0], moments[..., 1]
    cart_mass = jnp.maximum(mass[..., r0:].sum(-1), 1e-3)
    pole_mass = jnp.maximum(mass[..., :r0].sum(-1), 1e-3)
    cx = col[..., r0:].sum(-1) / cart_mass
    pc = col[..., :r0].sum(-1) / pole_mass
    pr = (mass[..., :r0] * centres[first : first + r0]).sum(-1) / pole_mass
    theta = jnp.arctan2(pc - cx, top - pr)
    return jnp.stack([cx / px_per_m - VIEW_X, theta], axis=-1)


def features(prev: jax.Array, cur: jax.Array) -> jax.Array:
    """``(x, x_dot, theta, theta_dot)`` from two consecutive :func:`read_frame` readings: the
    velocities are differences over the frame interval ``TAU``."""
    x0, th0 = prev[..., 0], prev[..., 1]
    x1, th1 = cur[..., 0], cur[..., 1]
    return jnp.stack([x1, (x1 - x0) / TAU, th1, (th1 - th0) / TAU], axis=-1)
