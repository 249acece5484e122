#!/usr/bin/env bash
# The GPU tier, on a machine with a CUDA device and no network.
# The project runs from PYTHONPATH (not installed); test packages missing there
# come as wheels in .whl/ (scripts/fetch-gpu-wheels.sh makes them). Writes
# docs/gpu-runs/<date>-<device>.txt: nvidia-smi, the pytest summary, benchmarks.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/cai-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/cai-site
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CAI_STREAMS_BACKEND=cuda
device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr -c 'A-Za-z0-9\n' '-' | sed 's/-*$//')
mkdir -p docs/gpu-runs
log="docs/gpu-runs/$(date +%F)-${device:-unknown}.txt"
{
  echo "# cai_streams GPU tier, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi
  python3 -c 'import sys, numpy, cuda.bindings; print(sys.version); print("numpy", numpy.__version__, "cuda-bindings", cuda.bindings.__version__)'
  echo
  python3 -m pytest -p no:cacheprovider -q -rs tests
  status=$?
  if [ -f benchmarks/run.py ]; then
    python3 benchmarks/run.py --backend cuda --quick --out docs/gpu-runs
  fi
  exit $status
} 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then cp "$log" "$OUT/"; fi
echo "log: $log"
exit "$status"
