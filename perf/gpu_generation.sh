#!/usr/bin/env bash
# Generation at the GPU's pace (issue 31), one H200, from the repo root:   bash perf/gpu_generation.sh
#
# The 1.5B case of perf/gpu_bench_step.sh grpo-1.5b-fast (Qwen2.5-1.5B shape, random weights, 64 prompts of 3-5
# tokens x 8 samples x 256 new tokens, CUDA graphs, gpu_memory_utilization 0.35), old and new settings side by side,
# back to back on this machine. Needs the vLLM wheels (perf/install_wheels.sh: chunks uploaded to /tmp/whl, .whl
# carried; skipped on a kept machine where they import). Stages (each cut at what is left of BUDGET_S, default
# 560 s). They take ~14 minutes, more than one 10-minute call of the GPU machine, so run them in two calls on a
# kept machine with the same OUT (measured 2026-12-03: install 26 s, build 92 s, gen_before 140 s, gen_after 98 s):
#   OUT=/tmp/gen STAGES="gen_before gen_after" bash perf/gpu_generation.sh
#   OUT=/tmp/gen STAGES="fp8_kernel gen_fp8 step_after step_fp8" bash perf/gpu_generation.sh
# (the second call's summary has both calls' rows):
#   1. install, build: the wheels into /tmp/site, megarl._C with the FP8 quantise kernel (skipped when done);
#   2. gen_before: `megarl bench generation` with main's settings at 53c0cd9 (BEFORE: vLLM's defaults, which run
#      Qwen2 on the V1 model runner, seeded requests, log-probs from vLLM's output; set explicitly now): tokens/s
#      of the RL generate call (variant megarl) and of the same requests without per-request seeds, without the
#      log-prob, without both (what each per-token ask costs),
#      the per-engine-step breakdown (host time in vLLM's scheduler, forward and sampler launches, waiting on the
#      GPU, output processing) and a torch-profiler window of 32 tokens (GPU busy vs idle per step, kernels by kind);
#   3. gen_after: the same with the new settings (AFTER, default rollout.model_runner=v2: one kernel samples the
#      seeded requests) -> $OUT/gen_after.json;
#   4. step_after: `megarl bench step` of the grpo-1.5b-fast case with AFTER and token TIS (to measure its
#      truncation), and the standalone baseline (same engine settings, warmed up, median of 3 passes, spread);
#   5. fp8_kernel: tests/test_gpu_fp8.py (the quantise kernel = vLLM's block quantisation bit for bit; the FP8
#      engine written by the reshard decodes like the bf16 actor, updates and sleeps);
#   6. gen_fp8: gen_after with rollout.quantization=fp8 (block-FP8 weights): tokens/s FP8 vs bf16;
#   7. step_fp8: step_after with FP8 rollouts (token TIS by default): rollout-vs-actor log-prob difference and
#      TIS truncation, FP8 against stage 4's bf16.
#   7b. step_engines2: step_after's step with rollout.engines_per_gpu=2 (two engines on the GPU, each in a
#      process of its own: megarl/rollout/engine_pool.py), against stage 4 in the summary. One call:
#      OUT=/tmp/gen STAGES="step_after step_engines2" bash perf/gpu_generation.sh
#   7c. gen_fp8kv, step_fp8kv: gen_after's generation and step_after's step with rollout.kv_cache_dtype=fp8
#      (vLLM's FP8 KV cache; token TIS by default), against stages 3 and 4 in the summary. One call:
#      OUT=/tmp/gen STAGES="gen_after gen_fp8kv step_after step_fp8kv" bash perf/gpu_generation.sh
#   8. gen_logprobs: the RL generate call (variant megarl) with AFTER and rollout.logprobs=output (vLLM's
#      logprobs=0 output) then =sampler (megarl.rollout.vllm_logprobs: gathered in vLLM's sampler on the GPU), back
#      to back -> $OUT/gen_lp_output.json, gen_lp_sampler.json; gen_logprobs_v1: the same on the V1 model runner
#      (gen_lp_v1_output.json, gen_lp_v1_sampler.json); logprobs_test: tests/test_gpu_logprobs.py (the sampler's
#      log-probs = vLLM's logprobs=0 output bit for bit, V1 and V2, eager and CUDA graphs; ~4 minutes). Two calls:
#      OUT=/tmp/gen STAGES="logprobs_test" bash perf/gpu_generation.sh
#      OUT=/tmp/gen STAGES="gen_logprobs gen_logprobs_v1" bash perf/gpu_generation.sh
# With EXTRA=1, five more (~6 minutes): gen_hf (an HF config.json of the same shape: max_position_embeddings
# 131072, eos and generation_config.json of Qwen2.5-1.5B, the "HF directory" of the peers' comparison),
# gen_sync (AFTER with async scheduling off), step_before (the step with main's settings) and gen_7b, gen_7b_fp8
# (the Qwen2.5-7B shape, bf16 and FP8, the same batch).
# $OUT/summary.md gets the table (generation before/after with the goal of 1.8x, the step against 7.0 s, the
# per-step breakdowns, FP8 vs bf16, the baseline's spread against 5%); the last line is "gpu_generation: PASS"
# or "gpu_generation: FAIL" (exit status 0 or 1).
set -uo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_lib.sh  # begin, stage, finish, install_wheels, build_extension
begin gpu_generation 560

