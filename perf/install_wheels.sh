#!/usr/bin/env bash
# Install the packages the GPU machine lacks (vLLM 0.24.0 from the chunk folders uploaded to /tmp/whl, the
# megatron-core, omegaconf and other wheels carried in .whl/) into /tmp/site, skipped when vllm, megatron.core
# and omegaconf already import from there (a kept machine); then print their versions. Used by the GPU scripts;
# run them with PYTHONPATH=/tmp/site:$PWD.   bash perf/install_wheels.sh
# .whl/ (ignored, carried) holds the wheels outside the vLLM list, fetched here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform any -d .whl megatron-core==0.19.2 omegaconf==2.4.0 gguf==0.19.0 \
#     compressed-tensors==0.17.0 loguru xxhash==4.1.0 flash-linear-attention==0.4.2 fla-core==0.4.2 einops==0.8.2 \
#     uvicorn==0.55.0 click==8.5.1 watchfiles==1.3.0 uvloop==0.23.0 httptools==0.9.0 websockets==17.4 \
#     python-multipart==0.0.34 model-hosting-container-standards==0.1.16 jmespath supervisor setproctitle==1.3.8 \
#     python-json-logger==4.2.0 ijson==3.6.0 blake3==1.0.11
# (xxhash: the checkpoints' content hashes, megarl.models.integrity; flash-linear-attention, fla-core, einops: the
# gated DeltaNet's Triton kernels, pyproject's gpu extra.)
# (compressed-tensors, which vLLM 0.24.0 pins and imports for any `quantization`, e.g. FP8 rollouts, is missing
# from ../shared/tools/gpu-wheels/vllm-0.24.0.txt; without it an FP8 engine fails with ModuleNotFoundError. So are
# the OpenAI-compatible server's: uvicorn with its standard extras, model-hosting-container-standards, setproctitle,
# python-json-logger, ijson, blake3; `vllm serve`, the judge of perf/gpu_workflow.sh, stops at the first missing.)
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
