#!/usr/bin/env bash
# RL step throughput on one GPU with vLLM rollouts: GRPO on a random-weight model shape (preset:NAME) and a
# synthetic prompt set (tests/rl_tasks.py's word-level tokenizer; responses run to max_new_tokens), so every
# phase (reshard, generate, log-probs, update) is timed at a realistic size. Needs the wheels of gpu_vllm.sh;
# builds and imports the megarl._C extension first (perf/build_C.sh), so the reshard never runs on the
# pure-torch fallback.
#   bash perf/gpu_rl_step.sh [MODEL] [STEPS]        e.g. bash perf/gpu_rl_step.sh qwen2.5-0.5b 3
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-qwen2.5-0.5b}; STEPS=${2:-3}; OUT=${OUT:-runs/gpu_rl_step}
source perf/gpu_synthetic_task.sh
python3 -m megarl.cli train model.path=preset:$MODEL model.tokenizer=$OUT/tok model.dtype=bfloat16 \
  "data.train_files=[$OUT/prompts.jsonl]" data.prepare=null data.use_chat_template=false "data.instruction=''" \
  reward.fn=tests.rl_tasks:says_target rollout.engine=vllm rollout.gpu_memory_utilization=0.35 \
  data.prompts_per_step=64 rollout.n=8 rollout.max_new_tokens=256 actor.micro_batch_size=16 \
  actor.ppo_mini_batch_size=256 actor.logprob_micro_batch_size=32 actor.optim.lr=1e-6 \
  trainer.steps=$STEPS trainer.save_every=0 trainer.progress=false run.output_dir=$OUT run.name=$MODEL \
  validation.enabled=false
