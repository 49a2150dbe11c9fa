#!/usr/bin/env bash
# Host offload of the actor (actor.offload) on one GPU: the Qwen2.5-1.5B shape (bf16, random weights), GRPO with
# vLLM rollouts, the step of perf/gpu_rl_step.sh (64 prompts x 8 samples x 256 new tokens), 3 steps with the
# actor resident and 3 with it offloaded. Prints, per run and step: the training tensors' peak during generation
# (memory/generate/peak_bytes, torch.cuda.max_memory_allocated: not vLLM's pool) and during the update, the
# device memory in use at the end of generation (NVML, everything), the bytes moved to the host and the seconds
# of each move (offload/to_host_s, offload/to_device_s), and the step time. Needs the wheels of gpu_vllm.sh.
#   bash perf/gpu_offload.sh [MODEL]        e.g. bash perf/gpu_offload.sh qwen2.5-1.5b
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-qwen2.5-1.5b}; OUT=${OUT:-runs/gpu_offload}
source perf/gpu_synthetic_task.sh
for OFFLOAD in false true; do
  python3 -m megarl.cli train model.path=preset:$MODEL model.tokenizer=$OUT/tok model.dtype=bfloat16 \
    "data.train_files=[$OUT/prompts.jsonl]" data.prepare=null data.use_chat_template=false "data.instruction=''" \
    reward.fn=tests.rl_tasks:says_target rollout.engine=vllm rollout.gpu_memory_utilization=0.35 \
    data.prompts_per_step=64 rollout.n=8 rollout.max_new_tokens=256 actor.micro_batch_size=16 \
    actor.ppo_mini_batch_size=256 actor.logprob_micro_batch_size=32 actor.optim.lr=1e-6 \
    actor.offload=$OFFLOAD trainer.steps=3 trainer.save_every=0 trainer.progress=false validation.enabled=false \
    run.output_dir=$OUT run.name=offload_$OFFLOAD
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
G = 2**30
for off in ("false", "true"):
    for line in (Path(sys.argv[1]) / f"offload_{off}" / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        print(f"offload={off:5} step {m['step']}: generate peak {m.get('memory/generate/peak_bytes', 0) / G:6.2f} GiB"
              f" | update peak {m.get('memory/actor_update/peak_bytes', 0) / G:6.2f} GiB"
              f" | device in use after generate {m.get('offload/device_used_bytes', 0) / G:6.2f} GiB"
              f" | moved {m['offload/host_bytes'] / G:6.2f} GiB, to host {m['offload/to_host_s']:.3f} s,"
              f" to device {m['offload/to_device_s']:.3f} s | step {m['time/step']:.1f} s")
PY
