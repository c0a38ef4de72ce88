"""The Atari rollout loop (``_ale.Rollouts``) with a stand-in engine: no environments needed.

Acting reads each step's observations from 64-byte aligned memory: JAX's CPU client copies an
unaligned argument, which made an acting step 2.5 times slower on a TPU host's core
(``_copies.aligned_empty``).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxtransport import _copies
from jaxtransport.rollouts import _ale as ale
from jaxtransport.rollouts import _conv as conv


class _Counting(ale.Rollouts):
    """Environments whose observations are a function of the step and the actions taken."""

    def __init__(self, envs: int, frame_size: int):
        self.spec = ale.Spec("Stand-in", envs, frame_size, 0, "stand-in")
        self.index, self.actions, self._t = 0, 3, 0
        self._obs = self._frame(np.zeros(envs, np.int32))
        self._ep_return = np.zeros(envs, np.float32)

    def _frame(self, actions):
        e, s = self.spec.envs, self.spec.frame_size
        base = (self._t * 7 + actions[:, None, None, None] * 31 + np.arange(e)[:, None, None, None]) % 251
        return np.broadcast_to(base, (e, ale.STACK, s, s)).astype(np.uint8) + np.arange(s, dtype=np.uint8)

    def _step(self, actions):
        self._t += 1
        e = self.spec.envs
        done = np.arange(e) == self._t % (e + 1)
        return self._frame(actions), np.ones(e, np.float32), done, np.zeros(e, bool)

    def close(self):
        pass


@pytest.mark.parametrize("frame_size", [36, 30])  # a step's frames on a boundary (4 x 36^2), or not
def test_acting_reads_every_steps_observations_from_aligned_memory(frame_size):
    actor = _Counting(3, frame_size)
    seen = []

    def act(obs, t):
        seen.append((obs.ctypes.data % 64, obs.copy(), obs.ctypes.data))
        return np.full(3, t % 3, np.int32), np.zeros(3, np.float32)

    traj, carry, compute_s, act_s = actor.rollout({}, jax.random.key(0), 9, act=act)
    frames = np.asarray(traj.frames)
    assert [s[0] for s in seen] == [0] * 9, "an acting step got an unaligned array"
    for t, (_, obs, _) in enumerate(seen):
        np.testing.assert_array_equal(obs, frames[t])  # the step's observations, as sent
    np.testing.assert_array_equal(np.asarray(traj.actions), np.arange(9)[:, None].repeat(3, 1) % 3)
    addresses = {s[2] for s in seen}
    if frame_size == 36:  # read in place from the trajectory: no copy per step
        assert len(addresses) == 9
    else:  # copied into one aligned buffer
        assert len(addresses) == 1
    assert 0 <= act_s <= compute_s


def test_acting_from_aligned_memory_gives_the_same_actions():
    params = conv.init(jax.random.key(0), 6, 16, ale.STACK, 36)
    rng = np.random.default_rng(1)
    obs = rng.integers(0, 256, (4, ale.STACK, 36, 36), dtype=np.uint8)
    raw = np.empty(obs.nbytes + 64, np.uint8)
    off = (-raw.ctypes.data % 64) + 16  # 16 bytes past a boundary, as numpy's large allocations
    unaligned = raw[off : off + obs.nbytes].reshape(obs.shape)
    unaligned[...] = obs
    aligned = _copies.aligned_empty(obs.shape, np.uint8)
    aligned[...] = obs
    key = jax.random.key(2)
    a1, lp1 = conv.act(params, unaligned, key, np.int32(5))
    a2, lp2 = conv.act(params, aligned, key, np.int32(5))
    np.testing.assert_array_equal(np.asarray(a1), np.asarray(a2))
    np.testing.assert_array_equal(np.asarray(lp1), np.asarray(lp2))


@pytest.mark.parametrize(("shape", "dtype"), [((0,), np.float32), ((3, 5), np.uint8), ((7, 1 << 16), np.float64),
                                              ((), np.int16), ((2, 3), np.complex64)])
def test_aligned_empty_starts_on_a_boundary(shape, dtype):
    for align in (64, 4096):
        x = _copies.aligned_empty(shape, dtype, align)
        assert x.shape == shape and x.dtype == np.dtype(dtype) and x.flags.c_contiguous and x.flags.writeable
        if x.size:
            assert x.ctypes.data % align == 0
            x[...] = 1
            assert (x == 1).all()
