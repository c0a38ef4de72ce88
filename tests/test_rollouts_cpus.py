"""The rollouts' CPU budget (``--cpus-per-actor``) and device report: which cores each actor
gets (a pure plan), that a spawned actor really runs on them, sized its XLA thread pool to them,
and says so; the learner's and the actors' devices in the report."""

from __future__ import annotations

import io
import os

import pytest

from jaxtransport import rollouts
from jaxtransport.rollouts import _backends as backends
from jaxtransport.rollouts import _cpus as cpus
from jaxtransport.rollouts import _report as report
from jaxtransport.rollouts import _worker as worker

from .test_rollouts import TINY, _cli, _Inline

LINUX_AFFINITY = hasattr(os, "sched_setaffinity") and cpus.available() is not None
# A worker's rollout shapes, small: (table rows, hidden, envs, frame size, steps).
WARM = (64, 16, 4, 24, 16)


# ------------------------------------------------------------------------------------------
# the plan


def test_each_actor_gets_disjoint_cores_and_the_learner_keeps_the_rest():
    b = cpus.plan(4, 3, range(13))
    assert b.on and not b.shared and b.per_actor == 3
    assert b.learner_cpus == (0,)
    assert b.actor_cpus == ((1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12))
    b = cpus.plan(2, 2, range(13))
    assert b.learner_cpus == tuple(range(9))  # every core no actor gets
    flat = [c for s in b.actor_cpus for c in s]
    assert len(flat) == len(set(flat)) == 4 and not set(flat) & set(b.learner_cpus)
    assert b.env() == {"PJRT_NPROC": "2", "OMP_NUM_THREADS": "2"}
    assert "2 cores per actor" in b.describe() and "the learner keeps cores 0-8" in b.describe()


def test_the_cores_are_this_process_s_wherever_they_are_numbered():
    b = cpus.plan(3, 1, {4, 9, 17, 30})
    assert b.learner_cpus == (4,) and b.actor_cpus == ((9,), (17,), (30,))


def test_automatic_budget_whenever_each_actor_gets_a_core_beside_the_learner_s():
    b = cpus.plan(12, None, range(13))
    assert b.on and b.per_actor == 1 and not b.shared
    assert b.learner_cpus == (0,) and sorted(c for s in b.actor_cpus for c in s) == list(range(1, 13))
    assert "automatic" in b.describe()
    # 4 actors on 5 cores: one each; on 9 cores two each (the learner keeps core 0); 2 actors on
    # 13 cores: six each. Without a budget each actor's XLA sized its pools to every core.
    assert cpus.plan(4, None, range(5)).per_actor == 1
    two = cpus.plan(4, None, range(9))
    assert two.on and two.per_actor == 2 and two.learner_cpus == (0,)
    assert two.env() == {"PJRT_NPROC": "2", "OMP_NUM_THREADS": "2"}
    assert cpus.plan(2, None, range(13)).actor_cpus == ((1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11, 12))
    off = cpus.plan(4, 0, range(9))
    assert not off.on and off.env() == {}
    # One actor competes with nothing; more actors than cores beside the learner's would share.
    assert not cpus.plan(1, None, range(2)).on
    crowded = cpus.plan(2, None, range(2))
    assert not crowded.on and "outnumber" in crowded.describe()


def test_fewer_cores_than_asked_are_shared_round_robin_with_a_note():
    b = cpus.plan(5, 1, range(4))
    assert b.on and b.shared and b.learner_cpus == (0,)
    assert b.actor_cpus == ((1,), (2,), (3,), (1,), (2,))
    assert "actors share cores" in b.describe()
    b = cpus.plan(3, 2, range(4))  # 6 cores asked, 3 beside the learner's
    assert b.shared and all(len(s) == 2 and 0 not in s for s in b.actor_cpus)
    assert b.actor_cpus == ((1, 2), (1, 3), (2, 3))


