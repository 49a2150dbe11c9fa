#!/usr/bin/env bash
# DAPO on the H200 main job (issue 18), in one command from the repo root:   bash perf/gpu_dapo.sh
#
# Needs what perf/gpu_bench_step.sh's smollm2 case needs: the vLLM wheels (perf/install_wheels.sh: chunks
# uploaded to /tmp/whl, .whl carried; skipped on a kept machine where they import), the SmolLM2-135M GGUF
# (SMOL_GGUF, default /tmp/smol.gguf, else joined from /tmp/smol.gguf.part-aa and -ab) and GSM8K (GSM8K_DIR with
# train.jsonl and test.jsonl, default /tmp/gsm8k, else the carried .gpu/smol/p2/gsm8k). Stages:
#   1. install, build: the wheels into /tmp/site, megarl._C (both skipped when already done);
#   2. first_step: the first-step exactness check in bf16 with vLLM rollouts: one RL step of the DAPO config
#      with one mini-batch and one epoch (32 prompts x 8 samples = the whole batch in one optimizer step, eager
#      vLLM for a short start); its metrics must show actor/ppo_kl_first_minibatch == 0 and
#      actor/log_ratio_absmax_first_minibatch == 0 (the update's log-probs are the old ones bit for bit);
#   3. dapo: parallel_configs/gpu_1xh200_smollm2_gsm8k_dapo.yaml for 100 steps, validating greedily on all
#      1,319 GSM8K test problems (strict extractor, at most 256 new tokens) before step 1 and after step 100;
#      the run writes report.md and its plots at the end. A checkpoint every 25 steps: when the budget would
#      cut it, it is stopped cleanly (SIGINT) and a second call of the script on the same machine resumes it
#      (stage 2 is not repeated once it passed);
#   4. summary: $OUT/dapo_summary.md, a table by 10 steps (train reward and accuracy, response length, share cut
#      at 256 tokens, groups with signal kept by dynamic sampling, overlong penalty, rollout-vs-old k3 KL and
#      TIS truncation, step time) and the validation accuracy before and after, in the format of the GRPO run's
#      table in perf/RESULTS.md.
# $OUT (default runs/gpu_dapo) receives the logs, the run's metrics.jsonl, report.md and plots, samples and
# validation samples (not the checkpoints, which stay in /tmp/runs). Expected on one H200: ~1.5 min for stage 2
# (GGUF load, eager vLLM, one step), ~1.5 min start-up of stage 3 (vLLM with CUDA graphs), ~10 s per validation,
# ~3.5-4 s per step (one generation round of 256 samples instead of the GRPO run's 512, at ~5.4 s/step): about
# 9 minutes in all, within one 10-minute call when the wheels are already installed. The last line is
# "gpu_dapo: PASS" or "gpu_dapo: FAIL" (exit status 0 or 1).
set -uo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_lib.sh  # begin, stage, finish, install_wheels, build_extension, train_resumable
begin gpu_dapo 585

source perf/gpu_smollm2_gsm8k.sh  # SMOL_GGUF, GSM8K_DIR
export CONFIG=parallel_configs/gpu_1xh200_smollm2_gsm8k_dapo.yaml RUNS=/tmp/runs DATA=/tmp/data/gsm8k
export DEADLINE=$(( $(date +%s) + BUDGET_S ))

first_step() {
  rm -rf "$RUNS/dapo-first-step"
  python3 -m megarl.cli train "$CONFIG" data.gsm8k_source="$GSM8K_DIR" "data.train_files=[$DATA/train.parquet]" \
    run.output_dir="$RUNS" run.name=dapo-first-step trainer.progress=false trainer.report=false \
    validation.enabled=false trainer.steps=1 trainer.save_every=0 actor.ppo_mini_batch_size=256 \
    actor.ppo_epochs=1 algorithm.dynamic_sampling.enabled=false rollout.enforce_eager=true || return 1
  cp "$RUNS/dapo-first-step/metrics.jsonl" "$OUT/first_step_metrics.jsonl" 2>/dev/null
  python3 - "$OUT/first_step_metrics.jsonl" <<'EOF'
import json
import sys

m = json.loads(open(sys.argv[1]).read().splitlines()[0])
kl, dev = m["actor/ppo_kl_first_minibatch"], m["actor/log_ratio_absmax_first_minibatch"]
print(f"step 1 (bf16, vLLM rollouts): actor/ppo_kl first mini-batch {kl!r}, max |log-prob - old log-prob| "
      f"{dev!r}, |rollout - old log-prob| {m['actor/rollout_vs_old_logprob_diff']:.4f}, rollout-vs-old k3 KL "
      f"{m['rollout_corr/kl_k3']:.2e}")
assert kl == 0.0 and dev == 0.0, "the update's log-probs differ from the old log-probs at the first mini-batch"
EOF
}

