"""benchmarks/rollouts_learning.py without training: a run's iterations cut into windows, and the
verdict on whether the return went up (more than twice the standard error of the difference,
with enough episodes on each side). Fast: no environment, no JAX."""

from __future__ import annotations

import math

from benchmarks import rollouts_learning as learning
from jaxtransport.rollouts._config import IterationStats


def _its(returns_and_episodes, steps=512):
    return [IterationStats(i, r, k, steps, 0, 1.0, 0.5, 0.1, 0.4) for i, (r, k) in enumerate(returns_and_episodes)]


def test_windows_weigh_each_iteration_by_its_episodes_and_skip_those_without():
    its = _its([(-21.0, 2), (0.0, 0), (-19.0, 6), (-10.0, 1), (-12.0, 3), (-11.0, 0), (-9.0, 4)])
    parts = learning.windows(its, 3)
    assert [p["iterations"] for p in parts] == [2, 2, 3]  # the last takes the remainder
    assert parts[0]["mean_return"] == -21.0 and parts[0]["episodes"] == 2
    assert math.isclose(parts[1]["mean_return"], (-19.0 * 6 - 10.0) / 7)
    assert math.isclose(parts[2]["mean_return"], (-12.0 * 3 - 9.0 * 4) / 7)
    assert [p["env_steps"] for p in parts] == [1024, 2048, 3584]
    assert [p["wall_s"] for p in parts] == [2.0, 4.0, 7.0]


def test_a_window_with_no_episode_has_no_mean():
    parts = learning.windows(_its([(0.0, 0), (0.0, 0), (-20.0, 3), (-18.0, 3)]), 2)
    assert parts[0]["mean_return"] is None and parts[0]["episodes"] == 0


def test_learns_needs_a_rise_beyond_the_noise_and_enough_episodes():
    flat = _its([(-20.0, 5), (-21.0, 5)] * 4)
    parts = learning.windows(flat, 2)
    assert learning.learns(parts[0], parts[1])[0] is False
    rising = _its([(-21.0, 5), (-20.0, 5), (-21.0, 5), (-20.0, 5), (-15.0, 5), (-14.0, 5), (-15.0, 5), (-14.0, 5)])
    parts = learning.windows(rising, 2)
    verdict, diff = learning.learns(parts[0], parts[1])
    assert verdict is True and math.isclose(diff, 6.0)
    few = learning.windows(_its([(-21.0, 2), (-10.0, 2)]), 2)
    assert learning.learns(few[0], few[1]) == ("too few episodes", None)


def test_check_targets_gives_each_backend_its_verdict():
    rows = []
    for name, verdict, (a, b) in (("threads", True, (-21.0, -15.0)), ("queue/stock", "too few episodes", (-21.0, -21.0))):
        for w, r in ((1, a), (2, b)):
            rows.append({"transport": name, "window": w, "mean_return": r, "episodes": 20 if verdict is True else 3,
                         "env_steps": 1000 * w, "learns": verdict})
    lines = learning.check_targets(rows)
    assert lines[0].startswith("PASS threads: mean return -21.00 (20 episodes)") and "-15.00" in lines[0]
    assert lines[1].startswith("MISS queue/stock: too few episodes"), lines[1]


def test_a_window_whose_episodes_all_ended_in_one_iteration_has_no_standard_error():
    parts = learning.windows(_its([(-21.0, 12), (0.0, 0), (-10.0, 6), (-9.0, 6)]), 2)
    assert parts[0]["return_se"] is None and parts[1]["return_se"] is not None
    assert learning.learns(parts[0], parts[1]) == ("too few iterations with episodes", None)
