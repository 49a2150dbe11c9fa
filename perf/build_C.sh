#!/usr/bin/env bash
# Build the megarl._C extension in place (CUDA where nvcc and a GPU exist), skipped when it was built from the
# same sources; then check that it imports. Used by the GPU scripts, so that the reshard never runs on the
# pure-torch fallback there.   bash perf/build_C.sh
set -euo pipefail
cd "$(dirname "$0")/.."
want=$(cat setup.py csrc/* | sha256sum | cut -d' ' -f1)
have=$(cat /tmp/megarl_C.sha256 2>/dev/null || true)
if [ "$want" != "$have" ] || ! ls megarl/_C*.so >/dev/null 2>&1; then
  MAX_JOBS=${MAX_JOBS:-16} python3 setup.py -q build_ext --inplace
  echo "$want" > /tmp/megarl_C.sha256
fi
python3 -c "import torch, megarl._C; print('megarl._C built, CUDA', torch.version.cuda)"