dapo() {  # stopped 30 s before the budget ends and resumed by the next call (train_resumable), then the copy
  train_resumable dapo "$CONFIG" data.gsm8k_source="$GSM8K_DIR" "data.train_files=[$DATA/train.parquet]" \
    "validation.files=[$DATA/test.parquet]" validation.num_prompts=0 validation.max_new_tokens=256
}

summary() {
  python3 - "$OUT/dapo/metrics.jsonl" "$OUT/dapo_summary.md" <<'EOF'
import json
import sys

import numpy as np

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
steps = [r for r in rows if r["step"] > 0 and "reward/mean" in r]
val = [(r["step"], r["val/accuracy"], r.get("val/clip_ratio"), r.get("val/reward_mean")) for r in rows
       if "val/accuracy" in r]
cols = [("train reward", "reward/mean", "{:.3f}"), ("train accuracy", "reward/accuracy", "{:.3f}"),
        ("response tokens", "response/length_mean", "{:.0f}"), ("cut at 256", "response/clip_ratio", "{:.0%}"),
        ("groups kept / 32", "dynamic_sampling/groups_kept", "{:.1f}"),
        ("overlong penalty", "reward/overlong_penalty_mean", "{:.3f}"),
        ("k3 KL rollout vs old", "rollout_corr/kl_k3", "{:.1e}"),
        ("TIS truncated", "rollout_corr/truncated_frac", "{:.2%}"),
        ("step s", "time/step", "{:.2f}"), ("generate s", "time/generate", "{:.2f}")]
out = ["| steps | " + " | ".join(c for c, _, _ in cols) + " |", "| --- |" + " ---: |" * len(cols)]
for lo in range(1, len(steps) + 1, 10):
    chunk = [r for r in steps if lo <= r["step"] < lo + 10]
    cells = [fmt.format(np.mean([r.get(key, float("nan")) for r in chunk])) for _, key, fmt in cols]
    out.append(f"| {lo}-{chunk[-1]['step']} | " + " | ".join(cells) + " |")
out.append("")
for step, acc, clip, reward in val:
    out.append(f"validation at step {step}: accuracy {acc:.3f} ({round(acc * 1319)} of 1,319, strict extractor), "
               f"mean reward {reward:.3f}, cut at 256 tokens {clip:.0%}")
text = "\n".join(out)
open(sys.argv[2], "w").write(text + "\n")
print(text)
assert len(steps) == 100, f"{len(steps)} steps logged (the run did not finish: run the script again to resume)"
EOF
}

export -f install_wheels build_extension copy_run train_until train_resumable first_step dapo summary

stage install 200 install_wheels
[ $failed -eq 0 ] && stage build 200 build_extension
if [ $failed -eq 0 ]; then
  if [ -f "$RUNS/dapo-first-step.passed" ]; then  # $OUT is new at every call; /tmp stays on a kept machine
    echo "first_step passed in an earlier call: $(cat "$RUNS/dapo-first-step.passed")"
  else
    stage first_step 150 first_step
    [ $failed -eq 0 ] && line=$(grep "^step 1 " "$OUT/first_step.log") && mkdir -p "$RUNS" \
      && echo "$line" > "$RUNS/dapo-first-step.passed"
  fi
  stage dapo 600 dapo  # whatever is left of the budget; a cut run resumes in the next call
  [ $failed -eq 0 ] && stage summary 60 summary
fi
[ -f "$OUT/dapo_summary.md" ] && cat "$OUT/dapo_summary.md"
finish gpu_dapo
