"""benchmarks/rollouts_scale.py without running the demo: which runs it plans, in which order,
how ``--configs`` filters them, and what its rows and target lines say from given measurements."""

from __future__ import annotations

import pytest

from benchmarks import rollouts_scale as scale
from jaxtransport.rollouts import _cpus


@pytest.fixture
def thirteen_cores(monkeypatch):
    monkeypatch.setattr(_cpus, "available", lambda: frozenset(range(13)))


def test_every_configuration_s_ends_and_the_target_s_check_run_first(thirteen_cores):
    runs = scale.plan_runs([2, 4, 8, 12], "tpu")
    key = [(r["backend"], r["learner"], r["actors"], r["budget"]) for r in runs]
    assert key[:3] == [("queue", "accel", 2, None), ("queue", "accel", 12, None), ("queue", "accel", 12, 0)]
    assert key[3:9] == [("pool", "accel", 2, None), ("pool", "accel", 12, None), ("queue", "cpu", 2, None),
                        ("queue", "cpu", 12, None), ("pool", "cpu", 2, None), ("pool", "cpu", 12, None)]
    # then the accelerator's middle counts and one actor alone, then the rest
    assert key[9:14] == [("queue", "accel", 4, None), ("queue", "accel", 8, None), ("queue", "accel", 1, None),
                         ("pool", "accel", 4, None), ("pool", "accel", 8, None)]
    assert len(runs) == 4 * 4 + 4 + 1 and len(set(key)) == len(key)
    checks = [r for r in runs if r["name"] == scale.BUDGET_CHECK]
    # At 12 actors on 13 cores the budget is on by default: the check turns it off.
    assert len(checks) == 4 and all(r["actors"] == 12 and r["budget"] == 0 for r in checks)
    assert all(r["budget"] is None for r in runs if r["name"] == scale.NAME)


def test_where_the_budget_is_off_by_default_the_check_turns_it_on(thirteen_cores):
    # 16 actors outnumber the 12 cores beside the learner's: no budget by default.
    checks = [r for r in scale.plan_runs([2, 16], None) if r["name"] == scale.BUDGET_CHECK]
    assert checks and all(r["budget"] == 1 and r["actors"] == 16 and r["learner"] == "cpu" for r in checks)


@pytest.mark.parametrize("tokens, kept", [
    (None, {"queue/accel", "pool/accel", "queue/cpu", "pool/cpu"}),
    (["queue"], {"queue/accel", "queue/cpu"}),
    (["tpu"], {"queue/accel", "pool/accel"}),
    (["accel"], {"queue/accel", "pool/accel"}),
    (["queue/tpu", "pool/cpu"], {"queue/accel", "pool/cpu"}),
    (["cpu"], {"queue/cpu", "pool/cpu"}),
])
def test_configs_filter(tokens, kept):
    every = ("queue/accel", "pool/accel", "queue/cpu", "pool/cpu")
    assert {c for c in every if scale._keep(c, "tpu", tokens)} == kept


def test_actor_counts_are_capped_by_the_cores_and_the_flag(monkeypatch):
    monkeypatch.setattr(scale._common, "usable_cores", lambda: 13)
    assert scale._counts(False, None, None) == [2, 4, 8, 12]
    assert scale._counts(False, 8, None) == [2, 4, 8]
    assert scale._counts(True, None, None) == [1, 2]
    monkeypatch.setattr(scale._common, "usable_cores", lambda: 6)
    assert scale._counts(False, None, None) == [2, 4]


def _got(actors, compute, learner, transport, budget=0, cpu=None):
    wall = compute + learner + transport
    n = 6
    return {"platform": "tpu", "learner_device": "TPU v5 lite (tpu)", "actor_devices": f"cpu ({actors} processes)",
            "trajectories_on": "TPU v5 lite (tpu)", "cpus_per_actor": budget, "cpu_budget": "x",
            "env_steps": actors * 2048, "lag": [1.0] * n, "startup_s": 10.0, "run_s": 20.0, "final_return": 30.0,
            "cores": 13,
            "iterations": {"wall_s": [wall] * n, "compute_s": [compute] * n, "compute_mean_s": [compute * 0.9] * n,
                           "learner_s": [learner] * n, "transport_s": [transport] * n,
                           "actor_cpu_s": [cpu if cpu is not None else compute * actors] * n,
                           "bytes_moved": [actors * 15 << 20] * n}}


def test_rows_and_a_miss_that_names_what_bounds_it():
    spec = {"backend": "queue", "learner": "accel", "budget": None, "name": scale.NAME}
    results = [
        (dict(spec, actors=2), _got(2, 0.05, 0.02, 0.01)),
        (dict(spec, actors=12), _got(12, 0.23, 0.03, 0.02, budget=1, cpu=12 * 0.23)),
        (dict(spec, actors=12, budget=0, name=scale.BUDGET_CHECK), _got(12, 0.25, 0.03, 0.02)),
        (dict(spec, backend="pool", actors=2), {"error": "exit 1: boom"}),
    ]
    rows = scale._rows(results, "tpu")
    two, twelve = rows[0], rows[1]
    assert two["transport"] == "queue, learner tpu" and two["ratio_vs_2"] == 1.0
    assert twelve["ratio_vs_2"] == pytest.approx((12 * 2048 / 0.28) / (2 * 2048 / 0.08))
    assert twelve["compute_vs_fewest"] == pytest.approx(0.23 / 0.05)
    assert twelve["actor_cores_busy"] == pytest.approx(12.0)
    assert twelve["cpu_budget"] == 1 and rows[2]["cpu_budget"] == 0
    assert rows[3]["error"] == "exit 1: boom" and "env_steps_per_s" not in rows[3]
    lines = scale.check_targets(rows)
    miss = next(line for line in lines if line.startswith(("PASS", "MISS")))
    assert miss.startswith("MISS queue, learner tpu: 12 actors")
    assert "bound: actor compute" in miss and "4.60x its time at 2 actors" in miss and "12.0 of 13 cores" in miss
    assert any(line.startswith("INFO CPU budget, queue, learner tpu, 12 actors: 1 core(s)") for line in lines)
    assert any(line.startswith("FAILED pool, learner tpu, 2 actors") for line in lines)


def test_without_an_accelerator_the_target_is_not_checked():
    spec = {"backend": "queue", "learner": "cpu", "budget": None, "name": scale.NAME}
    results = [(dict(spec, actors=1), _got(1, 0.1, 0.03, 0.0)), (dict(spec, actors=2), _got(2, 0.12, 0.03, 0.0))]
    rows = scale._rows(results, None)
    lines = scale.check_targets(rows)
    assert lines[0].startswith("SKIP") and rows[0]["ratio_vs_2"] == pytest.approx(rows[0]["env_steps_per_s"]
                                                                                  / rows[1]["env_steps_per_s"])
