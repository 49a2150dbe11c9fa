#!/usr/bin/env bash
# Exact on-policy against the usual mismatch, learning (issue 46's "Learning" item), from the repo root:
#   bash perf/gpu_exact_learning.sh            (again on the same machine to resume a run the budget cut)
#
# SmolLM2-135M-Instruct, GRPO on GSM8K (parallel_configs/gpu_1xh200_smollm2_gsm8k.yaml, the GPU main job) at 16
# prompts x 8 samples a step for 100 steps, twice with the same seed: `plain` (vLLM's log-probs against the
# trainer's, the default) and `exact` (rollout.exact=true). Each validates greedily on 256 GSM8K test problems
# (256 new tokens) before step 1 and every 25 steps, and writes its report and plots. Needs what
# perf/gpu_dapo.sh needs: the vLLM wheels (perf/install_wheels.sh: chunks uploaded to /tmp/whl, .whl carried),
# the SmolLM2 GGUF (SMOL_GGUF, default /tmp/smol.gguf, else joined from /tmp/smol.gguf.part-aa and -ab) and GSM8K
# (GSM8K_DIR, default /tmp/gsm8k, else the carried .gpu/smol/p2/gsm8k). Stages:
#   1. install, build (skipped when done);
#   2. arms: the two runs at once on the GPU (a 100-step run takes ~6 minutes alone on an H100, and a GPU call
#      ten), each with a KV cache of a set size (rollout.kv_cache_memory_bytes: vLLM's start-up memory profile
#      fails when another process frees memory meanwhile, as the other run's engine does going to sleep), each
#      stopped cleanly (SIGINT) 30 s before the budget ends and resumed from its last checkpoint (every 25 steps)
#      by the next call on the same machine; a finished run is not repeated. Their logs: $OUT/plain.log and
#      $OUT/exact.log. Their step times are those of two runs sharing a GPU;
#   3. compare: $OUT/exact_learning.md, by 10 steps side by side: reward, accuracy, response length,
#      token_mult_prob_error, gen_kl_error, the share of tokens whose two log-probs are equal, step and
#      generation time; then both validations. It fails unless both runs finished and every exact step has
#      exact_tokens_frac 1.0.
# $OUT (default runs/gpu_exact_learning) receives the logs and each run's metrics, report, plots and samples;
# checkpoints stay in /tmp/runs. The last line is "gpu_exact_learning: PASS" or "... FAIL" (exit status 0 or 1).
set -uo pipefail
cd "$(dirname "$0")/.."
source perf/gpu_lib.sh  # begin, stage, finish, install_wheels, build_extension, copy_run, train_resumable
begin gpu_exact_learning 585

source perf/gpu_smollm2_gsm8k.sh  # SMOL_GGUF, GSM8K_DIR
export CONFIG=parallel_configs/gpu_1xh200_smollm2_gsm8k.yaml RUNS=/tmp/runs DATA=/tmp/data/gsm8k
export DEADLINE=$(( $(date +%s) + BUDGET_S ))

arm() {  # arm NAME [overrides...]: the 100-step run NAME (train_resumable), not repeated once it finished
  local name=$1
  shift
  if [ -f "$RUNS/$name/summary.json" ]; then echo "$name finished in an earlier call"; copy_run "$name"; return 0; fi
  train_resumable "$name" "$CONFIG" data.gsm8k_source="$GSM8K_DIR" "data.train_files=[$DATA/train.parquet]" \
    "validation.files=[$DATA/test.parquet]" validation.num_prompts=256 validation.max_new_tokens=256 \
    validation.every=25 data.prompts_per_step=16 actor.ppo_mini_batch_size=64 trainer.steps=100 trainer.save_every=25 \
    run.seed=1 "$@"
}

compare() {
  python3 - "$OUT/plain/metrics.jsonl" "$OUT/exact/metrics.jsonl" "$OUT/exact_learning.md" <<'EOF'
import json
import sys

import numpy as np

runs = {name: [json.loads(line) for line in open(path) if line.strip()]
        for name, path in (("plain", sys.argv[1]), ("exact", sys.argv[2]))}
steps = {name: [r for r in rows if r["step"] > 0 and "reward/mean" in r] for name, rows in runs.items()}
cols = [("reward", "reward/mean", "{:.3f}"), ("accuracy", "reward/accuracy", "{:.3f}"),
        ("response tokens", "response/length_mean", "{:.0f}"),
        ("token_mult_prob_error", "mismatch/token_mult_prob_error", "{:.4f}"),
        ("gen_kl_error", "mismatch/gen_kl_error", "{:.1e}"),
        ("equal log-probs", "mismatch/exact_tokens_frac", "{:.3f}"),
        ("step s", "time/step", "{:.2f}"), ("generate s", "time/generate", "{:.2f}")]
head = " | ".join(f"{c} {name}" for c, _, _ in cols for name in steps)
out = [f"| steps | {head} |", "| --- |" + " ---: |" * (len(cols) * len(steps))]
for lo in range(1, 101, 10):
    cells = []
    for _, key, fmt in cols:
        for rows in steps.values():
            chunk = [r.get(key, float("nan")) for r in rows if lo <= r["step"] < lo + 10]
            cells.append(fmt.format(np.mean(chunk)) if chunk else "")
    out.append(f"| {lo}-{lo + 9} | " + " | ".join(cells) + " |")
out.append("")
for name, rows in runs.items():
    for r in rows:
        if "val/accuracy" in r:
            out.append(f"{name}: validation at step {r['step']}: accuracy {r['val/accuracy']:.3f} of 256 problems, "
                       f"mean reward {r['val/reward_mean']:.3f}")
text = "\n".join(out)
open(sys.argv[3], "w").write(text + "\n")
print(text)
for name, rows in steps.items():
    assert len(rows) == 100, f"{name}: {len(rows)} steps logged (run the script again to resume)"
fracs = [r["mismatch/exact_tokens_frac"] for r in steps["exact"]]
assert all(f == 1.0 for f in fracs), f"exact: log-probs differ at steps {[i + 1 for i, f in enumerate(fracs)
                                                                      if f != 1.0]}"
EOF
}

arms() {  # both runs at once (the exact one started 30 s later, so that the two engines do not compile at once)
  local share=rollout.kv_cache_memory_bytes=$(( 4 << 30 ))  # 128 sequences of 640 tokens take ~1.9 GiB
  arm plain "$share" > "$OUT/plain.log" 2>&1 &
  local plain=$!
  sleep 30
  arm exact "$share" rollout.exact=true > "$OUT/exact.log" 2>&1 &
  local exact=$!
  wait $plain
  local rc_plain=$?
  wait $exact
  local rc_exact=$?
  echo "plain: exit $rc_plain ($(tail -n 1 "$OUT/plain.log")); exact: exit $rc_exact ($(tail -n 1 "$OUT/exact.log"))"
  [ $rc_plain -eq 0 ] && [ $rc_exact -eq 0 ]
}

export -f install_wheels build_extension copy_run train_until train_resumable arm arms compare

stage install 200 install_wheels
[ $failed -eq 0 ] && stage build 200 build_extension
if [ $failed -eq 0 ]; then  # whatever is left of the budget; a cut run resumes in the next call
  stage arms 600 arms
  [ $failed -eq 0 ] && stage compare 60 compare
fi
[ -f "$OUT/exact_learning.md" ] && cat "$OUT/exact_learning.md"
finish gpu_exact_learning
