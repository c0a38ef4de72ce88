"""The rollouts demo's envpool engine (``--engine envpool``) and cleanba's stack (actor threads
over envpool), at small sizes.

Needs the ``envpool`` extra; the comparisons with the gymnasium engine also need the ``atari``
extra. (The actor's trajectory layout and repeatability, for either engine:
``tests/test_rollouts_atari.py``.) Every test here skips, saying why, where one is missing (except the missing-extra
message itself, which needs neither).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxtransport import rollouts
from jaxtransport.rollouts import _atari as atari

from .conftest import ROOT

_NO_GYM = atari.available("gymnasium")
requires_gymnasium = pytest.mark.skipif(_NO_GYM is not None, reason=f"the atari extra is not installed: {_NO_GYM}")


def _envpool():
    return pytest.importorskip(
        "envpool", reason="the envpool extra is not installed (pip install 'jaxtransport[envpool]')"
    )


def _spec(engine: str, envs: int = 3, frame_size: int = 36, seed: int = 0) -> atari.Spec:
    return atari.Spec(atari.game_id("pong", engine), envs, frame_size, seed, engine)


def test_missing_envpool_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "envpool", None)  # import envpool raises ImportError
    assert "pip install 'jaxtransport[envpool]'" in atari.available("envpool")
    with pytest.raises(ImportError, match=r"pip install 'jaxtransport\[envpool\]'"):
        atari.make_actor(atari.Spec("Pong-v5", 1, 36, 0, "envpool"), 0)
    with pytest.raises(ValueError, match="--engine must be one of"):
        atari.available("nosuchengine")


def test_engine_flag_is_checked_before_any_work():
    environ = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "jaxtransport.rollouts", "--engine", "envpool", "--iterations", "1"],
                          env=environ, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--engine envpool steps Atari games" in proc.stderr, proc.stderr


def test_game_names():
    _envpool()
    for name in ("pong", "Pong", "ALE/Pong-v5", "Pong-v5"):
        assert atari.game_id(name, "envpool") == "Pong-v5"
    assert atari.game_id("space_invaders", "envpool") == "SpaceInvaders-v5"
    with pytest.raises(ValueError, match="--env 'nosuchgame': envpool has no Atari game"):
        atari.game_id("nosuchgame", "envpool")


@requires_gymnasium
def test_envpool_engine_observes_and_acts_as_the_gymnasium_engine():
    """The same observations (4 stacked S x S uint8 grayscale frames, the same grayscale and
    resize: Pong's background is the same gray), the same action set, and envpool's options
    set to gymnasium's ALE/Pong-v5 ones where they differ by default (sticky actions, no-ops,
    no FIRE at reset, no life loss, unclipped rewards, the episode limit)."""
    _envpool()
    import gymnasium

    from jaxtransport.rollouts import _envpool as ep

    actors = {e: atari.make_actor(_spec(e), 0) for e in atari.ENGINES}
    try:
        gym_obs, pool_obs = actors["gymnasium"]._obs, actors["envpool"]._obs
        assert pool_obs.shape == gym_obs.shape == (3, atari.STACK, 36, 36)
        assert pool_obs.dtype == gym_obs.dtype == np.uint8
        assert actors["envpool"].actions == actors["gymnasium"].actions == atari.num_actions("ALE/Pong-v5")

        def background(obs):
            values, counts = np.unique(obs, return_counts=True)
            return int(values[np.argmax(counts)])

        assert background(pool_obs) == background(gym_obs)
        config = actors["envpool"]._envs.spec.config
    finally:
        for a in actors.values():
            a.close()
    kwargs = gymnasium.spec("ALE/Pong-v5").kwargs
    assert config.repeat_action_probability == kwargs["repeat_action_probability"] == ep.STICKY
    assert config.full_action_space is bool(kwargs.get("full_action_space", False)) is False
    assert config.max_episode_steps * atari.FRAME_SKIP == kwargs["max_num_frames_per_episode"]
    assert (config.frame_skip, config.noop_max, config.stack_num) == (atari.FRAME_SKIP, atari.NOOP_MAX, atari.STACK)
    assert not config.use_fire_reset and not config.episodic_life and not config.reward_clip
    assert config.num_threads == ep.THREADS == 1


def _tiny(backend: str, **kw) -> rollouts.Config:
    kw = {"workers": 2, **kw}
    return rollouts.Config.for_env("pong", engine="envpool", backend=backend, envs=2, steps=12,
                                   iterations=2, frame_size=36, hidden=16, warmup=0, **kw)


def test_cleanba_stack_threads_over_envpool_runs_and_repeats():
    """Actor threads, each with its own envpool, acting on this process's default device, the
    learner here: the loop runs, and on-policy (--max-lag 0) two runs with one seed end with
    the same parameters bit for bit (each run's threads build their envpools from the seed)."""
    _envpool()
    cfg = _tiny("threads", max_lag=0)
    runs = [rollouts.train(cfg, "none", out=io.StringIO(), err=io.StringIO()) for _ in range(2)]
    assert runs[0].params_sha256 == runs[1].params_sha256 != ""
    assert all(it.env_steps == 2 * 2 * 12 and it.act_s > 0 for it in runs[0].iterations)
    assert "2 threads" in runs[0].actor_devices


@pytest.mark.slow
def test_envpool_engine_through_jaxtransport_queue_on_the_command_line(capsys):
    """The envpool engine in actor processes through jaxtransport.multiprocessing, through the
    command line's entry point: the trajectories arrive, the learner updates, the report names
    the engine."""
    _envpool()
    args = ["--env", "pong", "--engine", "envpool", "--backend", "queue", "--workers", "1", "--iterations", "2",
            "--envs", "2", "--steps", "12", "--warmup", "0", "--frame-size", "36", "--hidden", "16"]
    assert rollouts.main(args) == 0
    out = capsys.readouterr().out
    assert "## Rollouts: pong through envpool, queue backend, 1 workers" in out, out
    assert "Pong-v5 through envpool (6 actions)" in out, out
    assert "| queue/jaxtransport |" in out, out


@pytest.mark.slow
def test_envpool_engine_through_jaxtransport_pool():
    """The envpool engine in a jaxtransport.Pool worker (the public API): each iteration's
    trajectory comes back with the steps asked for."""
    _envpool()
    res = rollouts.train(_tiny("pool", workers=1), "jaxtransport", out=io.StringIO(), err=io.StringIO())
    assert [it.env_steps for it in res.iterations] == [2 * 12] * 2
    assert all(it.act_s > 0 and it.bytes_moved > 2 * 12 * atari.STACK * 36 * 36 for it in res.iterations)


@pytest.mark.slow
def test_central_inference_through_jaxtransport_queues():
    """--inference learner (SEED RL): an actor process sends each step's observations to the
    learner's process and gets the actions back through jaxtransport.multiprocessing queues;
    every iteration's trajectory comes back whole, with the round trips as its acting time."""
    _envpool()
    cfg = _tiny("queue", inference="learner", workers=1)
    res = rollouts.train(cfg, "jaxtransport", out=io.StringIO(), err=io.StringIO())
    assert [it.env_steps for it in res.iterations] == [2 * 12] * 2
    assert all(0 < it.act_s < it.compute_s for it in res.iterations)


def test_central_inference_is_the_queue_backends():
    with pytest.raises(ValueError, match=r"--inference learner .* runs with --backend queue"):
        _tiny("threads", inference="learner").validate()
    with pytest.raises(ValueError, match=r"--inference learner .* runs with --backend queue"):
        rollouts.Config(backend="queue", inference="learner").validate()


def test_stepping_limit_and_targets():
    """benchmarks/rollouts_engines.py: the limit row steps real environments in actor
    processes; the targets compare jaxtransport's best row at the most actors with threads
    over envpool and with envpool's limit."""
    _envpool()
    from benchmarks import rollouts_engines as bench

    assert bench.stepping_limit("envpool", 1, 10) > 0
    row = {"actors": 2, "load": "1.0-1.0"}
    rows = [dict(row, transport="envpool threads", backend="threads", env_steps_per_s=100.0),
            dict(row, transport="envpool limit", backend="limit", env_steps_per_s=200.0),
            dict(row, transport="envpool queue/jaxtransport", backend="queue/jaxtransport", env_steps_per_s=160.0),
            dict(row, transport="envpool queue/stock", backend="queue/stock", env_steps_per_s=190.0),
            dict(row, actors=1, transport="envpool pool/jaxtransport", backend="pool/jaxtransport",
                 env_steps_per_s=1e6)]
    lines = bench.check_targets(rows)
    assert lines[0].startswith("PASS 2 actors: best jaxtransport row (envpool queue/jaxtransport)"), lines
    assert lines[1].startswith("PASS 2 actors: envpool queue/jaxtransport = 80% of envpool's"), lines
    rows[2]["env_steps_per_s"] = 140.0
    assert [line[:4] for line in bench.check_targets(rows)] == ["MISS", "MISS"]


def test_merged_runs_are_ordered_by_actor_count(tmp_path):
    """benchmarks/rollouts_engines.py --merge: rows of runs of other actor counts and engines
    (one device command each, in any order) come out by actor count, each run's order kept
    within a count; a count and engine measured twice is refused."""
    import json

    from benchmarks import rollouts_engines as bench

    def run(folder, engine, counts):
        rows = [{"name": "rollouts-engines-pong", "transport": f"{engine} {b}", "engine": engine, "backend": b,
                 "actors": n, "env_steps_per_s": 100.0 * n, "seconds": 1.0, "size_bytes": 0, "load": "0.0-0.0"}
                for n in counts for b in ("threads", "limit")]
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"rollouts_engines_{folder}.json").write_text(
            json.dumps({"rows": rows, "seconds": 1.0, "conditions": {}}))
        return str(tmp_path / folder)

    runs = [run("a", "envpool", (1, 12)), run("b", "gymnasium", (12,)), run("c", "gymnasium", (1, 2))]
    rows = bench.merge(runs, str(tmp_path / "out"), "merged")
    assert [(r["actors"], r["transport"]) for r in rows] == [
        (1, "envpool threads"), (1, "envpool limit"), (1, "gymnasium threads"), (1, "gymnasium limit"),
        (2, "gymnasium threads"), (2, "gymnasium limit"),
        (12, "envpool threads"), (12, "envpool limit"), (12, "gymnasium threads"), (12, "gymnasium limit")]
    assert json.loads((tmp_path / "out" / "merged.json").read_text())["seconds"] == 3.0
    with pytest.raises(SystemExit, match="more than once"):
        bench.merge([runs[0], run("d", "envpool", (12,))], str(tmp_path / "out2"), "merged")


def test_rows_picked_by_name_and_runs_repeated_have_their_own_verdicts():
    """benchmarks/rollouts_engines.py --runs picks rows by their backend's name (an unknown name
    is refused, naming the choices); --repeat's rows carry their run, and the targets are
    checked per run."""
    import argparse

    from benchmarks import rollouts_engines as bench

    assert bench._runs("queue/jaxtransport --max-lag 2, threads") == (bench.RUNS[0], bench.RUNS[2])
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown row .*queue/jt.*choose from threads"):
        bench._runs("queue/jt")
    rows = [{"actors": 12, "load": "0.0-0.0", "run": k, "transport": f"envpool {b}", "backend": b,
             "env_steps_per_s": v} for k, jt in ((1, 170.0), (2, 150.0))
            for b, v in (("queue/jaxtransport", jt), ("limit", 200.0))]
    lines = bench.check_targets(rows)
    assert [line.split(" 12 actors")[0] for line in lines] == ["run 1: PASS", "run 2: MISS"], lines
