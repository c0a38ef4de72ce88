#!/usr/bin/env bash
# The input-pipeline benchmark (benchmarks/pipeline.py, issue 51) on an accelerator host that has
# Python 3.11, JAX and numpy but no network: Grain, Pillow and what Grain needs come as wheels
# in the git-ignored .wheels-pipeline/ (made on a networked machine, see below), installed into
# a temporary folder, never into the host's Python. torch is not carried: its row is left out.
#
#   bash benchmarks/device_pipeline.sh WORKERS [OUT]
#
# runs one worker count (a run at 12 workers takes minutes; one command on the device machine
# may take 10), writing OUT/pipeline_device-WORKERS.{json,md} and OUT/pipeline-WORKERS.log
# (OUT: $OUT, else benchmarks/results/scratch). Then, wherever the three files are:
#
#   python -m benchmarks.pipeline --merge pipeline_device-2.json pipeline_device-6.json \
#       pipeline_device-12.json --name pipeline_device --out benchmarks/results
#   python -m benchmarks.publish
#
# The wheels (13 MiB; manylinux x86_64, CPython 3.11), made with:
#   pip download --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#     --python-version 3.11 --only-binary=:all: --no-deps -d .wheels-pipeline \
#     grain==0.2.18 pillow==13.0.0 array_record==0.8.6 protobuf==7.36.2 absl-py==2.5.1 \
#     cloudpickle==3.1.3 etils==1.15.0 fsspec==2026.9.0 portpicker==1.6.0 psutil==7.2.2 \
#     typing_extensions==4.16.0 zipp==4.1.2
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS=${1:?usage: bash benchmarks/device_pipeline.sh WORKERS [OUT]}
OUT=${2:-${OUT:-benchmarks/results/scratch}}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
ls .wheels-pipeline/*.whl > /dev/null || { echo "no wheels in .wheels-pipeline/ (see the top of this script)"; exit 1; }
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
if "$PY" -m pip --version > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" .wheels-pipeline/*.whl
else  # no pip: a wheel is a zip of what goes into site-packages
    for w in .wheels-pipeline/*.whl; do "$PY" -m zipfile -e "$w" "$SITE"; done
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import PIL, grain, jax; print('pillow', PIL.__version__, 'grain', grain.__version__ if hasattr(grain, '__version__') else '?', 'jax', jax.__version__)"
# The one-process row once (with 2 workers). At 2 workers REPS=1 fits one device command (10 minutes).
ONE=$([ "$WORKERS" = 2 ] || echo --no-one-process)
BATCHES=${BATCHES:-90}  # timed batches a phase: the window benchmarks/pipeline.py uses (Note [steady state])
"$PY" -m benchmarks.pipeline --workers "$WORKERS" --no-torch $ONE --batches "$BATCHES" --reps "${REPS:-3}" \
    --name "pipeline_device-$WORKERS" --out "$OUT" 2>&1 | tee "$OUT/pipeline-$WORKERS.log"
echo "/dev/shm now: $(ls /dev/shm | wc -l) entries"
