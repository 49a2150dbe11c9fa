#!/usr/bin/env bash
# The vLLM rollout engine on the GPU machine, in one command, from the repo root:   bash perf/gpu_vllm.sh
#
# Before it, the vLLM 0.24.0 wheels must be in /tmp/whl (GPU.md, "Bringing packages over"): one upload per chunk
# folder made by ../shared/tools/gpu-wheels/stage.sh (here .gpu/vllm/cNN), back to back on one kept machine:
#   mkdir -p /tmp/whl && cp .gpu/vllm/c01/* /tmp/whl/        (carry .gpu/vllm/c01; then c02, ...)
# This command (carry .whl: megatron-core and omegaconf wheels) then
#   1. installs the wheels of /tmp/whl and .whl/ into /tmp/site (skipped when vllm, megatron.core and omegaconf
#      already import from there: a kept machine);
#   2. builds the megarl._C extension in place (CUDA; skipped when built from the same sources);
#   3. runs tests/test_gpu_vllm.py (greedy parity with the Megatron actor, log-prob agreement, in-place weight
#      updates, sleep mode);
#   4. trains the tiny synthetic task of tests/rl_tasks.py for 3 GRPO steps with rollout.engine=vllm in bf16 on
#      this GPU (python3 -m megarl.cli train) and checks its metrics.
# Logs, the task and the run folder go to $OUT (default runs/gpu_vllm). Each stage prints PASS or FAIL (with the
# tail of its log); the last line is "gpu_vllm: PASS" or "gpu_vllm: FAIL", the exit status 0 or 1. Stages share a
# budget of 470 s of wall time (each is cut at what is left), so the whole run ends within 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_lib.sh  # begin, stage, finish, install_wheels, build_extension
begin gpu_vllm 470

train_tiny() {
  local task=$OUT/task
  rm -rf "$task" && mkdir -p "$task"
  python3 - "$task" > "$task/overrides.txt" <<'EOF' || return 1
import sys
from pathlib import Path

from tests.rl_tasks import make_tiny_model, task_overrides, write_prompts

root = Path(sys.argv[1])
model = make_tiny_model(root / "model")
data = write_prompts(root / "prompts.jsonl", 64)
print("\n".join(task_overrides(model, data, root / "runs", "vllm-tiny")))
EOF
  local overrides
  mapfile -t overrides < "$task/overrides.txt"
  python3 -m megarl.cli train "${overrides[@]}" rollout.engine=vllm model.dtype=bfloat16 \
    rollout.gpu_memory_utilization=0.3 trainer.steps=3 trainer.save_every=0 data.prompts_per_step=8 rollout.n=8 \
    actor.ppo_mini_batch_size=32 actor.micro_batch_size=16 actor.optim.lr=3e-3 || return 1
  python3 - "$task/runs/vllm-tiny" <<'EOF'
import json
import math
import sys
from pathlib import Path

run = Path(sys.argv[1])
history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
assert [h["step"] for h in history] == [1, 2, 3], [h["step"] for h in history]
bad = {k: v for h in history for k, v in h.items() if isinstance(v, float) and not math.isfinite(v)}
assert not bad, f"non-finite metrics: {bad}"
for h in history:
    print(f"step {h['step']}: reward {h['reward/mean']:.3f}, |rollout - old log-prob| "
          f"{h['actor/rollout_vs_old_logprob_diff']:.4f}, generate {h['time/generate']:.2f} s "
          f"({h['throughput/generate_tokens_per_s']:.0f} tokens/s), wake-up {h['time/wake_up'] * 1e3:.1f} ms, reshard {h['time/reshard'] * 1e3:.1f} ms, "
          f"step {h['time/step']:.2f} s")
worst = max(h["actor/rollout_vs_old_logprob_diff"] for h in history)
assert worst < 0.05, f"vLLM's sampled-token log-probs differ from the actor's by {worst} on average"
assert json.loads((run / "summary.json").read_text())["steps"] == 3
EOF
}

export -f install_wheels build_extension train_tiny

stage install 200 install_wheels
[ $failed -eq 0 ] && stage build 200 build_extension
if [ $failed -eq 0 ]; then  # both run, so that one GPU session reports on both
  stage test_gpu_vllm 240 "python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_vllm.py"
  stage train_tiny 240 train_tiny
fi
grep -h "vLLM engine on GPU" "$OUT/test_gpu_vllm.log" 2>/dev/null
grep -h "^step [0-9]*:" "$OUT/train_tiny.log" 2>/dev/null
finish gpu_vllm