export AFTER=${AFTER:-rollout.model_runner=v2}
# main's settings at 53c0cd9, which are no longer the defaults (Qwen2 now runs on V2, the log-probs are the sampler's)
export BEFORE=${BEFORE:-rollout.model_runner=v1 rollout.logprobs=output}
export CASE="model.path=preset:qwen2.5-1.5b rollout.engine=vllm model.dtype=bfloat16 rollout.enforce_eager=false
  rollout.gpu_memory_utilization=0.35 data.prompts_per_step=64 rollout.n=8 rollout.max_new_tokens=256"

build_extension() {
  bash perf/build_C.sh && python3 -c "import torch, megarl._C as C; assert C.cuda and hasattr(C, 'quantize_fp8_blocks')"
}

generation() {  # generation LABEL VARIANTS [overrides...]: one engine, its variants, a profile
  local label=$1 variants=$2
  shift 2
  python3 -m megarl.cli bench generation $CASE "$@" --label "$label" --variants "$variants" --profile-tokens 32 \
    --json "$OUT/gen_$label.json" --overwrite 2>&1 | grep --line-buffered -v -i -E "warn|INFO"
  return "${PIPESTATUS[0]}"
}

step() {  # step LABEL [overrides and flags...]: bench step of grpo-1.5b-fast
  local label=$1
  shift
  synthetic_task "$OUT" || return 1
  python3 -m megarl.cli bench step $CASE "${SYN[@]}" \
    trainer.progress=false run.output_dir="$OUT" run.name="step-$label" actor.micro_batch_size=32 \
    actor.logprob_micro_batch_size=64 actor.ppo_mini_batch_size=256 "$@" --json "$OUT/step_$label.json" --overwrite \
    2>&1 | grep --line-buffered -v -i -E "warn|INFO"
  return "${PIPESTATUS[0]}"
}

hf_config() {  # the config.json of Qwen2.5-1.5B (random weights: dummy) and its generation_config.json
  mkdir -p "$OUT/hf15"
  python3 - "$OUT/hf15" <<'EOF'
import json
import sys
from pathlib import Path

from megarl.models.spec import preset

root = Path(sys.argv[1])
config = preset("qwen2.5-1.5b").to_hf_config().to_dict()
config.update(max_position_embeddings=131072, eos_token_id=151643, bos_token_id=151643, max_window_layers=21,
              sliding_window=131072, use_sliding_window=False)
(root / "config.json").write_text(json.dumps(config, indent=2))
(root / "generation_config.json").write_text(json.dumps({"bos_token_id": 151643, "eos_token_id": [151645, 151643],
                                                         "do_sample": True, "temperature": 0.7, "top_p": 0.8,
                                                         "top_k": 20, "repetition_penalty": 1.1}))
print("wrote", root)
EOF
}