def test_no_budget_when_asked_or_where_processes_cannot_be_pinned():
    assert not cpus.plan(12, 0, range(13)).on
    assert "--cpus-per-actor 0" in cpus.plan(12, 0, range(13)).describe()
    none = cpus.plan(12, None, None)
    assert not none.on and "cannot pin" in none.describe()
    assert not cpus.plan(2, 1, [0]).on  # one core: nothing to split
    with pytest.raises(ValueError, match="--cpus-per-actor"):
        cpus.plan(2, -1, range(4))
    with pytest.raises(ValueError, match="--cpus-per-actor"):
        rollouts.Config(cpus_per_actor=-1).validate()


def test_no_pinning_on_the_portable_paths_or_without_affinity_masks(monkeypatch):
    from jaxtransport._os import _mode

    monkeypatch.setattr(_mode, "_mode", _mode.PORTABLE)
    assert cpus.available() is None and not cpus.apply([0])
    monkeypatch.setattr(_mode, "_mode", _mode.AUTO)
    monkeypatch.delattr(os, "sched_setaffinity", raising=False)
    assert cpus.available() is None and not cpus.apply([0])
    assert not cpus.apply(None) and not cpus.apply(())


def test_only_the_backends_whose_actors_are_local_processes_are_pinned():
    b = cpus.plan(2, 1, range(4))
    assert b.for_backend("pool") is b and b.for_backend("queue") is b
    assert not b.for_backend("ray").on and "Ray" in b.for_backend("ray").describe()
    assert not b.for_backend("threads").on


