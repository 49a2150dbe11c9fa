#!/usr/bin/env bash
# `megarl bench step` on one H200 (issue 10): per phase seconds, tokens/s/GPU, MFU, peak memory and NVML
# utilisation of real RL steps, one JSON per case in $OUT (default runs/gpu_bench_step).
#   bash perf/gpu_bench_step.sh CASE [key=value ...]      extra overrides go to the case's bench step
# Installs the wheels (perf/install_wheels.sh: the vLLM chunk folders uploaded to /tmp/whl, .whl carried) and
# builds megarl._C (perf/build_C.sh) first. Each case starts vLLM once (~1 min) and fits one 10-minute call:
#   mfu-1.5b      Qwen2.5-1.5B shape (random weights), 64 sequences of 2048 tokens, actor update in micro-batches
#                 of 4 x 2048 tokens: the actor-update MFU (target >= 40% of the measured 794 TFLOP/s)
#   mem-0.5b      Qwen2.5-0.5B shape, micro-batches of 8 x 2048 tokens: actor-update peak memory (target
#                 <= 40 GiB, was 125 GiB) and MFU (target >= 30%)
#   grpo-1.5b     the 1.5B GRPO step of perf/gpu_rl_step.sh (64 prompts x 8 samples x 256 new tokens) with its
#                 settings and the plain training paths (no kernels/): the "before" of the 18.3 s step
#   grpo-1.5b-fast  the same step with CUDA graphs, kernels/ (defaults) and larger micro-batches (target
#                 <= 12.2 s, 1.5x faster), and standalone vLLM on the same batches (target ratio >= 0.95)
#   qwen3-8b      Qwen3-8B shape cut to its first 4 of 36 layers (preset:qwen3-8b?layers=4), random weights, the
#                 grpo-1.5b-fast step with micro-batches of 8 (issue 43). Cut because megarl's memory estimate
#                 (megarl/launch/memory.py, bf16, 80 GiB GPU) of this GRPO step with a colocated vLLM (0.35) is
#                 208 GiB for all 36 layers (Adam's fp32 state alone 92 GiB; 189 GiB with micro-batches of 4);
#                 the 151936-word embedding and output layer (1.2B parameters) stay: 6 layers 79.4 GiB, 5 layers
#                 75.5 GiB (too near an H100's ~79 GiB), 4 layers 71.7 GiB
#   smollm2       parallel_configs/gpu_1xh200_smollm2_gsm8k.yaml: GRPO on GSM8K with the SmolLM2-135M GGUF
#                 (SMOL_GGUF, default /tmp/smol.gguf, else joined from /tmp/smol.gguf.part-aa and -ab: the two
#                 uploads of .gpu/smol/p1 and p2), GSM8K from GSM8K_DIR (default /tmp/gsm8k, else the carried
#                 .gpu/smol/p2/gsm8k), with standalone vLLM (target: step <= 8 s)
# The random-weight cases use the word-level tokenizer and synthetic prompts of tests/rl_tasks.py (3-5 words);
# a random model rarely samples its EOS, so responses run to max_new_tokens.
# Then the speed gate (`megarl bench gate`, megarl/bench/gate.py): the run against perf/history/bench_step.jsonl's
# runs of the same case (CASE and the extra overrides) on the same GPU; a step time or MFU worse than their median
# by more than 15% (GATE_TOLERANCE, e.g. 0.1 or step_time_s=0.1) fails the case; no such run: not compared. With
# GATE_APPEND=1 a passing run is appended to a copy of the history, $OUT/bench_step_history.jsonl (bring it back
# and commit it as perf/history/bench_step.jsonl to make the run a baseline).
# STANDALONE=0 leaves out the standalone-vLLM baseline of grpo-1.5b-fast and smollm2 (a second engine start and
# three passes, ~3 minutes on an H100), for a pair of runs that compares the RL step alone (perf/gpu_exact.sh).
# Prints the bench table; the last line is "gpu_bench_step CASE: PASS|FAIL (N s)".
set -uo pipefail
cd "$(dirname "$0")/.."
CASES="mfu-1.5b mem-0.5b grpo-1.5b grpo-1.5b-fast qwen3-8b smollm2"
CASE=${1:?usage: bash perf/gpu_bench_step.sh CASE [key=value ...] (CASE: $CASES)}
shift
EXTRA="$*"  # the case's extra overrides: part of its name in the speed gate's history
OUT=${OUT:-runs/gpu_bench_step}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
source perf/gpu_env.sh
START=$SECONDS
STANDALONE_VLLM=$([ "${STANDALONE:-1}" = 0 ] || echo --standalone-vllm)

bash perf/install_wheels.sh > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
bash perf/build_C.sh > "$OUT/build_C.log" 2>&1 || { tail -20 "$OUT/build_C.log"; exit 1; }

synthetic() {  # the word-level tokenizer and 4096 synthetic prompts (once); their overrides in SYN
  [ -f "$OUT/prompts.jsonl" ] || python3 -c "
from pathlib import Path
from tests.rl_tasks import make_tiny_model, write_prompts
make_tiny_model(Path('$OUT/tok')); write_prompts(Path('$OUT/prompts.jsonl'), 4096)" || exit 1
  SYN=(model.tokenizer="$OUT/tok" "data.train_files=[$OUT/prompts.jsonl]" data.prepare=null
       data.use_chat_template=false "data.instruction=''" reward.fn=tests.rl_tasks:says_target model.dtype=bfloat16
       rollout.engine=vllm trainer.progress=false run.output_dir="$OUT" run.name="$CASE")
}

