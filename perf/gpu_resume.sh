#!/usr/bin/env bash
# Resume at another layout on two GPUs (nvidia-h200-x2), NCCL, bf16, vLLM rollouts (issue 23), one command from
# the repo root within 10 minutes:   bash perf/gpu_resume.sh [MODEL]     (default qwen2.5-0.5b, random weights)
# Needs the wheels of perf/gpu_vllm.sh. Runs GRPO on the synthetic task of tests/rl_tasks.py:
#   1. straight: actor TP=2 for 3 steps, a checkpoint after each;
#   2. moved: the same for 2 steps, then --resume at TP=1 x DP=2 for step 3 (megatron-core's dist-checkpoint
#      resharding of the weights and of the DistributedOptimizer's fully_reshardable state, over NCCL);
# then compares step 3 (bf16 and another TP: within 2e-2) and writes $OUT/resume_summary.json with both runs'
# step-3 metrics and every checkpoint's save seconds (time/checkpoint_save). Last line: "gpu_resume: PASS/FAIL".
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-qwen2.5-0.5b}
source perf/gpu_lib.sh  # begin, stage, finish
begin gpu_resume 570
source perf/gpu_synthetic_task.sh
export MODEL

train() {  # train NAME STEPS [ARGS...]
  local name=$1 steps=$2; shift 2
  python3 -m megarl.cli train model.path=preset:$MODEL model.tokenizer=$OUT/tok model.dtype=bfloat16 \
    "data.train_files=[$OUT/prompts.jsonl]" data.prepare=null data.use_chat_template=false "data.instruction=''" \
    reward.fn=tests.rl_tasks:says_target rollout.engine=vllm rollout.gpu_memory_utilization=0.35 \
    data.prompts_per_step=32 rollout.n=4 rollout.max_new_tokens=64 actor.micro_batch_size=8 \
    actor.ppo_mini_batch_size=64 actor.optim.lr=1e-5 trainer.steps=$steps trainer.save_every=1 \
    trainer.progress=false run.output_dir=$OUT run.name=$name validation.enabled=false trainer.report=false "$@"
}
export -f train

stage straight 300 'rm -rf $OUT/straight && train straight 3 actor.parallel.tp=2'
stage moved_tp2 200 'rm -rf $OUT/moved && train moved 2 actor.parallel.tp=2'
stage moved_dp2 200 'train moved 3 actor.parallel.dp=2 --resume'
stage compare 30 'python3 - <<EOF
import json, sys
from megarl.trainer.metrics import read_metrics
a = read_metrics("$OUT/straight/metrics.jsonl")[2]
b = read_metrics("$OUT/moved/metrics.jsonl")[2]
keys = ["actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/lr", "response/length_mean"]
bad = [k for k in keys if abs(a[k] - b[k]) > 2e-2 * max(abs(a[k]), 1e-3)]
saves = {n: [h.get("time/checkpoint_save") for h in read_metrics(f"$OUT/{n}/metrics.jsonl")]
         for n in ("straight", "moved")}
json.dump({"model": "$MODEL", "straight_step3": {k: a[k] for k in keys}, "moved_step3": {k: b[k] for k in keys},
           "differ": bad, "checkpoint_save_s": saves}, open("$OUT/resume_summary.json", "w"), indent=2)
print("step 3 at TP=1 x DP=2 after TP=2:", "equal within 2e-2" if not bad else f"differs in {bad}", saves)
sys.exit(1 if bad else 0)
EOF'
finish gpu_resume