def test_worker_env_sizes_the_pools_and_sends_the_actors_to_the_cpu_beside_an_accelerator(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    b = cpus.plan(2, 2, range(8))
    env = backends.worker_env(2, b, learner_platform="tpu")
    assert env["JAX_PLATFORMS"] == "cpu" and env["PJRT_NPROC"] == "2" and env["OMP_NUM_THREADS"] == "2"
    assert "XLA_FLAGS" not in env  # the budget sizes the pools; no flag on top
    env = backends.worker_env(2, None, learner_platform="cpu")
    assert "JAX_PLATFORMS" not in env and "PJRT_NPROC" not in env


def test_the_actors_reports_show_a_budget_that_did_not_take():
    b = cpus.plan(2, 1, range(3))
    assert b.unapplied([(1,), (2,)]) == ""
    assert b.unapplied([(1,), (0, 1, 2)]) == "not applied in 1 of 2 actors (one reports cores 0-2)"
    assert cpus.Budget().unapplied([(0, 1)]) == ""


def test_pool_workers_claim_a_slot_each_and_a_latecomer_gets_them_all(tmp_path):
    pc = cpus.PoolCpus(((1,), (2, 3)), str(tmp_path))
    assert pc.claim() == (1,) and pc.claim() == (2, 3) and pc.claim() == (1, 2, 3)
    pc.remove()
    assert not tmp_path.exists()


# ------------------------------------------------------------------------------------------
# real actors


def _eigen_threads() -> int:
    """XLA's CPU compute threads in this process (a pool task)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == "tf_XLAEigen"
        except OSError:
            pass
    return n


def _async_dispatch() -> bool | None:
    """Whether JAX dispatches CPU computations to a thread of its own in this process (a pool
    task); None for a JAX without the setting."""
    import jax

    return jax.config.values.get("jax_cpu_enable_async_dispatch")


def _two_disjoint() -> cpus.Budget:
    """One core each for two actors on this machine (the learner's excluded where it has more
    than two cores; on two, each actor one of them, which is the test's point)."""
    cores = sorted(cpus.available() or ())
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    return cpus.Budget(1, ((cores[-2],), (cores[-1],)), (cores[0],), False, "test")


@pytest.mark.skipif(not LINUX_AFFINITY, reason="no sched_setaffinity on this host")
@pytest.mark.parametrize("backend, transport", [("pool", "jaxtransport"), ("pool", "stock"), ("queue", "jaxtransport")])
def test_spawned_actors_run_on_their_assigned_cores(backend, transport):
    """Each actor pins itself before JAX starts there, and its own report (``sched_getaffinity``
    read in the actor) is what was assigned; a Pool's workers each claimed a different set."""
    budget = _two_disjoint()
    with backends.make(backend, transport, 2, warm=WARM, timeout=240.0, budget=budget) as be:
        be.wait_ready()
        got = sorted(a.cpus for a in be.actors)
        assert got == sorted(budget.actor_cpus), (got, budget)
        assert all(a.platform == "cpu" for a in be.actors)
        assert len({a.pid for a in be.actors}) == 2
        if backend == "pool" and transport == "jaxtransport":
            # The budget reached XLA: one compute thread per worker, not one per core.
            assert be._pool.apply(_eigen_threads) == 1
        if backend == "pool":
            # And the worker runs its CPU computations on the calling thread (Note [acting inline]).
            assert be._pool.apply(_async_dispatch) in (False, None)


@pytest.mark.skipif(not LINUX_AFFINITY, reason="no sched_setaffinity on this host")
def test_without_a_budget_actors_keep_every_core():
    with backends.make("pool", "jaxtransport", 1, warm=WARM, timeout=240.0, budget=cpus.Budget()) as be:
        be.wait_ready()
        assert [a.cpus for a in be.actors] == [tuple(sorted(cpus.available() or ()))]


# ------------------------------------------------------------------------------------------
# the report


def test_devices_are_named_as_jax_reports_them():
    assert report.describe_device("tpu", "TPU v5 lite") == "TPU v5 lite (tpu)"
    assert report.describe_device("cpu", "cpu") == "cpu"
    infos = [worker.ActorInfo(1, "cpu", "cpu", (1,)), worker.ActorInfo(2, "cpu", "cpu", (2,))]
    assert report.actor_devices(infos, "pool") == "cpu (2 processes)"
    assert report.actor_devices(infos[:1], "ray") == "cpu (1 Ray actor)"
    line = report.devices_line("TPU v5 lite (tpu)", "cpu (2 processes)")
    assert line == "learner: TPU v5 lite (tpu); actors: cpu (2 processes)"
    assert line in report.environment("TPU v5 lite (tpu)", "cpu (2 processes)")


class _InlineTasks(_Inline):
    """The loop's tasks run in this process, through the workers' entry point."""

    def map(self, handle, tasks):
        return [worker.run_task(handle, *t) for t in tasks]


def test_a_run_records_its_devices_budget_and_the_actors_cpu_time(monkeypatch):
    monkeypatch.setattr(backends, "make", _InlineTasks)
    cfg = rollouts.Config(workers=2, envs=4, steps=16, frame_size=24, param_mb=1, hidden=16, iterations=2,
                          cpus_per_actor=0)
    r = rollouts.train(cfg, "jaxtransport", out=io.StringIO(), err=io.StringIO())
    assert r.learner_device == "cpu" and r.trajectories_on == "cpu" and r.params_on == "cpu"
    assert r.cpus_per_actor == 0 and r.cpu_budget == "off (--cpus-per-actor 0)"
    it = r.iterations[-1]
    assert it.compute_mean_s is not None and 0 < it.compute_mean_s <= it.compute_s
    assert it.actor_cpu_s is not None and it.actor_cpu_s > 0
    text = report.summary_table([r])
    assert "learner: cpu" in text and "CPU budget: off (--cpus-per-actor 0)" in text


def test_cli_reports_devices_and_budget_and_rejects_a_negative_one():
    proc = _cli(*TINY, "--cpus-per-actor", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "learner: cpu; actors: cpu (2 processes)" in proc.stdout, proc.stdout
    assert "CPU budget: " in proc.stdout
    proc = _cli("--cpus-per-actor", "-1")
    assert proc.returncode == 2 and "--cpus-per-actor must be >= 0" in proc.stderr