# sequences of 2048 tokens: prompts of <= 5 tokens + 2040 new ones (+ 1 label column, rounded to 8)
LONG="data.max_prompt_length=8 rollout.max_new_tokens=2040 rollout.max_model_len=2048 data.prompts_per_step=8
      rollout.n=8 actor.ppo_mini_batch_size=64 rollout.gpu_memory_utilization=0.3 rollout.enforce_eager=false"
# perf/gpu_rl_step.sh's step
GRPO="data.prompts_per_step=64 rollout.n=8 rollout.max_new_tokens=256 actor.micro_batch_size=16
      actor.ppo_mini_batch_size=256 actor.logprob_micro_batch_size=32 rollout.gpu_memory_utilization=0.35"
case $CASE in
  mfu-1.5b|mem-0.5b|grpo-1.5b|grpo-1.5b-fast|qwen3-8b) synthetic ;;
esac
case $CASE in
  mfu-1.5b) set -- model.path=preset:qwen2.5-1.5b "${SYN[@]}" $LONG actor.micro_batch_size=4 \
              actor.logprob_micro_batch_size=8 "$@" --steps 2 --warmup 1 ;;
  mem-0.5b) set -- model.path=preset:qwen2.5-0.5b "${SYN[@]}" $LONG actor.micro_batch_size=8 \
              actor.logprob_micro_batch_size=8 "$@" --steps 2 --warmup 1 ;;
  grpo-1.5b) set -- model.path=preset:qwen2.5-1.5b "${SYN[@]}" $GRPO actor.kernels.chunked_logprob=false \
              actor.kernels.attention=local "$@" --steps 3 --warmup 1 ;;
  grpo-1.5b-fast) set -- model.path=preset:qwen2.5-1.5b "${SYN[@]}" $GRPO rollout.enforce_eager=false \
              actor.micro_batch_size=32 actor.logprob_micro_batch_size=64 "$@" --steps 3 --warmup 1 \
              $STANDALONE_VLLM ;;
  qwen3-8b) set -- "model.path=preset:qwen3-8b?layers=4" "${SYN[@]}" $GRPO rollout.enforce_eager=false \
              actor.micro_batch_size=8 actor.logprob_micro_batch_size=16 "$@" --steps 3 --warmup 1 ;;
  smollm2) source perf/gpu_smollm2_gsm8k.sh  # SMOL_GGUF, GSM8K_DIR
           set -- parallel_configs/gpu_1xh200_smollm2_gsm8k.yaml data.gsm8k_source="$GSM8K_DIR" \
              "data.train_files=[$OUT/gsm8k/train.parquet]" trainer.progress=false run.output_dir="$OUT" \
              run.name="$CASE" "$@" --steps 3 --warmup 1 $STANDALONE_VLLM ;;
  *) echo "unknown case $CASE ($CASES)"; exit 2 ;;
esac
python3 -m megarl.cli bench step "$@" --json "$OUT/$CASE.json" --overwrite 2>&1 | tee "$OUT/$CASE.log" \
  | grep -v -i -E "warn|^\s*warnings\.warn|INFO"
rc=${PIPESTATUS[0]}
python3 - "$OUT/$CASE.json" <<'EOF' || rc=1
import json
import sys
from pathlib import Path

if not Path(sys.argv[1]).exists():
    sys.exit(f"no report {sys.argv[1]}: bench step stopped before it started (see the log)")
r = json.loads(Path(sys.argv[1]).read_text())
if r["status"] != "ok":
    sys.exit(f"status {r['status']}: {r.get('error')}")
upd = r["phases"].get("actor_update", {})
print(f"step {r['step_time_s']:.2f} s, {r['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, generate "
      f"{r['generate_tokens_per_s']:.0f} tokens/s, actor update MFU {upd.get('mfu') or 0:.1%} (datasheet) / "
      f"{upd.get('mfu_vs_measured') or 0:.1%} (measured peak), actor update peak "
      f"{upd.get('peak_memory_bytes', 0) / 2**30:.1f} GiB, GPU util {r['gpu_util']['util_mean_pct'] or 0:.0f}%")
q = r.get("rollout") or {}
if q:
    print("rollout vs actor: " + ", ".join(f"{k} {v:.4g}" for k, v in q.items()))
s = r.get("standalone_vllm")
if s:
    runs = ", ".join(f"{x:.0f}" for x in s.get("tokens_per_s_runs") or [])
    print(f"standalone vLLM: median {s.get('tokens_per_s') or 0:.0f} tokens/s of [{runs}] (spread "
          f"{s.get('spread') or 0:.1%}), RL generate calls "
          f"{s.get('rl_generate_call_tokens_per_s') or 0:.0f} tokens/s: ratio {s.get('ratio') or 0:.3f} "
          f"(phase, sleep included: {s.get('ratio_generate_phase') or 0:.3f}); status {s['status']} "
          f"{s.get('error', '')}")
EOF
if [ $rc -eq 0 ]; then  # the speed gate
  HISTORY=perf/history/bench_step.jsonl
  GATE=()
  if [ "${GATE_APPEND:-0}" = 1 ]; then
    cp "$HISTORY" "$OUT/bench_step_history.jsonl" && HISTORY=$OUT/bench_step_history.jsonl && GATE=(--append)
  fi
  [ -n "${GATE_TOLERANCE:-}" ] && GATE+=(--tolerance "$GATE_TOLERANCE")
  python3 -m megarl.cli bench gate "$OUT/$CASE.json" --case "$CASE $EXTRA" --history "$HISTORY" "${GATE[@]}" \
    --source "perf/gpu_bench_step.sh $CASE $EXTRA" || rc=1
fi
[ $rc -eq 0 ] && echo "gpu_bench_step $CASE: PASS ($(( SECONDS - START )) s)" && exit 0
echo "gpu_bench_step $CASE: FAIL ($(( SECONDS - START )) s; log $OUT/$CASE.log)"
exit 1