gen_before() { generation before megarl,no_seeds,no_logprobs,bare $BEFORE; }
gen_after() { generation after megarl,no_logprobs,bare $AFTER; }
gen_fp8() { generation fp8 megarl $AFTER rollout.quantization=fp8; }
gen_hf() { hf_config && generation hf megarl model.path="$OUT/hf15"; }
gen_sync() { generation sync megarl $AFTER rollout.async_scheduling=false; }
gen_7b() { generation 7b megarl $AFTER model.path=preset:qwen2.5-7b; }
gen_7b_fp8() { generation 7b_fp8 megarl $AFTER model.path=preset:qwen2.5-7b rollout.quantization=fp8; }
gen_logprobs() {
  generation lp_output megarl $AFTER rollout.logprobs=output &&
    generation lp_sampler megarl $AFTER rollout.logprobs=sampler
}
gen_logprobs_v1() {
  generation lp_v1_output megarl rollout.model_runner=v1 rollout.logprobs=output &&
    generation lp_v1_sampler megarl rollout.model_runner=v1 rollout.logprobs=sampler
}
logprobs_test() { python3 -m pytest -q -s -rfE --tb=short -p no:cacheprovider -m gpu tests/test_gpu_logprobs.py; }
step_after() {
  step after $AFTER algorithm.rollout_correction.preset=token_tis --steps 3 --warmup 1 --standalone-vllm \
    --standalone-repeats 3
}
step_fp8() { step fp8 $AFTER rollout.quantization=fp8 --steps 2 --warmup 1; }
step_engines2() { step engines2 $AFTER rollout.engines_per_gpu=2 --steps 3 --warmup 1; }
gen_fp8kv() { generation fp8kv megarl $AFTER rollout.kv_cache_dtype=fp8; }
step_fp8kv() { step fp8kv $AFTER rollout.kv_cache_dtype=fp8 --steps 3 --warmup 1; }
step_before() { step before $BEFORE --steps 3 --warmup 1; }
fp8_kernel() { python3 -m pytest -q -s -rfE --tb=short -p no:cacheprovider -m gpu tests/test_gpu_fp8.py; }

export -f install_wheels build_extension synthetic_task generation step hf_config gen_before gen_after gen_fp8 gen_hf gen_sync \
  gen_7b gen_7b_fp8 step_after step_fp8 step_engines2 gen_fp8kv step_fp8kv step_before fp8_kernel gen_logprobs \
  gen_logprobs_v1 \
  logprobs_test

stage install 200 install_wheels
[ $failed -eq 0 ] && stage build 200 build_extension
if [ $failed -eq 0 ]; then  # the rest runs whatever one of them does, so that one GPU session reports on all
  stage gen_before 150 gen_before
  stage gen_after 110 gen_after
  stage fp8_kernel 120 fp8_kernel
  stage step_after 260 step_after
  stage gen_fp8 200 gen_fp8
  stage step_fp8 150 step_fp8
  stage step_engines2 200 step_engines2
  stage gen_fp8kv 150 gen_fp8kv
  stage step_fp8kv 200 step_fp8kv
  stage gen_logprobs 200 gen_logprobs
  stage gen_logprobs_v1 200 gen_logprobs_v1
  stage logprobs_test 400 logprobs_test
  if [ "${EXTRA:-0}" = 1 ]; then
    stage gen_hf 110 gen_hf
    stage gen_sync 90 gen_sync
    stage step_before 180 step_before
    stage gen_7b 150 gen_7b
    stage gen_7b_fp8 150 gen_7b_fp8
  fi
fi
python3 -c "from megarl.bench.generation import summary_table; print(summary_table('$OUT'))" > "$OUT/summary.md" 2>&1
cat "$OUT/summary.md"
finish gpu_generation
