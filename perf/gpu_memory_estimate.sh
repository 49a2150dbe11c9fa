#!/usr/bin/env bash
# The per-rank memory estimate of `megarl sweep` (megarl/launch/memory.py) against measured peaks on one GPU:
# a 4-point sweep (Qwen2.5-0.5B and 1.5B shapes, bf16, random weights, GRPO with vLLM rollouts at
# gpu_memory_utilization 0.35; the step of perf/gpu_rl_step.sh: 64 prompts x 8 samples x 256 new tokens) over
# two micro-batch sizes, run one point after another (--local). Its results.md lists, per point, megarl bench
# step's peak (torch.cuda.max_memory_allocated: the training tensors, not vLLM's pool), NVML's device memory
# in use (everything), and the estimate's total and tensor part. Needs the wheels of gpu_vllm.sh (installed by
# perf/gpu_synthetic_task.sh when missing). About 100 s a point on one H200 (vLLM's start, a warm-up and 2
# steps): ~7.5 minutes with the extension's build, so run it where the wheels are already installed.
#   bash perf/gpu_memory_estimate.sh        -> $OUT/sweeps/gpu-memory/results.md (OUT default runs/gpu_memory)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_memory}
source perf/gpu_synthetic_task.sh
cat > "$OUT/sweep.yaml" <<YAML
name: gpu-memory
output: $OUT/sweeps
overrides: [model.tokenizer=$OUT/tok, model.dtype=bfloat16, "data.train_files=[$OUT/prompts.jsonl]",
            data.prepare=null, data.use_chat_template=false, "data.instruction=''", data.max_prompt_length=16,
            reward.fn=tests.rl_tasks:says_target, rollout.engine=vllm, rollout.gpu_memory_utilization=0.35,
            data.prompts_per_step=64, rollout.n=8, rollout.max_new_tokens=256, actor.ppo_mini_batch_size=256,
            actor.logprob_micro_batch_size=32, trainer.progress=false, run.output_dir=$OUT/runs]
grid:
  model.path: [preset:qwen2.5-0.5b, preset:qwen2.5-1.5b]
  actor.micro_batch_size: [8, 16]
job: {nodes: 1, gpus_per_node: 1}
bench: {steps: 2, warmup: 1}
YAML
python3 -m megarl.cli sweep "$OUT/sweep.yaml" --local
