"""Distributed rollouts: a learner and N workers moving JAX arrays every iteration.

Run ``python -m jaxtransport.rollouts --help``. Each iteration:

1. the learner broadcasts the policy parameters (``Pool.share`` / ``ray.put``; ``--param-mb``
   MiB of float32),
2. every worker runs ``--envs`` CartPole environments for ``--steps`` steps in one jitted,
   vmapped ``lax.scan``, acting from rendered pixel frames, and returns the trajectory (frames,
   actions, rewards, episode boundaries) as jax arrays,
3. the learner recomputes the policy's inputs from the returned frames and takes one REINFORCE
   step (Adam), so the return improves over the iterations.

Time is split honestly: *compute* is measured inside the workers (the slowest worker, the
critical path when every worker has its own core), *learner* is the update step, and
*transport* is everything else in the iteration's wall time (broadcast, task dispatch, results
back, decoding). ``--compare`` runs the same seed through the stock transport
(``multiprocessing.Pool`` with spawn / Ray's default serialization) and through jaxtransport, and
prints the speedup.

``--env pong`` (any ALE game; the ``atari`` extra) replaces CartPole by Atari through
gymnasium and ale-py: each actor steps a batch of ALE environments in Python (the GIL-bound
case processes exist for), acts with a small convolutional policy, and sends stacked frames;
``--backend threads`` runs the same actors as threads with ``queue.Queue`` (the
cleanba/Sebulba design), the baseline ``benchmarks/rollouts_atari.py`` compares with.
``--engine envpool`` (the ``envpool`` extra) steps the same games with envpool's C++ pool,
GIL released; with ``--backend threads`` that is cleanba's stack
(``benchmarks/rollouts_engines.py``).

The parts live in private modules: ``_cli`` (the loop and the command line), ``_config`` (the
run's configuration and measurements), ``_env`` (CartPole and its renderer),
``_policy`` (tile-coded MLP, REINFORCE, Adam), ``_worker`` (the jitted
rollout and learner step), ``_ale`` (an Atari actor's rollout loop and records), ``_atari``
(ALE environments through gymnasium), ``_envpool`` (the same through envpool) and ``_conv`` (the Atari
policy and learner step), ``_backends`` (Pool / Ray / streaming queue, jaxtransport / stock;
threads) and ``_report`` (progress bar and tables).
"""

from ._cli import main as main
from ._cli import train as train
from ._config import Config as Config
from ._config import IterationStats as IterationStats
from ._config import RunResult as RunResult

__all__ = ["Config", "IterationStats", "RunResult", "main", "train"]
