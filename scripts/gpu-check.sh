#!/usr/bin/env bash
# The GPU tier, on a machine with a CUDA device and no network (docs/gpu.md).
#
#   scripts/gpu-check.sh            the whole run: tests/gpu, the whole suite (every
#                                   test on sim and cuda, every example), then
#                                   benchmarks/run.py --backend cuda --quick
#   scripts/gpu-check.sh --dry-run  everything but the device, on any machine: the
#                                   wheel install, PYTHONPATH, the plugins, the log
#
# The project runs from PYTHONPATH (not installed). Test packages the machine lacks
# come as wheels from $WHEELS (default .whl/, made by scripts/fetch-gpu-wheels.sh)
# and are installed into a target directory. The log is written as it goes, into
# docs/gpu-runs/<date>-<device>.txt and, when $OUT is set, into $OUT too, so a run
# killed at any point still brings back everything it printed. The benchmark JSON
# and plot go to $OUT when set, else docs/gpu-runs/.
#
# Bounds: each step runs under `timeout`, from a total of $GPU_CHECK_BUDGET seconds
# (default 1200); GPU_CHECK_COMMIT names the commit when the tree is an exported
# snapshot rather than a checkout; pytest times a test out after 120 s with the thread method, which
# also interrupts a C call that busy-waits (the signal method cannot).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
dry_run=0
case "${1:-}" in
  --dry-run) dry_run=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac
python=${PYTHON:-python3}
wheels=${WHEELS:-$root/.whl}
budget=${GPU_CHECK_BUDGET:-1200}
start=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

if [ "$dry_run" = 1 ]; then
  device=dry-run
  export CUDA_VISIBLE_DEVICES=""  # everything but the device, on a GPU machine too
else
  device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 \
    | tr -c 'A-Za-z0-9\n' '-' | sed 's/-*$//')
  device=${device:-unknown}
fi
name="$(date +%F)-$device.txt"
logs=()
if [ "$dry_run" = 0 ]; then
  mkdir -p docs/gpu-runs
  logs+=("docs/gpu-runs/$name")
fi
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  logs+=("$OUT/$name")
fi
bench_out=${OUT:-docs/gpu-runs}
exec > >(tee "${logs[@]}") 2>&1
tee_pid=$!

left() { echo $((budget - (SECONDS - start))); }
# step SHARE_PERCENT COMMAND...: run COMMAND with at most SHARE of the budget left
step() {
  local share=$1
  shift
  local limit=$(($(left) * share / 100))
  if [ "$limit" -lt 10 ]; then
    echo "!! skipped (budget spent): $*"
    return 124
  fi
  echo
  echo "== $* (limit ${limit}s)"
  timeout -k 10 "$limit" "$@"
  local rc=$?
  [ "$rc" = 124 ] && echo "!! timed out after ${limit}s: $*"
  return "$rc"
}

commit=${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "# cai_streams GPU tier, $(date -u +%FT%TZ), commit $commit$([ "$dry_run" = 1 ] && echo ', DRY RUN (no device)')"
if [ "$dry_run" = 0 ]; then
  nvidia-smi
fi

site=$(mktemp -d "${TMPDIR:-/tmp}/cai-site.XXXXXX")
if compgen -G "$wheels/*.whl" >/dev/null; then
  echo "installing into $site: $(cd "$wheels" && ls -- *.whl | tr '\n' ' ')"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl || { echo "!! wheel install failed"; exit 1; }
  ls "$site" | sed -n 's/\.dist-info$//p' | sed 's/^/  installed: /'
else
  echo "no wheels in $wheels"
fi
export PYTHONPATH="$root:$site${PYTHONPATH:+:$PYTHONPATH}"

"$python" - <<'EOF'
import platform, sys
from importlib import metadata
print("python", sys.version.split()[0], platform.machine())
for dist in ("numpy", "cuda-bindings", "cuda-core", "cupy-cuda13x", "cupy-cuda12x", "torch",
             "numba", "numba-cuda", "pytest", "pytest-timeout", "pytest-asyncio", "anyio",
             "trio", "uvloop", "hypothesis", "matplotlib"):
    try:
        print(f"  {dist} {metadata.version(dist)}")
    except metadata.PackageNotFoundError:
        print(f"  {dist}: not installed")
import cai_streams
print("cai_streams from", cai_streams.__file__)
EOF
[ $? = 0 ] || { echo "!! the project does not import from PYTHONPATH"; exit 1; }

# The plugin by module, whether or not an installed entry point also provides it
# (blocking the entry point's name first, so pluggy never sees it twice).
# pytest-benchmark (on GPU images) warns under xdist, and warnings are errors here.
pytest_args=(-p no:cacheprovider -p no:cai_streams -p cai_streams.testing -p no:benchmark
  -o timeout_method=thread --timeout=120 -q -rs)
# GPU_CHECK_ONLY="gpu suite bench" (the default) picks the steps of a real run
only=" ${GPU_CHECK_ONLY:-gpu suite bench} "
status=0
if [ "$dry_run" = 1 ]; then
  step 50 "$python" -m pytest "${pytest_args[@]}" tests/test_plugin_loaded.py \
    tests/test_consume_pytest_asyncio.py || status=1
  step 50 "$python" benchmarks/run.py --backend cuda --quick --out "$bench_out"
  rc=$?
  echo "benchmarks/run.py --backend cuda without a device: exit $rc"
  [ "$rc" = 2 ] || status=1
else
  [[ $only == *" gpu "* ]] && { step 15 "$python" -m pytest "${pytest_args[@]}" tests/gpu || status=1; }
  # pytest-xdist, where the machine has it, runs the suite in 4 processes (a
  # module stays on one process): GPU time is short
  parallel=()
  "$python" -c "import xdist" 2>/dev/null && parallel=(-n "${GPU_CHECK_WORKERS:-4}" --dist loadfile)
  [[ $only == *" suite "* ]] && { step 75 "$python" -m pytest "${pytest_args[@]}" "${parallel[@]}" \
    --ignore=tests/gpu tests || status=1; }
  [[ $only == *" bench "* ]] && { step 95 "$python" benchmarks/run.py --backend cuda --quick \
    --out "$bench_out" || status=1; }
fi
echo
echo "gpu-check: $([ "$status" = 0 ] && echo PASSED || echo FAILED) in $((SECONDS - start)) s; log: ${logs[*]}"
exec >&- 2>&-
wait "$tee_pid"
exit "$status"
