#!/usr/bin/env bash
# Transformer Engine on one H200 (issue 21), from the repo root:   bash perf/gpu_te.sh [build|test|bench|all]
# 1. build: installs the TE wheels uploaded to /tmp/tewhl (the chunk folders of
#    `stage.sh` over transformer-engine-cu13, transformer-engine and their Python dependencies, plus the
#    transformer-engine-torch 2.20.2 source tarball: see perf/RESULTS.md) and megatron-core (.whl, carried) into
#    /tmp/site-te, then builds the torch extension from source against the machine's torch and CUDA
#    (`pip wheel --no-build-isolation`, NVTE_PYTORCH_FORCE_BUILD=TRUE: there is no network for a prebuilt one);
#    skipped when transformer_engine.pytorch already imports from there (a kept machine). The build's wall time
#    is the stage's time.
# 2. test: tests/test_gpu_te.py (TE's layer spec, dense and MoE with grouped experts, against transformers; its
#    checkpoints exported bit for bit).
# 3. bench: perf/bench_models.py (bf16, random weights), forward+backward of the actor's loss: megarl's local
#    spec with kernels/ (SDPA attention, chunked log-probs) against TE's layer spec, on the Qwen2.5-1.5B shape in
#    bf16 and FP8 (4 x 4096 tokens) and on one 16,384-token sequence, and on the Qwen3-30B-A3B shape cut to 4
#    layers (128 experts, top-8: SequentialMLP's one GEMM per expert against TE's grouped GEMMs, 4 x 2048
#    tokens): MFU (on active parameters for the MoE) and peak memory.
# TE lives in /tmp/site-te only, so that no other GPU script picks TE's layer spec by accident. Logs and JSON go
# to $OUT (default runs/gpu_te); the last line is "gpu_te: PASS|FAIL".
set -uo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_lib.sh  # begin, stage, finish
begin gpu_te 580
export TE_SITE=/tmp/site-te
WHAT=${1:-all}

build_te() {
  if PYTHONPATH=$TE_SITE python3 -c "import transformer_engine.pytorch" 2>/dev/null; then
    echo "already built in $TE_SITE"; return 0
  fi
  [ -f /tmp/tewhl/reassemble.sh ] || { echo "no /tmp/tewhl: upload .gpu/te/cNN first"; return 1; }
  bash /tmp/tewhl/reassemble.sh /tmp/tewhl "$TE_SITE" || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$TE_SITE" .whl/*.whl || return 1
  rm -rf /tmp/tebuild && mkdir -p /tmp/tebuild && tar xzf /tmp/tewhl/transformer_engine_torch-2.20.2.tar.gz -C /tmp/tebuild
  (cd /tmp/tebuild/transformer_engine_torch-2.20.2 && PYTHONPATH=$TE_SITE NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=16 \
    python3 -m pip wheel -v --no-index --no-build-isolation --no-deps -w /tmp/tebuild/wheel .) || return 1
  # unpacked over the site (pip --target will not merge into the transformer_engine folder already there): the
  # extension lands in transformer_engine/wheel_lib/, where TE looks for it
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
    /tmp/tebuild/wheel/transformer_engine_torch-*.whl "$TE_SITE" || return 1
  PYTHONPATH=$TE_SITE python3 -c "import transformer_engine.pytorch as te, transformer_engine; print('TE', transformer_engine.__version__, 'imports')"
}

bench_one() {  # bench_one NAME ARGS...: perf/bench_models.py (the 1.5B shape unless ARGS name another --model)
  local name=$1; shift
  PYTHONPATH=$TE_SITE:$PYTHONPATH python3 perf/bench_models.py --model qwen2.5-1.5b --steps 5 --json "$OUT/$name.json" "$@" \
    > "$OUT/$name.txt" 2>&1
  local rc=$?
  grep -E "^(status|mfu|tokens_per_s|peak_memory_gib|seconds_per_fwd_bwd_median) " "$OUT/$name.txt" | tr -s ' ' | paste -sd' ' \
    | sed "s/^/$name: /"
  return $rc
}

bench() {
  local rc=0
  bench_one local-4x4096 --micro-batch 4 --seq 4096 || rc=1
  bench_one local-1x16384 --micro-batch 1 --seq 16384 || rc=1
  bench_one moe-local-4x2048 --model qwen3-30b-a3b --layers 4 --micro-batch 4 --seq 2048 || rc=1
  if PYTHONPATH=$TE_SITE python3 -c "import transformer_engine.pytorch" 2>/dev/null; then
    bench_one te-4x4096 --micro-batch 4 --seq 4096 --attention te || rc=1
    bench_one te-fp8-4x4096 --micro-batch 4 --seq 4096 --attention te --fp8 || rc=1
    bench_one te-1x16384 --micro-batch 1 --seq 16384 --attention te || rc=1
    bench_one moe-te-4x2048 --model qwen3-30b-a3b --layers 4 --micro-batch 4 --seq 2048 --attention te || rc=1
  else
    echo "TE does not import from $TE_SITE: only the local spec was measured"; rc=1
  fi
  return $rc
}

export -f build_te bench_one bench
case $WHAT in build|all) stage build 300 build_te ;; esac
case $WHAT in test|all) stage test 120 \
  "PYTHONPATH=$TE_SITE:\$PYTHONPATH python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_te.py" ;; esac
case $WHAT in bench|all) stage bench 330 bench ;; esac
cat "$OUT/bench.log" 2>/dev/null | grep -E "^(local|te|moe)"
finish gpu_te
