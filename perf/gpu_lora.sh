#!/usr/bin/env bash
# LoRA vs full training on one H200 (issue 30): GRPO with vLLM rollouts on the synthetic task of tests/rl_tasks.py,
# random weights of the Qwen2.5-1.5B and 7B shapes in bf16, 32 prompts x 8 samples x 128 new tokens, 3 steps per
# case (step 1 is the warm-up; steps 2-3 are reported). Cases, in this order:
#   1.5b-full   1.5b-r64-merged   1.5b-r64-adapter
#   7b-r16-merged     7b-r64-merged     7b-r64-adapter
# 7b-full runs by name only (bash perf/gpu_lora.sh 7b-full; ~160 s of its own: the Adam step of 7.6B
# parameters runs on the host's 16 cores): its fp32 master weights and Adam moments (85 GiB) do not fit one H200
# beside vLLM (with actor.offload=true it ran out of memory in Adam's first step on 2026-12-02, perf/RESULTS.md),
# so it puts 80% of them on the host with megatron's optimizer CPU offload (actor.optim.cpu_offload=0.8) and
# recomputes activations: 118.6 GiB update peak measured on the GPU, up to 118 GiB of the host's 125 in use.
# At 1.0 the host ran out of memory in the first step (2026-12-03); at 0.8 the kernel kills the process in its
# end-of-run checkpoint save (the steps' metrics are written before it, so the table below has them; the case
# prints FAILED). actor.offload stays off: it would move the 28 GiB gradient buffer and the weights to the host
# too. The LoRA runs need neither (70.5 GiB update peak measured at rank 64).
# Per case, from metrics.jsonl: actor-update peak memory (memory/actor_update/peak_bytes: torch's tensors, not
# vLLM's pool), seconds per phase, tokens/s/GPU, the weight sync (time/reshard, and reshard/merge_s: the merge of
# W + (alpha/r) B A on the engine ranks), generation tokens/s, and actor/rollout_vs_old_logprob_diff (mean
# |rollout log-prob - trainer log-prob|: the bf16 merge question of NeMo-RL #3696). A results table goes to
# $OUT/lora_results.md (and the console). Cases left when the budget (BUDGET_S, default 520 s) is spent are
# skipped and named. Needs the vLLM wheels of perf/gpu_vllm.sh; ~8-9 minutes on a warm machine.
#   bash perf/gpu_lora.sh [CASE ...]        default: every case above
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_lora}; BUDGET_S=${BUDGET_S:-520}
source perf/gpu_synthetic_task.sh
CASES=("$@"); [ ${#CASES[@]} -gt 0 ] || CASES=(1.5b-full 1.5b-r64-merged 1.5b-r64-adapter 7b-r16-merged
                                               7b-r64-merged 7b-r64-adapter)
STEP="data.prompts_per_step=32 rollout.n=8 rollout.max_new_tokens=128 actor.micro_batch_size=16
      actor.ppo_mini_batch_size=256 actor.logprob_micro_batch_size=32 rollout.gpu_memory_utilization=0.3
      actor.optim.lr=1e-5 trainer.steps=3 trainer.save_every=0 trainer.progress=false validation.enabled=false"
for CASE in "${CASES[@]}"; do
  if [ $SECONDS -gt "$BUDGET_S" ]; then echo "gpu_lora: $CASE skipped (budget of $BUDGET_S s spent)"; continue; fi
  model=qwen2.5-${CASE%%-*}; rest=${CASE#*-}
  case $rest in
    full) if [ "${CASE%%-*}" = 7b ]; then extra="actor.optim.cpu_offload=0.8 actor.recompute=true actor.micro_batch_size=8"
          else extra=""; fi ;;
    r*-merged|r*-adapter) rank=${rest%%-*}; rank=${rank#r}
          extra="actor.lora.rank=$rank actor.lora.alpha=$((2 * rank)) actor.lora.sync=${rest#*-}" ;;
    *) echo "gpu_lora: unknown case $CASE"; exit 2 ;;
  esac
  start=$SECONDS
  python3 -m megarl.cli train model.path=preset:$model model.tokenizer=$OUT/tok model.dtype=bfloat16 \
    "data.train_files=[$OUT/prompts.jsonl]" data.prepare=null data.use_chat_template=false "data.instruction=''" \
    reward.fn=tests.rl_tasks:says_target rollout.engine=vllm $STEP $extra \
    run.output_dir=$OUT run.name=$CASE > "$OUT/$CASE.log" 2>&1 || { tail -30 "$OUT/$CASE.log"; echo "gpu_lora: $CASE FAILED"; }
  echo "gpu_lora: $CASE done ($((SECONDS - start)) s)"
done
python3 - "$OUT" "${CASES[@]}" <<'PY'
import json, sys
from pathlib import Path
out, cases = Path(sys.argv[1]), sys.argv[2:]
G = 2**30
rows = ["| case | update peak GiB | step s | generate s | old log-prob s | reference s | update s | weight sync s "
        "| merge s | tokens/s/GPU | generate tokens/s | rollout-trainer log-prob diff |", "|" + "---|" * 12]
for case in cases:
    f = out / case / "metrics.jsonl"
    steps = [json.loads(l) for l in f.read_text().splitlines()][1:] if f.is_file() else []
    if not steps:
        rows.append(f"| {case} | (no steps) |" + " |" * 10)
        continue
    mean = lambda k: sum(m.get(k, 0.0) for m in steps) / len(steps)
    rows.append(f"| {case} | {max(m.get('memory/actor_update/peak_bytes', 0) for m in steps) / G:.2f} "
                f"| {mean('time/step'):.2f} | {mean('time/generate'):.2f} | {mean('time/old_logprobs'):.2f} "
                f"| {mean('time/reference'):.2f} | {mean('time/actor_update'):.2f} | {mean('time/reshard'):.3f} "
                f"| {mean('reshard/merge_s'):.3f} | {mean('perf/tokens_per_s_per_gpu'):,.0f} "
                f"| {mean('throughput/generate_tokens_per_s'):,.0f} | {mean('actor/rollout_vs_old_logprob_diff'):.4f} |")
table = "\n".join(rows)
(out / "lora_results.md").write_text(table + "\n")
print(table)
PY
echo "gpu_lora: $SECONDS s"
