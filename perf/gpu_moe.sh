#!/usr/bin/env bash
# Mixture of experts on one H200 (issues 20 and 32), in one command from the repo root:   bash perf/gpu_moe.sh
# The Qwen3-30B-A3B shape cut to a few layers (preset:qwen3-30b-a3b?layers=N: 128 experts of width 768, top-8;
# random weights, bf16), Megatron actor (the local spec with grouped experts, actor.kernels.moe_experts=grouped)
# with vLLM 0.24.0 rollouts:
#   1. installs the wheels (perf/install_wheels.sh: the vLLM chunk folders uploaded to /tmp/whl, .whl carried)
#      and builds megarl._C (perf/build_C.sh);
#   2. tests/test_gpu_moe.py (4 layers): vLLM's fused-MoE parameters (names, shapes) against megarl's layout and
#      vLLM's own load_weights against the reshard, bit for bit; greedy output equal to the actor's own greedy
#      decoding; sampled-token log-prob |vLLM - actor| (mean, max); the reshard time;
#   3. `megarl bench step` of GRPO steps on 8 layers (LAYERS=8) on the synthetic prompts of tests/rl_tasks.py
#      (64 prompts x 8 samples x 128 new tokens, one mini-batch of 512, micro-batches of 64): the phase table,
#      the actor update's MFU counted on active parameters (megarl/measure/flops.py), the peak memory, and the
#      generate calls again on a standalone vLLM of the same settings (--standalone-vllm) for the ratio.
# Logs and the bench JSON go to $OUT (default runs/gpu_moe). The last line is "gpu_moe: PASS|FAIL"; the stages
# share a budget of 560 s of wall time (each is cut at what is left), so the run ends within 10 minutes (on
# 2026-12-04: install and build 108 s on a fresh machine, test_gpu_moe 81 s, bench_step 118 s). STAGES=NAME runs
# one stage (install and build skip themselves on a kept machine).
set -uo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_lib.sh  # begin, stage, finish
begin gpu_moe 560

install_and_build() {
  bash perf/install_wheels.sh && bash perf/build_C.sh && python3 -c "import pytest"
}

bench_step() {
  synthetic_task "$OUT" 1024 || return 1
  python3 -m megarl.cli bench step "model.path=preset:qwen3-30b-a3b?layers=${LAYERS:-8}" "${SYN[@]}" \
    model.dtype=bfloat16 rollout.engine=vllm trainer.progress=false \
    run.output_dir="$OUT" run.name=moe-bench validation.enabled=false data.max_prompt_length=8 \
    rollout.max_new_tokens=128 data.prompts_per_step=64 rollout.n=8 actor.ppo_mini_batch_size=512 \
    actor.micro_batch_size=64 actor.logprob_micro_batch_size=64 rollout.gpu_memory_utilization=0.12 \
    algorithm.kl.coef=0 --steps 2 --warmup 1 --standalone-vllm --json "$OUT/moe-bench.json" --overwrite || return 1
  python3 - "$OUT/moe-bench.json" <<'PY'
import json
import sys

r = json.loads(open(sys.argv[1]).read())
assert r["status"] == "ok", r.get("error")
upd = r["phases"]["actor_update"]
print(f"step {r['step_time_s']:.2f} s, generate {r['generate_tokens_per_s']:.0f} tokens/s, actor update MFU "
      f"(active parameters) {upd.get('mfu') or 0:.1%} of the datasheet / {upd.get('mfu_vs_measured') or 0:.1%} of "
      f"the measured peak, peak {upd.get('peak_memory_bytes', 0) / 2**30:.1f} GiB")
s = r.get("standalone_vllm") or {}
print(f"standalone vLLM {s.get('tokens_per_s') or 0:.0f} tokens/s (spread {s.get('spread') or 0:.1%}); the RL engine's "
      f"calls {s.get('rl_generate_call_tokens_per_s') or 0:.0f} tokens/s: ratio {s.get('ratio') or 0:.2f}")
PY
}

export -f install_and_build synthetic_task bench_step

stage install 150 install_and_build
if [ $failed -eq 0 ]; then
  stage test_gpu_moe 220 "python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_moe.py"
  stage bench_step 330 bench_step
fi
grep -h "MoE vLLM" "$OUT/test_gpu_moe.log" 2>/dev/null
grep -v -i -E "warn|INFO" "$OUT/bench_step.log" 2>/dev/null | tail -n 25
finish gpu_moe
