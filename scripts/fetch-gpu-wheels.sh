#!/usr/bin/env bash
# Run HERE (with network): download the test packages the GPU machine lacks, or
# has at other versions, into .whl/ (ignored by git: carry it to the GPU machine). The
# pins are the versions CI runs. numpy too: the GPU image's numpy 2.5 removed
# np.row_stack, which numba-cuda 0.30.4 uses at import. docs/gpu.md has the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-timeout==2.4.0 \
  pytest-asyncio==1.5.0 trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 \
  numpy==2.4.6
ls .whl
du -sh .whl
