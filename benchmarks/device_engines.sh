#!/usr/bin/env bash
# On the accelerator host (no network), from the repository root: Pong through envpool at 1, 2,
# 4, 8 and 12 actors, learner on the chip (benchmarks/rollouts_engines.py), results in $OUT.
# Needs the stripped bundle .wheels-atari/ (python -m benchmarks.atari_bundle build WHEELS, on a
# machine with network; carried with the tree). The gymnasium engine needs ale-py and OpenCV
# (about 51 MiB of wheels), which the bundle leaves out: its rows run only where they are.
#   ACTORS=1,2 ITERATIONS=12 benchmarks/device_engines.sh   # smaller (one command: at most 10 minutes)
#   ENGINE=gymnasium ACTORS=12 ITERATIONS=8 benchmarks/device_engines.sh   # one engine only
#   ENGINE=envpool ACTORS=12 ITERATIONS=24 RUNS=queue/jaxtransport REPEAT=3 benchmarks/device_engines.sh
#     # some rows only (the limit always runs), the whole set measured REPEAT times
#   LEARN=1 ACTORS=12 ITERATIONS=300 GAME=breakout benchmarks/device_engines.sh   # the return over a long
#     run instead (benchmarks/rollouts_learning.py: every backend from the same seed; the first actor
#     count only; RUNS=threads,queue/jaxtransport picks backends)
# Runs of other actor counts merge into one results file afterwards:
#   python -m benchmarks.rollouts_engines --merge DIR1 DIR2 --name rollouts_engines_tpu --out benchmarks/results
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder the results go to}
ACTORS=${ACTORS:-1,2,4,8,12}
ITERATIONS=${ITERATIONS:-30}
PY=${PYTHON:-}
if [ -z "$PY" ]; then  # the Python that has JAX (PYTHON overrides)
  for c in python python3; do
    if command -v "$c" >/dev/null && "$c" -c 'import jax' 2>/dev/null; then PY=$c; break; fi
  done
fi
PY=${PY:?no python with jax found: set PYTHON}
site=$(mktemp -d "${TMPDIR:-/tmp}/jaxtransport-atari.XXXXXX")
trap 'rm -rf "$site"' EXIT
"$PY" -m benchmarks.atari_bundle install "$site"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
"$PY" -c 'import jax; print("learner device:", jax.devices()[0])'
"$PY" -m benchmarks.atari_bundle check --game "${GAME:-pong}"
engines="--engine envpool"
if "$PY" -c 'import ale_py, cv2, gymnasium' 2>/dev/null; then engines=""; fi
if [ -n "${ENGINE:-}" ]; then engines="--engine $ENGINE"; fi
if [ -n "${LEARN:-}" ]; then  # the return over a long run, every backend (benchmarks/rollouts_learning.py)
  "$PY" -m benchmarks.rollouts_learning --actors "${ACTORS%%,*}" --iterations "$ITERATIONS" --out "$OUT" \
    --name "${NAME:-rollouts_learning}" --game "${GAME:-pong}" ${RUNS:+--runs "$RUNS"} \
    2>&1 | grep -v -e '^A.L.E: Arcade' -e '^\[Powered by Stella\]' | tee "$OUT/${NAME:-rollouts_learning}.log"
  exit
fi
"$PY" -m benchmarks.rollouts_engines $engines --actors "$ACTORS" --iterations "$ITERATIONS" --out "$OUT" \
  --name "${NAME:-rollouts_engines}" ${RUNS:+--runs "$RUNS"} ${REPEAT:+--repeat "$REPEAT"} \
  2>&1 | grep -v -e '^A.L.E: Arcade' -e '^\[Powered by Stella\]' | tee "$OUT/${NAME:-rollouts_engines}.log"
