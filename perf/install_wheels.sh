#!/usr/bin/env bash
# Install the packages the GPU machine lacks (vLLM 0.24.0 from the chunk folders uploaded to /tmp/whl, the
# megatron-core, omegaconf and other wheels carried in .whl/) into /tmp/site, skipped when vllm, megatron.core
# and omegaconf already import from there (a kept machine); then print their versions. Used by the GPU scripts;
# run them with PYTHONPATH=/tmp/site:$PWD.   bash perf/install_wheels.sh
# .whl/ (ignored, carried) holds the wheels outside the vLLM list, perf/gpu_wheels.txt (why each is there: its
# comments); perf/stage_uploads.sh makes .whl/ and the vLLM chunk folders on a machine that is online.
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site}
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
if python3 -c "import vllm, megatron.core, omegaconf, compressed_tensors, xxhash, fla, uvicorn, watchfiles, \
model_hosting_container_standards" 2>/dev/null; then
  echo "already installed in $SITE"
else
  [ -f /tmp/whl/reassemble.sh ] || { echo "no /tmp/whl/reassemble.sh: upload the vLLM chunk folders first" \
    "(mkdir -p /tmp/whl && cp .gpu/vllm/cNN/* /tmp/whl/, one upload per folder)"; exit 1; }
  bash /tmp/whl/reassemble.sh /tmp/whl "$SITE" || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl || exit 1
fi
python3 -c "import vllm, megatron.core, omegaconf; print('vllm', vllm.__version__, '| megatron-core', \
megatron.core.__version__)"
